"""Datasets and builders shared by the tests and their child scripts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader


class Augmented(Dataset[dict[str, Any]]):
    """Map-style dataset whose items draw from torch, numpy and random, as augmentation code
    does."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "id": index,
            "torch": torch.rand(2),
            "numpy": np.random.rand(),
            "random": random.random(),
        }


def make(n: int = 10, **kwargs: Any) -> ResumableDataLoader[Any]:
    kwargs.setdefault("batch_size", 3)
    return ResumableDataLoader(Augmented(n), **kwargs)


def seed_all(seed: int) -> None:
    """Seed the three global generators the loader keys (torch, numpy, random)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def caller_draws() -> tuple[float, float, float]:
    """One draw from each global generator: equal before and after a loop means the loop left them
    alone."""
    return torch.rand(()).item(), float(np.random.rand()), random.random()


def ids(batches: list[Any]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index] + 0.1 * torch.randn(8), self.y[index], index


class NoisyEverywhere(Noisy):
    """The shared data; its augmentation also draws from numpy and random (all three keyed
    generators)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        noise = 0.1 * torch.randn(8) + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return self.x[index] + noise, self.y[index], index


class NoisyStream(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """The same data as a stream without __len__, sharded over ranks and workers, position as
    state."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.data, self.rank, self.world, self.i = NoisyEverywhere(n), rank, world, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(self.rank * workers + worker, len(self.data), self.world * workers)
        while self.i < len(mine):
            self.i += 1
            yield self.data[mine[self.i - 1]]
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class Shards(IterableDataset[dict[str, Any]]):
    """Worker w serves ids w, w+W, ... below n; worker 0 also serves 5 extra ids, so workers run dry
    at different times. Every item draws from torch, numpy and random, like a stream
    augmentation."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def _mine(self) -> list[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return list(range(worker, self.n, workers)) + (
            list(range(self.n, self.n + 5)) if worker == 0 else []
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        mine = self._mine()
        while self.i < len(mine):
            index = mine[self.i]
            self.i += 1
            yield {
                "id": index,
                "torch": torch.rand(2),
                "numpy": np.random.rand(),
                "random": random.random(),
            }
        self.i = 0


class StatefulShards(Shards):
    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class PlainSampler(torch.utils.data.Sampler[int]):
    """No state: a function of the epoch only, so it can be replayed."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class CountsOwnEpochs(IterableDataset[int]):
    """A stream that keeps its own epoch count (no set_epoch, no state_dict): its order depends on
    it."""

    def __init__(self) -> None:
        self.epochs_seen = 0

    def __iter__(self) -> Iterator[int]:
        self.epochs_seen += 1
        order = list(range(12))
        random.Random(self.epochs_seen).shuffle(order)
        return iter(order)
