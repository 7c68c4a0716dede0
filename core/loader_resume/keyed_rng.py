"""Keyed randomness: the random numbers a batch sees are a function of its position, not of history.

Before a batch is fetched, the global generators that augmentation code draws from (torch's default
CPU generator, numpy's legacy global ``RandomState``, Python's ``random``) are seeded from a hash of
``(seed, epoch, position)``. Whichever worker or process fetches the batch, and whether the job was
resumed or not, the values drawn are the same — so no worker RNG is ever snapshotted.

This module derives keys, seeds the generators (:func:`seed_generators`) and saves and restores the
caller's generators around a fetch in the main process (:class:`CallerRng`). Where keys are applied —
at the fetch, in a worker or in the main process — is :mod:`loader_resume.keyed_fetch`.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import struct
import sys
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

__all__ = ["GENERATORS", "KEYING_MODES", "CallerRng", "derive_key", "generator_mask", "seed_generators"]

GENERATORS: Final = ("torch", "numpy", "random")
KEYING_MODES: Final = ("batch", "sample", "off")
"""The ``keying`` choices: a key per batch, a key per sample, or no keying."""
_TORCH, _NUMPY, _RANDOM = 1, 2, 4
_BIT = {"torch": _TORCH, "numpy": _NUMPY, "random": _RANDOM}


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from ``parts``: blake2b, so neighbouring positions give unrelated sequences."""
    text = ":".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def generator_mask(names: Sequence[str]) -> int:
    """Bit mask of the generator ``names``; raises ValueError naming an unknown one."""
    unknown = [n for n in names if n not in _BIT]
    if unknown:
        raise ValueError(f"keyed_generators: unknown generator(s) {unknown}; expected a subset of {list(GENERATORS)}")
    mask = 0
    for name in names:
        mask |= _BIT[name]
    return mask


_INT63: Final = (1 << 63) - 1


def seed_generators(key: int, mask: int) -> None:
    """Seed the global generators selected by ``mask`` from the 64-bit ``key``."""
    if mask & _TORCH:
        # NOTE: not torch.manual_seed, which also seeds every accelerator (~240 µs here vs ~1 µs). 63 bits:
        # torch.initial_seed() in a keyed fetch is then the batch's key as an int64, which torch.tensor and
        # default_collate take (a 64-bit key overflowed them; torch's DataLoader suite reads it in workers).
        torch.default_generator.manual_seed(key & _INT63)
    if mask & _NUMPY:
        np.random.seed(key >> 32)
    if mask & _RANDOM:
        random.seed(key)


def _numpy_mt_address() -> int | None:
    """Address of numpy's global MT19937 state, or None when it cannot be reached that way."""
    bit_generator = np.random.mtrand._rand._bit_generator
    if type(bit_generator).__name__ != "MT19937":
        return None
    return int(bit_generator.ctypes.state_address)


_NP_STATE_BYTES: Final = 624 * 4 + 4  # mt19937_state: uint32 key[624]; int pos
_RANDOM_STATE_BYTES: Final = 4 + 624 * 4  # CPython's RandomObject after PyObject_HEAD: int index; uint32 state[624]


def _random_mt_address() -> int | None:
    """Address of ``random``'s global MT19937 state, or None when this interpreter lays it out otherwise.

    NOTE: CPython's ``RandomObject`` is ``PyObject_HEAD; int index; uint32_t state[624]``, and
    ``random.random`` and friends are bound to one instance, ``random._inst``. The layout is checked
    against ``getstate()`` once per process (free-threaded or future builds may differ); any mismatch
    falls back to ``getstate``/``setstate`` (~9 µs a pair here instead of ~0.7 µs).
    """
    global _RANDOM_ADDRESS
    if _RANDOM_ADDRESS is None:
        _RANDOM_ADDRESS = _probe_random_layout()
    return _RANDOM_ADDRESS or None


_RANDOM_ADDRESS: int | None = None  # 0: probed, layout not as expected


def _probe_random_layout() -> int:
    instance = random._inst
    if type(instance) is not random.Random or sys.implementation.name != "cpython":
        return 0
    address = id(instance) + object.__basicsize__  # PyObject_HEAD: refcount and type pointer
    raw = ctypes.string_at(address, _RANDOM_STATE_BYTES)
    index, *words = struct.unpack("i624I", raw)
    version, internal, _ = random.getstate()
    return address if version == 3 and (*words, index) == internal else 0


class CallerRng:
    """Save and restore the caller's global generators around a keyed fetch in the main process.

    numpy's ``get_state``/``set_state`` costs ~60 µs a pair here; copying the MT19937 state struct
    through its public ``ctypes`` address costs ~1 µs. NOTE: numpy keeps the spare Gaussian of its
    legacy ``normal()`` outside that struct, so a cached spare is dropped (the sequence stays
    deterministic; only an odd-count ``np.random.normal`` caller sees a fresh draw).
    """

    __slots__ = ("_gauss", "_mask", "_np", "_random", "_torch")

    def __init__(self, mask: int) -> None:
        self._mask = mask
        self._torch: torch.Tensor | None = None
        self._np: Any = None
        self._random: Any = None
        self._gauss: float | None = None

    def save(self) -> CallerRng:
        if self._mask & _TORCH:
            self._torch = torch.default_generator.get_state()
        if self._mask & _NUMPY:
            address = _numpy_mt_address()
            if address is None:
                self._np = np.random.get_state()
            else:
                self._np = ctypes.create_string_buffer(_NP_STATE_BYTES)
                ctypes.memmove(self._np, address, _NP_STATE_BYTES)
        if self._mask & _RANDOM:
            address = _random_mt_address()
            if address is None:
                self._random = random.getstate()
            else:
                if not isinstance(self._random, ctypes.Array):
                    self._random = ctypes.create_string_buffer(_RANDOM_STATE_BYTES)
                ctypes.memmove(self._random, address, _RANDOM_STATE_BYTES)
                self._gauss = random._inst.gauss_next  # type: ignore[attr-defined]
        return self

    def restore(self) -> None:
        if self._torch is not None:
            torch.default_generator.set_state(self._torch)
        if isinstance(self._np, ctypes.Array):
            address = _numpy_mt_address()
            if address is not None:
                ctypes.memmove(address, self._np, _NP_STATE_BYTES)
        elif self._np is not None:
            np.random.set_state(self._np)
        if isinstance(self._random, ctypes.Array):
            address = _random_mt_address()
            assert address is not None  # the layout was probed when this state was saved
            ctypes.memmove(address, self._random, _RANDOM_STATE_BYTES)
            random._inst.gauss_next = self._gauss  # type: ignore[attr-defined]
        elif self._random is not None:
            random.setstate(self._random)
