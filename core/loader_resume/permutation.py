"""An addressable, keyed bijection of ``range(n)``: the shuffle that costs nothing to store.

``KeyedPermutation(n, key)[positions]`` returns the sample index at each position of a shuffled epoch,
computed rather than stored: a balanced Feistel network over the smallest even-bit power-of-two domain
that holds ``n``, made a bijection of ``range(n)`` by cycle-walking. Memory is O(1) in ``n`` and a
position deep in the epoch costs the same as the first one, so resuming at 90 % of a 10^9-sample epoch
is as cheap as starting it (``torch.randperm(10**9)`` would take 8 GB per rank).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["KeyedPermutation"]

_ROUNDS = 6
_TABLE_HALF_BITS = 16
"""Up to this half width (n <= 2^32), each round function is a lookup table of 2^half entries (<= 1.5 MiB)."""


class KeyedPermutation:
    """A bijection of ``range(n)`` chosen by ``key``; index it with an array of positions."""

    __slots__ = ("_half", "_mask", "_multipliers", "_shift", "_tables", "_xors", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"KeyedPermutation needs n >= 0, got n={n}")
        self.n = n
        half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self._half, self._mask, self._shift = np.uint64(half), np.uint64((1 << half) - 1), np.uint64(64 - half)
        digest = hashlib.shake_256(key.to_bytes(16, "little", signed=False)).digest(16 * _ROUNDS)
        words = np.frombuffer(digest, dtype=np.uint64)
        self._xors = words[:_ROUNDS].copy()
        self._multipliers = words[_ROUNDS:] | np.uint64(1)  # odd: multiplying mod 2^64 is a bijection
        self._tables: list[npt.NDArray[np.int64]] | None = None
        if half <= _TABLE_HALF_BITS:
            # NOTE: a round function reads only the right half (`half` bits), so for small halves each
            # round is tabulated once: a lookup and an XOR a round instead of four 64-bit operations.
            right = np.arange(1 << half, dtype=np.uint64)
            self._tables = [self._round(right, r).astype(np.int64) for r in range(_ROUNDS)]

    def __getitem__(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Indices at ``positions`` (each in ``[0, n)``), same shape as ``positions``."""
        out = self._encrypt(np.ascontiguousarray(positions, dtype=np.int64).reshape(-1))
        # NOTE: cycle-walking. The Feistel domain is up to 4n; a value that lands outside
        # range(n) is encrypted again until it lands inside, which keeps the map a bijection.
        # Only the values still outside are carried to the next walk step.
        outside = np.flatnonzero(out >= self.n)
        while outside.size:
            walked = self._encrypt(out[outside])
            out[outside] = walked
            outside = outside[walked >= self.n]
        return out.reshape(np.shape(positions))

    def _round(self, right: npt.NDArray[Any], r: int) -> npt.NDArray[Any]:
        # Round function: the high `half` bits of a keyed multiply (multiply-shift hashing). Bit i of
        # a product depends on bits <= i of the factor, so the top bits depend on all of `right`.
        product: npt.NDArray[Any] = (right ^ self._xors[r]) * self._multipliers[r]
        return product >> self._shift

    def _encrypt(self, x: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        half = int(self._half)
        left, right = x >> half, x & ((1 << half) - 1)
        if self._tables is not None:
            for table in self._tables:
                left, right = right, left ^ table[right]
        else:
            left, right = left.astype(np.uint64), right.astype(np.uint64)
            for r in range(_ROUNDS):
                left, right = right, left ^ self._round(right, r)
            left, right = left.astype(np.int64), right.astype(np.int64)
        return (left << half) | right
