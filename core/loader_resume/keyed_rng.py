"""Keyed randomness: the random numbers a batch sees are a function of its position, not of history.

Before a batch is fetched, the global generators that augmentation code draws from (torch's default
CPU generator, numpy's legacy global ``RandomState``, Python's ``random``) are seeded from a hash of
``(seed, epoch, position)``. Whichever worker or process fetches the batch, and whether the job was
resumed or not, the values drawn are the same — so no worker RNG is ever snapshotted.

Keys are applied at the fetch (:class:`KeyedIndices`): in a worker as the batch's index list arrives,
in the main process as the loader hands it to torch's fetcher. In a worker, the seeding is usually done
ahead, off the critical path, by a helper thread (:class:`SeedAhead`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import random
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = [
    "GENERATORS", "KEYING_MODES", "SEED_AHEAD", "CallerRng", "KeyedIndices", "SampleKeyedIndices", "SeedAhead",
    "SeedAheadCollate", "derive_key", "generator_mask", "keyed_indices", "seed_generators",
]

GENERATORS: Final = ("torch", "numpy", "random")
KEYING_MODES: Final = ("batch", "sample", "off")
"""The ``keying`` choices: a key per batch, a key per sample, or no keying."""
_TORCH, _NUMPY, _RANDOM = 1, 2, 4
_BIT = {"torch": _TORCH, "numpy": _NUMPY, "random": _RANDOM}
_MASK64 = (1 << 64) - 1
logger = logging.getLogger(__name__)


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from ``parts``: blake2b, so neighbouring positions give unrelated streams."""
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
    legacy ``normal()`` outside that struct, so a cached spare is dropped (the stream stays
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


class KeyedIndices(list[int]):
    """A batch's indices, carrying the key its fetch is seeded with.

    ``spec = (batch_key, sample_base, mask)``. The batch key is applied at the *fetch*, never when the
    list is iterated, so it holds whatever the dataset does with the list (HF ``datasets`` iterates it
    three times before its transform runs; other datasets convert it with numpy or torch and never call
    ``__iter__``): in a worker as the list arrives (:func:`_arrived`, the last thing before torch's
    fetcher reads the dataset), in the main process as the loader hands the list to the fetcher (the
    loader restores the caller's generators once the whole fetch is done). With ``sample_base`` set
    (``keying="sample"``), :class:`SampleKeyedIndices` also re-seeds before each item while the list is
    iterated, with ``derive_key(sample_base, index)``.

    ``ahead``: the key of the batch this worker will most likely fetch next (``num_workers`` batches
    later; see :class:`SeedAhead`). Only a hint: a wrong guess costs a second seeding, never a wrong value.
    """

    __slots__ = ("ahead", "spec")

    def __init__(self, indices: Sequence[int], spec: tuple[int, int | None, int], ahead: int | None = None) -> None:
        super().__init__(indices)
        self.spec = spec
        self.ahead = ahead

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: self[:] is a plain list and does not go through a subclass's __iter__, which would seed.
        return (_arrived, (self[:], self.spec, self.ahead))


class SampleKeyedIndices(KeyedIndices):
    """``keying="sample"``: each item is keyed by its index as the list is iterated (see :class:`KeyedIndices`)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[int]:
        sample_base, mask = self.spec[1], self.spec[2]
        assert sample_base is not None  # only built for per-sample keying
        for index in list.__iter__(self):
            seed_generators(derive_key(sample_base, index) & _MASK64, mask)
            yield index


def keyed_indices(indices: Sequence[int], spec: tuple[int, int | None, int], ahead: int | None = None) -> KeyedIndices:
    """The :class:`KeyedIndices` (or :class:`SampleKeyedIndices`) for ``spec``."""
    return (KeyedIndices if spec[1] is None else SampleKeyedIndices)(indices, spec, ahead)


def _arrived(indices: list[int], spec: tuple[int, int | None, int], ahead: int | None) -> KeyedIndices:
    """Unpickling a batch's indices in a worker: the last thing a worker does before fetching the batch.

    Waits for :data:`SEED_AHEAD` (no code of this batch runs while the generators are seeded in the
    background), then seeds the batch key unless the helper already did. In torch's worker loop only a
    few checks of the message (no random draws) lie between this and ``fetcher.fetch(indices)``.
    """
    if get_worker_info() is not None:  # NOTE: a copy.deepcopy in the main process also comes here
        key, _, mask = spec
        if SEED_AHEAD.take() != (key, mask):
            seed_generators(key, mask)
        SEED_AHEAD.plan(ahead, mask)
    return keyed_indices(indices, spec, ahead)


class SeedAhead:
    """Seeds a worker's generators for its next batch while the worker waits for that batch's indices.

    In a DataLoader worker, seeding the three generators costs ~19 µs per batch (cold caches), and on
    tiny items torch's worker pipeline is latency-bound: every µs a worker spends between receiving
    indices and handing over the batch shows in throughput, ~2.5x over (measured: 0.95x plain
    DataLoader with the seeding in line). So after a batch is collated (:class:`SeedAheadCollate`), a
    helper thread seeds for the batch this worker will most likely get next (``KeyedIndices.ahead``)
    while the worker ships the batch and waits. When that batch's indices arrive, the worker first
    waits for the helper (:func:`_arrived`) and keeps the seeding only if the key matches; otherwise
    (an epoch's first batches, a tail) it seeds in line as before. Values drawn are therefore always
    those of the batch's own key. Between the collate and the next indices, only torch's worker loop
    runs (queue put and get), which draws no random numbers.
    """

    __slots__ = ("_idle", "_job", "_next", "_pid", "_seeded", "_wake")

    def __init__(self) -> None:
        self._reset(None)

    def _reset(self, pid: int | None) -> None:
        self._pid = pid  # the process whose helper thread this is
        self._next: tuple[int, int] | None = None  # (key, mask) to seed once this batch is collated
        self._job: tuple[int, int] | None = None
        self._seeded: tuple[int, int] | None = None  # what the helper left in the generators
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()

    def plan(self, key: int | None, mask: int) -> None:
        """This batch's indices are being read; seed for ``key`` after it is collated."""
        self._next = None if key is None else (key, mask)

    def start(self) -> None:
        """The batch is collated: seed for the planned key in the background (no-op if none)."""
        job, self._next = self._next, None
        if job is None:
            return
        if self._pid != os.getpid():  # first use in this worker (a fork inherits no running thread)
            self._reset(os.getpid())
            threading.Thread(target=self._run, name="loader-resume-seed-ahead", daemon=True).start()
        self._job = job
        self._idle.clear()
        self._wake.set()

    def take(self) -> tuple[int, int] | None:
        """The (key, mask) the generators were seeded with ahead, once; None if they were not."""
        self._idle.wait()
        seeded, self._seeded = self._seeded, None
        return seeded

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            job, self._seeded = self._job, None
            try:
                if job is not None:
                    seed_generators(*job)
                    self._seeded = job
            except Exception:  # the in-line seeding of the batch itself will raise it where it can be seen
                logger.debug("seeding ahead failed", exc_info=True)
            finally:
                self._idle.set()


SEED_AHEAD: Final = SeedAhead()


class SeedAheadCollate:
    """Wraps a worker's collate_fn: once a batch is collated, start seeding for the next (:class:`SeedAhead`)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        batch = self.collate_fn(items)
        SEED_AHEAD.start()
        return batch
