"""Shared datasets and builders for the test suite."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from loader_resume import ResumableDataLoader


class Augmented(Dataset[dict[str, Any]]):
    """Map-style dataset whose items draw from torch, numpy and random, as augmentation code does."""

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
    """One draw from each global generator: equal before and after a loop means the loop left them alone."""
    return torch.rand(()).item(), float(np.random.rand()), random.random()


def ids(batches: list[Any]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


@pytest.fixture(autouse=True)
def _global_seeds() -> None:
    """Tests start from fixed global RNGs, so a test that depends on unkeyed values fails loudly."""
    seed_all(1234)
