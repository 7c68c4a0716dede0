"""One Mosaic Streaming scenario in a process of its own (run by ``test_mosaic.py``).

NOTE: a process cannot hold many Mosaic datasets: each registers shared memory under a new prefix,
and each new dataset opens every earlier prefix's without closing it (16 descriptors a dataset,
quadratically more as they accumulate: measured on mosaicml-streaming 0.13), so one scenario's ~20
datasets is a process's share.

    python mosaic_child.py DATA_DIR MODE WORKERS SHUFFLE PERSISTENT
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
import torchvision_cpu  # noqa: F401
from streaming import StreamingDataset

from loader_resume import ResumableDataLoader
from loader_resume.state import StateError
from loader_resume.testing import assert_resumes_exactly, fingerprint

BATCH = 4


class Noisy(StreamingDataset):  # type: ignore[misc]
    """Mosaic's dataset drawing augmentations from torch, numpy and random, as a user subclasses
    it."""

    reads = 0

    def __getitem__(self, index: int) -> dict[str, Any]:
        type(self).reads += 1
        item = super().__getitem__(index)
        return {
            "id": int(item["id"]),
            "torch": torch.rand(()).item(),
            "numpy": float(np.random.rand()),
            "random": random.random(),
        }


def make(folder: str, workers: int, shuffle: bool, persistent: bool) -> ResumableDataLoader[Any]:
    dataset = Noisy(local=folder, shuffle=shuffle, shuffle_seed=7, batch_size=BATCH)
    return ResumableDataLoader(
        dataset, batch_size=BATCH, num_workers=workers, persistent_workers=persistent, seed=1
    )


def main() -> None:
    folder, mode, workers, shuffle, persistent = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    # every cut over 3 epochs, each resumed in a fresh loader over a fresh dataset
    if mode == "cuts":
        loader = make(folder, workers, bool(shuffle), bool(persistent))
        orders = [[int(i) for b in loader for i in b["id"]] for _ in range(2)]
        assert all(sorted(o) == list(range(24)) for o in orders), orders
        # Mosaic reshuffles per epoch it is told
        assert (orders[0] != orders[1]) == bool(shuffle), orders
        del loader
        report = assert_resumes_exactly(
            lambda: make(folder, workers, bool(shuffle), bool(persistent)), epochs=3
        )
        print("cuts", report)
    # O(1): the first batch after a resume at 5/6 of the epoch reads 4 items
    elif mode == "first-batch":
        loader = make(folder, 0, True, False)
        iterator = iter(loader)
        # into the 4th epoch: Mosaic's own counter would say epoch 0 in a new process
        for _ in range(3 * 6 + 5):
            try:
                next(iterator)
            except StopIteration:
                iterator = iter(loader)
                next(iterator)
        state, rest = loader.state_dict(), [fingerprint(b) for b in iterator]
        del iterator, loader
        resumed = make(folder, 0, True, False)
        resumed.load_state_dict(state)
        Noisy.reads = 0
        got = [fingerprint(b) for b in resumed]
        assert Noisy.reads == BATCH * len(rest) and got == rest, (Noisy.reads, got, rest)
    # refused, naming the field, never a silently different continuation
    elif mode == "other-workers":
        loader = make(folder, 2, True, False)
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        del iterator, loader
        try:
            make(folder, 0, True, False).load_state_dict(state)
        except StateError as error:
            assert "num_workers" in str(error), error
        else:
            raise AssertionError("a num_workers=2 state loaded into a num_workers=0 loader")
    # Mosaic's own batch_size must be the loader's: said at the first iter()
    elif mode == "batch-size":
        loader = ResumableDataLoader(
            Noisy(local=folder, shuffle=True, batch_size=2), batch_size=BATCH
        )
        try:
            next(iter(loader))
        except ValueError as error:
            assert "batch_size=2" in str(error) and "batch_size=4" in str(error), error
        else:
            raise AssertionError("a Mosaic batch_size other than the loader's was accepted")
    print("OK")


if __name__ == "__main__":
    main()
