"""An addressable, keyed bijection of ``range(n)``: the shuffle that costs nothing to store.

``KeyedPermutation(n, key)[positions]`` returns the sample index at each position of a shuffled epoch,
computed rather than stored: a balanced Feistel network over the smallest even-bit power-of-two domain
that holds ``n``, made a bijection of ``range(n)`` by cycle-walking. Memory is O(1) in ``n`` and a
position deep in the epoch costs the same as the first one, so resuming at 90 % of a 10^9-sample epoch
is as cheap as starting it (``torch.randperm(10**9)`` would take 8 GB per rank).
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

__all__ = ["KeyedPermutation"]

_ROUNDS = 6


class KeyedPermutation:
    """A bijection of ``range(n)`` chosen by ``key``; index it with an array of positions."""

    __slots__ = ("_half", "_mask", "_multipliers", "_shift", "_xors", "n")

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

    def __getitem__(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Indices at ``positions`` (each in ``[0, n)``), same shape as ``positions``."""
        out = self._encrypt(positions.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        # NOTE: cycle-walking. The Feistel domain is up to 4n; a value that lands outside
        # range(n) is encrypted again until it lands inside, which keeps the map a bijection.
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def _encrypt(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left, right = x >> self._half, x & self._mask
        # Round function: the high `half` bits of a keyed multiply (multiply-shift hashing). Bit i of
        # a product depends on bits <= i of the factor, so the top bits depend on all of `right`:
        # 3 numpy ops a round instead of ~11 for a full 64-bit mixer (splitmix64's finaliser).
        for xor, multiplier in zip(self._xors, self._multipliers, strict=True):
            left, right = right, left ^ (((right ^ xor) * multiplier) >> self._shift)
        return (left << self._half) | right
