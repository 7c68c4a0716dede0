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
# splitmix64's finaliser constants: a well-studied 64-bit mixer, cheap in vectorised numpy.
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


class KeyedPermutation:
    """A bijection of ``range(n)`` chosen by ``key``; index it with an array of positions."""

    __slots__ = ("_half", "_keys", "_mask", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"KeyedPermutation needs n >= 0, got n={n}")
        self.n = n
        self._half = np.uint64(max(1, ((max(n, 2) - 1).bit_length() + 1) // 2))
        self._mask = np.uint64((1 << int(self._half)) - 1)
        digest = hashlib.blake2b(key.to_bytes(16, "little", signed=False), digest_size=8 * _ROUNDS)
        self._keys = np.frombuffer(digest.digest(), dtype=np.uint64).copy()

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
        for round_key in self._keys:
            left, right = right, left ^ (_mix(right ^ round_key) & self._mask)
        return (left << self._half) | right
