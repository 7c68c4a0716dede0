"""DataLoader factories for test_check.py (imported by `loader-resume check` in fresh processes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import Augmented

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
