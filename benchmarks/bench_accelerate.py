"""Accelerate: enable_resume's overhead, and start to first batch resuming at 90 % of an epoch.

    python benchmarks/bench_accelerate.py           # ~3 min; prints the tables, updates docs/
    python benchmarks/bench_accelerate.py --quick   # fewer rounds, docs untouched

1. Steps/s of a tiny model, 1 process, ``num_workers=2``: Accelerate's own prepared loader against
   the same script after ``enable_resume``. Rounds alternate (order reversed every other round);
   ratios are taken per round, and an A/A row (Accelerate against itself) shows the noise.
2. A fresh process resumes a 10^6-sample shuffled epoch at 90 % (batch 32, ``num_workers=0``): wall
   time from starting Python to holding the first batch, for ``enable_resume``'s automatic resume,
   Accelerate's ``load_state`` + ``skip_first_batches``, and ``use_stateful_dataloader=True`` +
   ``load_state``; the same start without any resume is the baseline (imports, model, loader).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import accelerate
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from common import Tiny, interleaved, markdown, write_docs_section
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_resume import enable_resume

STEPS, BATCH, WARMUP = 300, 32, 10
N, AT = 10**6, 9 * 10**5


# --- 1. steps/s ----------------------------------------------------------------------------------
def steps_per_second(with_resume: bool) -> float:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, project_dir=tempfile.mkdtemp())
    resume = enable_resume(accelerator) if with_resume else None
    torch.manual_seed(0)
    data = torch.randn(STEPS * BATCH, 16)
    loader = DataLoader(
        TensorDataset(data, (data.sum(1) > 0).long()),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        if step == WARMUP:
            start = time.perf_counter()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    rate = (STEPS - WARMUP) / (time.perf_counter() - start)
    if resume is not None:
        resume.close()
    _shutdown_workers(loader)
    return rate


def _shutdown_workers(loader: Any) -> None:
    """Stop a persistent worker pool now: pools left to the garbage collector across rounds hang the
    exit."""
    for owner in (loader, getattr(loader, "base_dataloader", None)):
        iterator = getattr(owner, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            owner._iterator = None
    gc.collect()


# --- 2. process start to first batch --------------------------------------------------------------
def child(method: str, root: str, setup: bool) -> None:
    """One process: build, resume with ``method``, print when the first batch is in hand."""
    stateful = method == "stateful"
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, project_dir=root, dataloader_config=config)
    resume = enable_resume(accelerator, {"checkpoint_dir": root}) if method == "ours" else None
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Tiny(N), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if setup:
        make_checkpoint(method, accelerator, resume, loader, root)
        return
    start = time.perf_counter()
    if method == "skip":
        accelerator.load_state(root)
        loader = accelerator.skip_first_batches(loader, AT // BATCH)
    elif method == "stateful":
        accelerator.load_state(root)
    batch = next(iter(loader))  # ours: the newest checkpoint is loaded here, automatically
    print(f"FIRST BATCH {time.perf_counter() - start:.6f} {batch[0, 0].item()}", flush=True)


def make_checkpoint(
    method: str, accelerator: Accelerator, resume: Any, loader: Any, root: str
) -> None:
    if method == "ours":  # our state is a position: set it through the public API, then checkpoint
        state = loader.state_dict()
        loader.load_state_dict({**state, "position": AT})
        resume.save()
    elif method == "stateful":  # torchdata's state must be reached by iterating
        iterator = iter(loader)
        for _ in range(AT // BATCH):
            next(iterator)
        accelerator.save_state(root)
    elif method == "skip":
        accelerator.save_state(root)


def first_batch_seconds(method: str, root: str) -> tuple[float, float]:
    """(process start to first batch, load + first batch inside the process), in seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-W", "ignore", __file__, "--child", method, root],
                          capture_output=True, text=True, check=True)
    total = time.perf_counter() - start
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FIRST BATCH")]
    return total, float(line.split()[2])


def latency_table(rounds: int) -> str:
    methods = {"none": "no resume (baseline: imports, model, loader)",
               "ours": "enable_resume (automatic)",
               "skip": "`load_state` + `skip_first_batches`",
               "stateful": "`use_stateful_dataloader=True` + `load_state`"}
    roots = {method: tempfile.mkdtemp() for method in methods}
    for method in ("ours", "skip", "stateful"):
        subprocess.run(
            [sys.executable, "-W", "ignore", __file__, "--child", method, roots[method], "--setup"],
            check=True,
            capture_output=True,
        )
    times: dict[str, list[tuple[float, float]]] = {method: [] for method in methods}
    for turn in range(rounds):
        for method in (list(methods) if turn % 2 == 0 else list(methods)[::-1]):
            times[method].append(first_batch_seconds(method, roots[method]))
    rows = []
    for method, label in methods.items():
        total = statistics.median(t for t, _ in times[method])
        inside = statistics.median(i for _, i in times[method])
        rows.append([label, f"{total:.2f}", f"{inside * 1e3:.1f}"])
    return markdown(["resume at 90 % of 10^6 samples", "process start to first batch (s)",
                     "of which load + first batch (ms)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds; do not touch the docs")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "ROOT"), help=argparse.SUPPRESS)
    parser.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if args.child:
        child(*args.child, setup=args.setup)
        return
    rounds = 3 if args.quick else 9
    result = interleaved(
        {
            "plain": lambda: steps_per_second(False),
            "again": lambda: steps_per_second(False),
            "ours": lambda: steps_per_second(True),
        },
        rounds,
    )
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"Accelerate {accelerate.__version__}")
    text = (
        f"Measured by `python benchmarks/bench_accelerate.py` ({machine}).\n\n"
        f"Training speed: a 16-32-2 MLP, batch {BATCH}, {STEPS} steps, `num_workers=2`, 1 process; "
        f"median over {rounds} interleaved rounds.\n\n"
        + markdown(
            ["Accelerate loop", "steps/s", "ratio"],
            [
                ["`accelerator.prepare` (Accelerate's loader)", f"{result['plain']:,.0f}", "1.000"],
                [
                    "the same again (A/A: the noise)",
                    f"{result['again'] * result['plain']:,.0f}",
                    f"{result['again']:.3f}",
                ],
                [
                    "after `enable_resume` (our loader, keyed)",
                    f"{result['ours'] * result['plain']:,.0f}",
                    f"{result['ours']:.3f}",
                ],
            ],
        )
        + f"\n\nResume latency: a fresh process, median of {rounds} runs.\n\n"
        + latency_table(rounds)
    )
    print(text)
    if not args.quick:
        write_docs_section("accelerate", text)


if __name__ == "__main__":
    main()
