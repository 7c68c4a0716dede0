"""DataLoader factories for test_check.py (imported by `loader-resume check` in fresh processes)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from loader_resume import Mixture, ResumableDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.data import Augmented, CountsOwnEpochs

_UNSEEDED: np.random.Generator | None = None


class Unkeyed(Dataset[dict[str, Any]]):
    """Draws from a numpy Generator created per process without a seed: no keying can reach it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        global _UNSEEDED
        if _UNSEEDED is None:
            _UNSEEDED = np.random.default_rng()
        return {"id": index, "noise": torch.tensor(_UNSEEDED.random())}


def good() -> DataLoader[Any]:
    return DataLoader(Augmented(14), batch_size=3, shuffle=True, num_workers=2)


def unkeyed() -> DataLoader[Any]:
    return DataLoader(Unkeyed(), batch_size=3, shuffle=True)


class SystemShuffled(torch.utils.data.Sampler[int]):
    """A custom sampler whose order comes from the OS's entropy: no seed or keying reaches it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        order = list(range(self.n))
        random.SystemRandom().shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


def unstable_order() -> DataLoader[Any]:
    return DataLoader(Augmented(14), batch_size=3, sampler=SystemShuffled(14))


class WhereItRuns(Dataset[dict[str, Any]]):
    """Its values depend on the worker count (as a per-worker RNG or cache would): exact only at its
    own."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        return {
            "id": index,
            "noise": torch.tensor(float(info.num_workers if info is not None else 0)),
        }


def resumable_unkeyed() -> ResumableDataLoader[Any]:
    """Already resumable, built with num_workers=2: resumes exactly at 2 and diverges at 0."""
    return ResumableDataLoader(WhereItRuns(), batch_size=3, shuffle=True, num_workers=2)


class Counting(IterableDataset[dict[str, Any]]):
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter([{"id": i} for i in range(worker, 10, workers)])


def plain_stream() -> DataLoader[Any]:
    return DataLoader(Counting(), batch_size=2, num_workers=2)


def counts_own_epochs() -> DataLoader[Any]:
    return DataLoader(CountsOwnEpochs(), batch_size=3)


def mixture() -> ResumableDataLoader[Any]:
    """Two sources (14 and 5 items, drawing augmentations), 2 workers, 20 batches an epoch of 60
    samples."""
    return ResumableDataLoader(
        Mixture(
            {"big": Augmented(14), "small": Augmented(5)},
            {"big": 3, "small": 1},
            block_size=4,
            samples_per_epoch=60,
        ),
        batch_size=3,
        num_workers=2,
        seed=3,
    )


def mixture_schedule(loader: ResumableDataLoader[Any], delivered: int) -> None:
    """A weight schedule by step, as a training loop makes it."""
    if delivered in (2, 4):
        loader.dataset.set_weights(
            {"big": 1, "small": 1} if delivered == 2 else {"big": 0, "small": 1}
        )


_CALLS = [0]


def mixture_schedule_by_own_count(loader: ResumableDataLoader[Any], delivered: int) -> None:
    """The same schedule by a count of its own calls, which a resumed process starts again from
    0."""
    _CALLS[0] += 1
    mixture_schedule(loader, _CALLS[0])


class CountsSinceLoad(IterableDataset[int]):
    """A stream whose state is right once and wrong after that: a loaded state sets where it starts,
    but what it reports counts from that start (the offset is dropped), so a state taken after a
    resume is behind."""

    def __init__(self) -> None:
        self.start, self.done = 0, 0

    def __iter__(self) -> Any:
        for item in range(self.start + self.done, 20):
            self.done += 1
            yield item

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start, self.done = state["done"], 0


def counts_since_load() -> DataLoader[Any]:
    return DataLoader(CountsSinceLoad(), batch_size=2)
