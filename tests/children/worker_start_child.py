"""A process that starts DataLoader worker pools under a fork hazard
(``tests/workers/test_worker_start.py``).

``stuck LOADER``: the first worker forked stays stuck right after the fork, before any code of the
worker runs (an after-fork hook that never returns: the place where CPython waits for a lock an
exiting thread of the parent held at the fork). ``LOADER`` is ``ours`` or ``plain``.

``feeders LOADER``: many passes in a row, each left after one batch (its pool shut down, its queue
feeder threads told to stop); prints how many forks happened while such a thread was still stopping.
"""

from __future__ import annotations

import os
import sys
import time

from torch.utils.data import DataLoader

from loader_resume import ResumableDataLoader
from loader_resume.workers.torch_internals import closing_feeder_threads

DATA = list(range(64))


def build(kind: str) -> DataLoader:
    if kind == "ours":
        loader = ResumableDataLoader(DATA, batch_size=4, shuffle=True, num_workers=2, seed=3)
        loader.worker_start_timeout = 3.0
        return loader
    return DataLoader(DATA, batch_size=4, shuffle=True, num_workers=2)


def stuck(kind: str) -> None:
    armed = [True]

    def after_fork_in_child() -> None:
        if armed[0]:
            time.sleep(3600)

    def after_fork_in_parent() -> None:
        armed[0] = False  # only the first worker is stuck

    os.register_at_fork(after_in_child=after_fork_in_child, after_in_parent=after_fork_in_parent)
    loader = build(kind)
    started = time.monotonic()
    try:
        batches = list(loader)
    except RuntimeError as error:
        print(
            f"raised after {time.monotonic() - started:.1f} s: {type(error).__name__}: {error}",
            flush=True,
        )
        return
    print(f"delivered {len(batches)} batches", flush=True)


def feeders(kind: str) -> None:
    hazards = [0]

    def before_fork() -> None:
        hazards[0] += bool(closing_feeder_threads())

    os.register_at_fork(before=before_fork)
    loader = build(kind)
    for _ in range(int(sys.argv[3])):
        iterator = iter(loader)
        next(iterator)
        del iterator
    print(f"forks while a feeder thread stopped: {hazards[0]}", flush=True)


if __name__ == "__main__":
    {"stuck": stuck, "feeders": feeders}[sys.argv[1]](sys.argv[2])
