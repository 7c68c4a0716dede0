"""Keyed randomness: the random numbers a batch sees are a function of its position, not of history.

Before a batch is fetched, the global generators that augmentation code draws from (torch's default
CPU generator, numpy's legacy global ``RandomState``, Python's ``random``) are seeded from a hash of
``(seed, epoch, position)``. Whichever worker or process fetches the batch, and whether the job was
resumed or not, the values drawn are the same — so no worker RNG is ever snapshotted.

This module derives keys, seeds the generators (``seed_generators``) and saves and restores the
caller's generators around a fetch in the main process (``CallerRng``, through
``loader_resume.keyed.rng_memory``). Where keys are applied —
at the fetch, in a worker or in the main process — is ``loader_resume.keyed.keyed_fetch``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from loader_resume.keyed.rng_memory import GENERATORS, generator_states

__all__ = [
    "GENERATORS",
    "KEYING_MODES",
    "TORCH",
    "CallerRng",
    "DrawnGenerators",
    "KeysUnder",
    "derive_key",
    "generator_mask",
    "seed_generators",
]

KEYING_MODES: Final = ("batch", "sample", "off")
"""The ``keying`` choices: a key per batch, a key per sample, or no keying."""
TORCH: Final = 1
"""The bit of torch's default generator in a generator mask."""
_TORCH, _NUMPY, _RANDOM = TORCH, 2, 4
_BIT = {"torch": _TORCH, "numpy": _NUMPY, "random": _RANDOM}


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from ``parts``: blake2b, so neighbouring positions give unrelated sequences."""
    text = ":".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class KeysUnder:
    """``derive_key(*base, part)`` for many parts: the hash of the common prefix is computed once
    (~2x faster)."""

    __slots__ = ("_prefix",)

    def __init__(self, *base: int | str) -> None:
        self._prefix = hashlib.blake2b(
            ("".join(f"{part}:" for part in base)).encode(), digest_size=8
        )

    def __call__(self, part: int | str) -> int:
        hashed = self._prefix.copy()
        hashed.update(str(part).encode())
        return int.from_bytes(hashed.digest(), "little")


def generator_mask(names: Sequence[str]) -> int:
    """Bit mask of the generator ``names``; raises ValueError naming an unknown one."""
    unknown = [n for n in names if n not in _BIT]
    if unknown:
        raise ValueError(
            f"keyed_generators: unknown generator(s) {unknown}; expected a subset of "
            f"{list(GENERATORS)}"
        )
    mask = 0
    for name in names:
        mask |= _BIT[name]
    return mask


_INT63: Final = (1 << 63) - 1


def seed_generators(key: int, mask: int) -> None:
    """Seed the global generators selected by ``mask`` from the 64-bit ``key``."""
    if mask & _TORCH:
        # NOTE: not torch.manual_seed, which also seeds every accelerator (~240 µs here vs ~1 µs).
        # 63 bits: torch.initial_seed() in a keyed fetch is then the batch's key as an int64, which
        # torch.tensor and default_collate take (a 64-bit key overflowed them; torch's DataLoader
        # suite reads it in workers).
        torch.default_generator.manual_seed(key & _INT63)
    if mask & _NUMPY:
        np.random.seed(key >> 32)
    if mask & _RANDOM:
        random.seed(key)


class CallerRng:
    """Save and restore the caller's global generators around a keyed fetch in the main process.

    States are copied as memory (``loader_resume.keyed.rng_memory``): ~0.3 µs a generator, where
    numpy's ``get_state``/``set_state`` costs ~50 µs a pair. Cached normals (torch's, numpy's spare
    Gaussian, ``random.gauss_next``) are part of what is restored.
    """

    __slots__ = ("_mask", "_taken")

    def __init__(self, mask: int) -> None:
        self._mask = mask
        self._taken: tuple[Any, ...] | None = None

    def save(self) -> CallerRng:
        self._taken = generator_states().take()
        return self

    def restore(self) -> None:
        if self._taken is not None:
            generator_states().put(self._taken, self._mask)


class DrawnGenerators:
    """Which keyed generators a dataset draws from in one process (a loader's main process, or a
    worker), learned from its fetches."""

    __slots__ = ("learned", "mask")

    def __init__(self) -> None:
        self.learned = False
        """Whether a fetch has shown it yet (the first keyed fetch seeds every keyed generator)."""
        self.mask = 0
        """The generators seen drawn from (bits of
        ``loader_resume.keyed.keyed_rng.generator_mask``)."""
