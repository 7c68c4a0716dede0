"""A global generator's state through its public API, where its memory is not laid out as
``loader_resume.keyed.rng_memory`` probed it: slower, the same values, compared by value."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["PublicApi", "numpy_api", "random_api", "torch_api"]


class PublicApi:
    """A generator through its public API (where its memory layout is not the probed one): slower,
    same values."""

    __slots__ = ("_get", "_set")

    def __init__(self, get: Any, set_: Any) -> None:
        self._get, self._set = get, set_

    def take(self) -> Any:
        return self._get()

    def put(self, taken: Any) -> None:
        self._set(taken)

    def marks(self) -> Any:
        return self._get()


def torch_api() -> PublicApi:
    return PublicApi(lambda: _TorchState(torch.default_generator.get_state()),
                     lambda taken: torch.default_generator.set_state(taken.state))


def random_api() -> PublicApi:
    return PublicApi(random.getstate, random.setstate)


def numpy_api() -> PublicApi:
    return PublicApi(lambda: _Comparable(np.random.get_state(legacy=False)),
                lambda taken: np.random.set_state(taken.state))


class _Comparable:
    """numpy's state dict, compared by value (its key array would compare element-wise)."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Comparable) and _equal(self.state, other.state)

    __hash__ = None  # type: ignore[assignment]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[key], b[key]) for key in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


class _TorchState:
    """torch's state tensor, compared by value."""

    __slots__ = ("state",)

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TorchState) and torch.equal(self.state, other.state)

    __hash__ = None  # type: ignore[assignment]
