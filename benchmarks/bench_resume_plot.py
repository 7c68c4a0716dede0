"""Time to the first batch after resuming at a position in the epoch: ours, StatefulDataLoader,
Accelerate.

    python benchmarks/bench_resume_plot.py  # ~1 min; writes docs/img/resume_latency.png, its table

Each loader is brought to the position for real (states are taken by iterating, nw=0), then a fresh
loader resumes and we time load + first batch. Accelerate's documented way is
``skip_first_batches``, which re-reads the skipped batches.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.data_loader import skip_first_batches
from common import Tiny, markdown, write_docs_section
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader_resume import ResumableDataLoader

N, BATCH = 10**6, 64
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9)
PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "resume_latency.png"


def _states(build: Any) -> dict[float, Any]:
    loader, states, done = build(), {}, 0
    iterator = iter(loader)
    for fraction in FRACTIONS:
        while done < int(N * fraction) // BATCH:
            next(iterator)
            done += 1
        states[fraction] = loader.state_dict()
    return states


def _time_resume(build: Any, state: Any) -> float:
    fresh = build()
    start = time.perf_counter()
    fresh.load_state_dict(state)
    next(iter(fresh))
    return time.perf_counter() - start


def _time_skip(fraction: float) -> float:
    torch.manual_seed(0)
    start = time.perf_counter()
    next(
        iter(
            skip_first_batches(
                DataLoader(Tiny(N), batch_size=BATCH, shuffle=True), int(N * fraction) // BATCH
            )
        )
    )
    return time.perf_counter() - start


def measure() -> dict[str, dict[float, float]]:
    ours = lambda: ResumableDataLoader(Tiny(N), batch_size=BATCH, shuffle=True)  # noqa: E731
    sdl = lambda: StatefulDataLoader(Tiny(N), batch_size=BATCH, shuffle=True)  # noqa: E731
    results: dict[str, dict[float, float]] = {}
    for name, build in (("loader-resume", ours), ("torchdata StatefulDataLoader", sdl)):
        states = _states(build)
        results[name] = {f: _time_resume(build, states[f]) for f in FRACTIONS}
    results["Accelerate skip_first_batches"] = {f: _time_skip(f) for f in FRACTIONS}
    return results


def plot(results: dict[str, dict[float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, by_fraction in results.items():
        axes.plot(
            [100 * f for f in by_fraction],
            [1000 * s for s in by_fraction.values()],
            marker="o",
            label=name,
        )
    axes.set_yscale("log")
    axes.set_xlabel("resume position (% of a 10^6-sample epoch, batch 64)")
    axes.set_ylabel("load + first batch (ms, log scale)")
    axes.set_title("Time to the first batch after resume")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)


def main() -> None:
    results = measure()
    plot(results)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    header = ["load + first batch, n = 1e6", *(f"{int(100 * f)} %" for f in FRACTIONS)]
    rows = [[name, *(f"{1000 * s:.1f} ms" for s in by.values())] for name, by in results.items()]
    text = (
        f"Measured by `python benchmarks/bench_resume_plot.py` ({machine}); nw=0, tiny items.\n\n"
        + markdown(header, rows)
        + "\n\n![time to first batch after resume](img/resume_latency.png)"
    )
    print(text)
    write_docs_section("resume", text)


if __name__ == "__main__":
    main()
