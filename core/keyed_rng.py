"""Keyed randomness: the random numbers a batch sees are a function of its position, not of history.

Before a batch is fetched, the global generators that augmentation code draws from (torch's default
CPU generator, numpy's legacy global ``RandomState``, Python's ``random``) are seeded from a hash of
``(seed, epoch, position)``. Whichever worker or process fetches the batch, and whether the job was
resumed or not, the values drawn are the same — so no worker RNG is ever snapshotted.

The hook is the batch's index list itself (:class:`KeyedIndices`): DataLoader's map-style fetcher
iterates it right before calling ``dataset[i]``, in the worker that does the work. In a worker, the
seeding is usually done ahead, off the critical path, by a helper thread (:class:`SeedAhead`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = [
    "GENERATORS", "SEED_AHEAD", "CallerRng", "KeyedIndices", "SeedAhead", "SeedAheadCollate", "derive_key",
    "generator_mask", "global_rng_state", "seed_generators", "set_global_rng_state",
]

GENERATORS: Final = ("torch", "numpy", "random")
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


def seed_generators(key: int, mask: int) -> None:
    """Seed the global generators selected by ``mask`` from the 64-bit ``key``."""
    if mask & _TORCH:
        # NOTE: not torch.manual_seed, which also seeds every accelerator (~240 µs here vs ~1 µs).
        torch.default_generator.manual_seed(key)
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


class CallerRng:
    """Save and restore the caller's global generators around a keyed fetch in the main process.

    numpy's ``get_state``/``set_state`` costs ~60 µs a pair here; copying the MT19937 state struct
    through its public ``ctypes`` address costs ~1 µs. NOTE: numpy keeps the spare Gaussian of its
    legacy ``normal()`` outside that struct, so a cached spare is dropped (the stream stays
    deterministic; only an odd-count ``np.random.normal`` caller sees a fresh draw).
    """

    __slots__ = ("_mask", "_np", "_random", "_torch")

    def __init__(self, mask: int) -> None:
        self._mask = mask
        self._torch: torch.Tensor | None = None
        self._np: Any = None
        self._random: Any = None

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
            self._random = random.getstate()
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
        if self._random is not None:
            random.setstate(self._random)


class KeyedIndices(list[int]):
    """A batch's indices that seed the global generators when the fetcher iterates them.

    ``spec = (batch_key, sample_base, mask)``: with ``sample_base`` None every sample of the batch
    shares ``batch_key``; otherwise sample ``i`` is keyed by ``derive_key(sample_base, i)``. In the
    main process (``num_workers=0``) the caller's generators are restored after the last sample, so
    model code (dropout) sees its own stream undisturbed.

    ``ahead``: the key of the batch this worker will most likely fetch next (``num_workers`` batches
    later; see :class:`SeedAhead`). Only a hint: a wrong guess costs a second seeding, never a wrong value.
    """

    __slots__ = ("ahead", "spec")

    def __init__(self, indices: Sequence[int], spec: tuple[int, int | None, int], ahead: int | None = None) -> None:
        super().__init__(indices)
        self.spec = spec
        self.ahead = ahead

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: self[:] is a plain list and does not go through __iter__, which would seed.
        return (_arrived, (self[:], self.spec, self.ahead))

    def __iter__(self) -> Iterator[int]:
        batch_key, sample_base, mask = self.spec
        in_worker = get_worker_info() is not None
        seeded_ahead = SEED_AHEAD.take() if in_worker else None
        if in_worker and sample_base is None:
            # NOTE: the common case returns C's list iterator, not a generator: in torch's
            # latency-bound worker pipeline every bytecode per item shows (~4 % on tiny items).
            if seeded_ahead != (batch_key, mask):
                seed_generators(batch_key, mask)
            SEED_AHEAD.plan(self.ahead, mask)
            return list.__iter__(self)
        return self._guarded(batch_key, sample_base, mask, in_worker)

    def _guarded(self, batch_key: int, sample_base: int | None, mask: int, in_worker: bool) -> Iterator[int]:
        """Per-sample keys, and/or the caller's RNG restored after the last item (main process)."""
        caller = None if in_worker else CallerRng(mask).save()
        try:
            if sample_base is None:
                seed_generators(batch_key, mask)
                yield from list.__iter__(self)
            else:
                for index in list.__iter__(self):
                    seed_generators(derive_key(sample_base, index) & _MASK64, mask)
                    yield index
        finally:
            if caller is not None:
                caller.restore()


def _arrived(indices: list[int], spec: tuple[int, int | None, int], ahead: int | None) -> KeyedIndices:
    """Unpickling a batch's indices in a worker: the first thing a worker does for a batch.

    Waits for :data:`SEED_AHEAD` to finish, so no code of this batch (a dataset's ``__getitems__``
    included) runs while the generators are being seeded in the background.
    """
    SEED_AHEAD.settle()
    return KeyedIndices(indices, spec, ahead)


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

    def settle(self) -> None:
        """Wait until the helper is done (immediately true when it was not started)."""
        self._idle.wait()

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


def global_rng_state() -> dict[str, Any]:
    """torch's default CPU generator, numpy's legacy global and Python's ``random`` states.

    Plain values and tensors only, so a checkpoint holding it loads with ``weights_only=True``
    (Lightning 2.6 and our own loaders load that way).
    """
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    numpy_state = {"kind": kind, "key": torch.from_numpy(np.asarray(key).astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return {"torch": torch.get_rng_state(), "numpy": numpy_state, "random": random.getstate()}


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`global_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    key = saved["key"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], key, saved["pos"], saved["has_gauss"], saved["gauss"]))
    random.setstate(state["random"])
