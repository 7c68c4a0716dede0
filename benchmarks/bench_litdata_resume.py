"""First batch after a resume at 90 % of a litdata epoch: litdata's protocol, replay, litdata.

    python benchmarks/bench_litdata_resume.py               # n = 1e5 items: ~1 min on 2 cores
    python benchmarks/bench_litdata_resume.py --n 20000     # quicker

``litdata.optimize`` writes ``n`` small items (``{"id": i, "x": 8 float32}``, ~40 chunks) into a
temp dir. Each loader (``batch_size=64``, litdata's ``shuffle=True``) is iterated to 90 % of the
epoch's batches and its ``state_dict()`` taken; the next batch of that same run is the expected one.
Timed: build a fresh dataset and loader, ``load_state_dict(state)``, ``next(iter(loader))`` (worker
start-up included). Median over ``--repeats`` restores of the same state, loaders taking turns
(order reversed every other round). "replay" is the loader's fallback (its behaviour before it fed
litdata's protocol): a subclass hiding ``state_dict`` from it. For scale: one whole epoch of a plain
``torch.utils.data.DataLoader`` over the same data (median, same repeats). A wrong first batch (or a
missing / unexpected "replaying" warning) fails ResumableDataLoader's rows.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from logging.handlers import BufferingHandler
from typing import Any

import litdata
import numpy as np
import torch
from common import markdown, write_docs_section
from torch.utils.data import DataLoader

from loader_resume import ResumableDataLoader
from loader_resume.streams.library_protocols import library_protocol
from loader_resume.thirdparty import is_stateful

BATCH = 64


def item(i: int) -> dict[str, Any]:
    return {"id": i, "x": np.full(8, i, np.float32)}


class Hidden(litdata.StreamingDataset):  # type: ignore[misc]
    """litdata's dataset without its resume protocol, as the loader saw it before: it restores by
    replay."""

    state_dict = None  # litdata's dataset never calls it itself (only StreamingDataLoader does)


LOADERS = {
    "ResumableDataLoader, litdata's protocol": (litdata.StreamingDataset, ResumableDataLoader),
    "ResumableDataLoader, replay (protocol hidden)": (Hidden, ResumableDataLoader),
    "litdata.StreamingDataLoader": (litdata.StreamingDataset, litdata.StreamingDataLoader),
}


def build(name: str, folder: str, workers: int) -> Any:
    dataset, loader = LOADERS[name]
    return loader(
        dataset(input_dir=folder, shuffle=True, seed=7), batch_size=BATCH, num_workers=workers
    )


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return [int(i) for i in batch["id"]]


def cut_state(name: str, folder: str, workers: int, cut: int) -> tuple[Any, list[int]]:
    """The state after ``cut`` batches and the batch the same uninterrupted run delivers next."""
    loader = build(name, folder, workers)
    iterator = iter(loader)
    for _ in range(cut):
        next(iterator)
    state = copy.deepcopy(loader.state_dict())
    expected = ids(next(iterator))
    del iterator
    return state, expected


def resume(
    name: str, folder: str, workers: int, state: Any, log: BufferingHandler
) -> tuple[float, list[int], str]:
    log.flush()  # (empties its buffer)
    state = copy.deepcopy(state)
    start = time.perf_counter()
    loader = build(name, folder, workers)
    loader.load_state_dict(state)
    iterator = iter(loader)
    first = next(iterator)
    seconds = time.perf_counter() - start
    del iterator  # (workers shut down outside the timed part)
    return seconds, ids(first), " ".join(r.getMessage() for r in log.buffer)


def plain_epoch(folder: str, workers: int) -> float:
    start = time.perf_counter()
    for _ in DataLoader(
        litdata.StreamingDataset(input_dir=folder, shuffle=True, seed=7),
        batch_size=BATCH,
        num_workers=workers,
    ):
        pass
    return time.perf_counter() - start


def report(args: argparse.Namespace, folder: str) -> str:
    log = BufferingHandler(1 << 20)
    logging.getLogger("loader_resume").addHandler(log)
    hidden = Hidden(input_dir=folder)
    assert library_protocol(hidden) is None and not is_stateful(hidden)
    cut = int(args.at * math.ceil(args.n / BATCH))
    rows = []
    for workers in args.workers:
        epoch = statistics.median(plain_epoch(folder, workers) for _ in range(args.repeats))
        rows.append(
            [
                "plain DataLoader, one whole epoch",
                str(workers),
                f"{epoch * 1000:,.0f} ms",
                "100.0 %",
                "n/a",
            ]
        )
        states = {name: cut_state(name, folder, workers, cut) for name in LOADERS}
        times: dict[str, list[float]] = {name: [] for name in LOADERS}
        matched = dict.fromkeys(LOADERS, True)
        for turn in range(args.repeats):
            for name in (list(LOADERS) if turn % 2 == 0 else list(LOADERS)[::-1]):
                state, expected = states[name]
                seconds, got, logged = resume(name, folder, workers, state, log)
                times[name].append(seconds)
                matched[name] &= got == expected
                if LOADERS[name][1] is ResumableDataLoader:
                    assert got == expected, (
                        f"{name}, num_workers={workers}: wrong first batch after resume"
                    )
                    assert ("replaying" in logged) == (LOADERS[name][0] is Hidden), (name, logged)
        for name in LOADERS:
            median = statistics.median(times[name])
            rows.append(
                [
                    name,
                    str(workers),
                    f"{median * 1000:,.1f} ms",
                    f"{median / epoch * 100:.1f} %",
                    "yes" if matched[name] else "**no**",
                ]
            )
            print(rows[-1], flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"litdata {litdata.__version__}")
    head = (
        f"Measured by `python benchmarks/bench_litdata_resume.py` ({machine}): n = {args.n:,} "
        f"items, batch {BATCH}, resume after {cut} of {math.ceil(args.n / BATCH)} batches; medians "
        f"over {args.repeats}."
    )
    return (
        head
        + "\n\n"
        + markdown(
            [
                "loader",
                "num_workers",
                "first batch after resume",
                "of a plain epoch",
                "= uninterrupted run's batch",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=100_000, help="items in the epoch")
    parser.add_argument(
        "--at", type=float, default=0.9, help="resume after this fraction of the epoch's batches"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--no-write", dest="write", action="store_false", help="print only, leave the docs"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "optimized")
        start = time.perf_counter()
        try:  # NOTE: litdata.optimize sets the process-wide start method; the loaders' workers fork
            litdata.optimize(
                fn=item,
                inputs=list(range(args.n)),
                output_dir=folder,
                chunk_size=max(1, args.n // 40),
                num_workers=os.cpu_count() or 1,
                start_method="fork",
            )
        finally:
            multiprocessing.set_start_method("fork", force=True)
        print(f"litdata.optimize: {time.perf_counter() - start:.1f} s", flush=True)
        text = report(args, folder)
    print(text)
    if args.write:
        write_docs_section("litdata", text)


if __name__ == "__main__":
    main()
