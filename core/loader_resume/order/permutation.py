"""An addressable, keyed bijection of ``range(n)``: the shuffle that costs nothing to store.

``KeyedPermutation(n, key)[positions]`` returns the sample index at each position of a shuffled
epoch, computed rather than stored: a balanced Feistel network over the smallest even-bit
power-of-two domain that holds ``n``, made a bijection of ``range(n)`` by cycle-walking. Memory is
O(1) in ``n`` and a position deep in the epoch costs the same as the first one, so resuming at 90 %
of a 10^9-sample epoch is as cheap as starting it (``torch.randperm(10**9)`` would take 8 GB per
rank).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["KeyedPermutation"]

_ROUNDS = 6
_TABLE_HALF_BITS = 16
"""Up to this half width (n <= 2^32), each round function is a lookup table of 2^half entries (all
six <= 3 MiB)."""
_WHOLE_HALF_BITS = 7
"""Up to this half width (a domain of <= 2^14 values), the first lookup computes the whole
permutation: the domain encrypted in one vectorised call, then the walks as lookups in it. An epoch
of n = 5,000 then takes ~40 % of the time chunk by chunk takes (where each walk step is a call of
its own on a few values); past 2^14 it gains nothing (measured up to 2^16: the domain's arrays cost
more than the chunks' calls)."""


class KeyedPermutation:
    """A bijection of ``range(n)`` chosen by ``key``; index it with an array of positions."""

    __slots__ = ("_half", "_mask", "_multipliers", "_shift", "_tables", "_whole", "_xors", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"KeyedPermutation needs n >= 0, got n={n}")
        self.n = n
        half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self._half, self._mask, self._shift = (
            np.uint64(half),
            np.uint64((1 << half) - 1),
            np.uint64(64 - half),
        )
        digest = hashlib.shake_256(key.to_bytes(16, "little", signed=False)).digest(16 * _ROUNDS)
        words = np.frombuffer(digest, dtype=np.uint64)
        self._xors = words[:_ROUNDS].copy()
        # odd: multiplying mod 2^64 is a bijection
        self._multipliers = words[_ROUNDS:] | np.uint64(1)
        self._tables: list[npt.NDArray[np.int64]] | None = None
        if half <= _TABLE_HALF_BITS:
            # NOTE: a round function reads only the right half (`half` bits), so for small halves
            # each round is tabulated once: a lookup and an XOR a round instead of four 64-bit
            # operations.
            right = np.arange(1 << half, dtype=np.uint64)
            # row r: round r's table, all six in one go
            rounds = self._round(right[None, :], np.s_[:, None])
            self._tables = list(rounds.astype(np.int64))
        self._whole: npt.NDArray[np.int64] | None = None

    def __getitem__(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Indices at ``positions`` (each in ``[0, n)``), same shape as ``positions``."""
        flat = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
        half = int(self._half)
        if half <= _WHOLE_HALF_BITS:
            if self._whole is None:
                self._whole = self._walked_domain(half)
            return self._whole[flat].reshape(np.shape(positions))
        out = self._encrypt(flat)
        # NOTE: cycle-walking. The Feistel domain is up to 4n; a value that lands outside
        # range(n) is encrypted again until it lands inside, which keeps the map a bijection.
        # Only the values still outside are carried to the next walk step.
        outside = np.flatnonzero(out >= self.n)
        while outside.size:
            walked = self._encrypt(out[outside])
            out[outside] = walked
            outside = outside[walked >= self.n]
        return out.reshape(np.shape(positions))

    def _walked_domain(self, half: int) -> npt.NDArray[np.int64]:
        """The whole permutation: the domain encrypted at once, then the cycle-walks as lookups in
        it. ``step`` is one walk step (a value inside ``range(n)`` stays), squared each round: after
        k rounds every value has walked 2^k - 1 steps, so ~5 rounds instead of a round per step of
        the longest walk."""
        domain = np.arange(1 << (2 * half), dtype=np.int64)
        encrypted = self._encrypt(domain)
        out, step = encrypted[: self.n], np.where(domain < self.n, domain, encrypted)
        while out.size and int(out.max()) >= self.n:
            step, out = step.take(step), step.take(out)
        return out

    def _round(self, right: npt.NDArray[Any], r: Any) -> npt.NDArray[Any]:
        # Round function: the high `half` bits of a keyed multiply (multiply-shift hashing). Bit i
        # of a product depends on bits <= i of the factor, so the top bits depend on all of `right`.
        # `r`: a round, or an index of the rounds' keys that broadcasts against `right` (every round
        # at once).
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
