"""Shared pieces of the benchmarks: timing, datasets, and writing a table into the docs."""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"


class Tiny(Dataset[torch.Tensor]):
    """Items that cost nothing to make: the loader's own overhead is all that shows."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows = torch.arange(min(n, 1 << 16) * 4, dtype=torch.float32).view(-1, 4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index % len(self.rows)]


class Busy(Tiny):
    """Items that cost ~``micros`` µs of CPU each (a busy loop), like light
    decoding/augmentation."""

    def __init__(self, n: int, micros: float = 50.0) -> None:
        super().__init__(n)
        self.seconds = micros / 1e6

    def __getitem__(self, index: int) -> torch.Tensor:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return self.rows[index % len(self.rows)]


class Ints(Dataset[int]):
    """Python ints (``__getitem__`` returns the index): the cheapest item a map-style dataset can
    have."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Drawing(Tiny):
    """Tiny items with an augmentation that draws from torch, numpy and ``random`` for every
    item."""

    def __getitem__(self, index: int) -> torch.Tensor:
        row = self.rows[index % len(self.rows)]
        return row * torch.rand(()) + float(np.random.rand()) + random.random()


class Blob(Dataset[torch.Tensor]):
    """Items of ``floats`` float32s each (a batch of 64 is one tensor of 256 * floats bytes)."""

    def __init__(self, n: int, floats: int) -> None:
        self.n, self.floats = n, floats

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.floats,), float(index))


class TinyStream(IterableDataset[torch.Tensor]):
    """A stream of tiny items, split across workers, whose state is a few ints (like a file
    offset)."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0
        self.row = torch.zeros(4)

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while self.i < self.n // workers:
            self.i += 1
            yield self.row + (self.i * workers + worker)
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def batches_per_second(loader: Iterable[Any], batches: int) -> float:
    """Throughput over ``batches`` batches after the first (worker start-up excluded)."""
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches / (time.perf_counter() - start)


def epoch_micros(loader: Iterable[Any], clock: Callable[[], float] = time.perf_counter) -> float:
    """µs a batch over one whole epoch, from ``iter()`` to its end (every per-epoch cost
    included)."""
    start, batches = clock(), 0
    for _ in loader:
        batches += 1
    return (clock() - start) / max(batches, 1) * 1e6


def interleaved_epochs(
    loaders: dict[str, Iterable[Any]],
    rounds: int,
    clock: Callable[[], float] | Callable[[Any], Callable[[], float]] = time.perf_counter,
    *,
    per_loader: bool = False,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Whole epochs, loaders taking turns (order reversed every other round) after one untimed
    warm-up epoch each: (each loader's median ratio of throughput to the first loader's in the same
    round, µs a batch in each round). ``clock``: wall time, or ``time.process_time`` where all the
    work is in this process; with ``per_loader``, a function of the loader that gives its clock
    (:func:`pipeline_cpu_clock`)."""
    clocks = {name: clock(loader) if per_loader else clock  # type: ignore[call-arg]
              for name, loader in loaders.items()}
    for name, loader in loaders.items():
        epoch_micros(loader, clocks[name])  # type: ignore[arg-type]
    micros: dict[str, list[float]] = {name: [] for name in loaders}
    names = list(loaders)
    for turn in range(rounds):
        for name in names if turn % 2 == 0 else names[::-1]:
            micros[name].append(epoch_micros(loaders[name], clocks[name]))  # type: ignore[arg-type]
    first = micros[names[0]]
    ratios = {name: statistics.median(f / m for f, m in zip(first, values, strict=True))
              for name, values in micros.items()}
    return ratios, micros


def _threads_cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of process ``pid`` so far (the scheduler's own count, in ns)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return total / 1e9


def pipeline_cpu_clock(loader: Any, workers: int) -> Callable[[], float]:
    """A clock of the CPU time of this process (all its threads) and of ``loader``'s persistent
    worker processes (all theirs): on a machine whose cores the pipeline fills, the work an epoch
    costs, without the time other tenants take (Linux; reads ``/proc``). Fails if the loader's
    workers cannot be found."""
    def clock() -> float:
        # NOTE: torch's; persistent workers live there
        iterator = getattr(loader, "_iterator", None)
        pids = [worker.pid for worker in getattr(iterator, "_workers", ())]
        if iterator is not None and len(pids) != workers:
            raise RuntimeError(
                f"{type(loader).__name__}: found {len(pids)} worker processes, expected {workers}"
            )
        return time.process_time() + sum(_threads_cpu_seconds(pid) for pid in pids)
    return clock


def interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each run's throughput as a ratio to the first run of the same round, median over ``rounds``.

    Runs take turns, in reversed order every other round (so no run always goes first), and each
    ratio is taken within one round, so the slow drift of a shared 2-core machine cancels. The first
    run's own entry is its median throughput.
    """
    ratios: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for turn in range(rounds):
        measured = {name: runs[name]() for name in (names if turn % 2 == 0 else names[::-1])}
        for name, value in measured.items():
            ratios[name].append(value if name == names[0] else value / measured[names[0]])
    return {name: statistics.median(values) for name, values in ratios.items()}


def median_micros(fn: Callable[[], Any], repeat: int = 2000) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_docs_section(name: str, text: str) -> None:
    """Replace the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->`` in the
    one page of the docs (``docs/*.md``) or the README that holds those markers."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    pages = [
        page for page in [README, *sorted(DOCS.glob("*.md"))] if pattern.search(page.read_text())
    ]
    if len(pages) != 1:
        raise SystemExit(
            f"{start} ... {end}: found in {[str(page) for page in pages]}; expected in one page"
        )
    pages[0].write_text(pattern.sub(lambda _: f"{start}\n{text}\n{end}", pages[0].read_text()))
