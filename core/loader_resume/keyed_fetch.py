"""Where keys are applied: at the fetch of a batch, in a worker or in the main process.

A batch's index list carries its key (:class:`KeyedIndices`). The key is applied at the *fetch*: in a
worker as the list arrives, in the main process as the loader hands the list to torch's fetcher. In a
worker, the seeding is usually done ahead, off the critical path, by a helper thread (:class:`SeedAhead`).
How keys are derived and generators seeded is :mod:`loader_resume.keyed_rng`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple

from torch.utils.data import get_worker_info

from .keyed_rng import TORCH, KeysUnder, derive_key, seed_generators
from .rng_memory import generator_states

__all__ = [
    "SEED_AHEAD", "DrawnGenerators", "KeySpec", "KeyedFetch", "KeyedIndices", "NextFetch", "SampleKeyedIndices",
    "SeedAhead", "SeedAheadCollate", "keyed_indices",
]

logger = logging.getLogger(__name__)


class KeySpec(NamedTuple):
    """How one batch's fetch is keyed."""

    key: int
    """The batch's key: the generators are seeded with it before the fetch."""
    sample_base: int | None
    """``keying="sample"``: each item is keyed by ``derive_key(sample_base, index)``; else None."""
    mask: int
    """Which generators are keyed (:func:`loader_resume.keyed_rng.generator_mask`)."""


class KeyedIndices(list[int]):
    """A batch's indices, carrying the key its fetch is seeded with.

    ``spec`` says how (:class:`KeySpec`). The batch key is applied at the *fetch*, never when the
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

    def __init__(self, indices: Sequence[int], spec: KeySpec, ahead: int | None = None) -> None:
        super().__init__(indices)
        self.spec = spec
        self.ahead = ahead

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: self[:] is a plain list and does not go through a subclass's __iter__, which would seed. The
        # spec's fields travel as plain values (a NamedTuple pickles its class too: +2 µs per batch measured).
        key, sample_base, mask = self.spec
        return (_arrived, (self[:], key, sample_base, mask, self.ahead))


class SampleKeyedIndices(KeyedIndices):
    """``keying="sample"``: each item is keyed by its index as the list is iterated (see :class:`KeyedIndices`)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[int]:
        _, sample_base, mask = self.spec
        assert sample_base is not None  # only built for per-sample keying
        for index in list.__iter__(self):
            seed_generators(derive_key(sample_base, index), mask)
            yield index


def keyed_indices(indices: Sequence[int], spec: KeySpec, ahead: int | None = None) -> KeyedIndices:
    """The :class:`KeyedIndices` (or :class:`SampleKeyedIndices`) for ``spec``."""
    return (KeyedIndices if spec.sample_base is None else SampleKeyedIndices)(indices, spec, ahead)


def _arrived(indices: list[int], key: int, sample_base: int | None, mask: int, ahead: int | None) -> KeyedIndices:
    """Unpickling a batch's indices in a worker: the last thing a worker does before fetching the batch.

    Waits for :data:`SEED_AHEAD` (no code of this batch runs while the generators are seeded in the
    background), then seeds the batch key unless the helper already did. In torch's worker loop only a
    few checks of the message (no random draws) lie between this and ``fetcher.fetch(indices)``.
    """
    if get_worker_info() is not None:  # NOTE: a copy.deepcopy in the main process also comes here
        if SEED_AHEAD.take() != (key, mask):
            seed_generators(key, mask)
        SEED_AHEAD.plan(ahead, mask)
    return keyed_indices(indices, KeySpec(key, sample_base, mask), ahead)


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


class DrawnGenerators:
    """Which keyed generators a loader's dataset draws from in the main process, learned from its fetches."""

    __slots__ = ("learned", "mask")

    def __init__(self) -> None:
        self.learned = False
        """Whether a fetch has shown it yet (the first keyed fetch seeds every keyed generator)."""
        self.mask = 0
        """The generators seen drawn from (bits of :func:`loader_resume.keyed_rng.generator_mask`)."""


class NextFetch:
    """``num_workers=0``, per-batch keying: the index list torch's single-process iterator fetches next, and
    its key's parts (the list itself carries nothing: no key is derived for a batch nothing is seeded for).

    torch's single-process iterator fetches each list right after drawing it from the loader's index plan,
    which records it here as it hands it out (:class:`KeyedFetch` checks it is the same list object).
    """

    __slots__ = ("indices", "keys", "mask", "position")

    def __init__(self) -> None:
        self.indices: Any = None
        self.keys: KeysUnder | None = None
        self.position = self.mask = 0

    def record(self, indices: Any, keys: KeysUnder, position: int, mask: int) -> None:
        """``indices`` is handed out next; its key is ``keys(position)``."""
        self.indices, self.keys, self.position, self.mask = indices, keys, position, mask


class KeyedFetch:
    """The main process's fetch of a keyed batch (``num_workers=0``): the caller's generators stay as they were,
    and only the generators the dataset draws from are seeded.

    Wraps torch's fetcher. Before the fetch, the generators' states are copied (as memory,
    :mod:`loader_resume.rng_memory`); the generators the dataset is known to draw from
    (:class:`DrawnGenerators`; at a loader's first keyed fetch, all of them), and torch's always (datasets
    read ``torch.initial_seed()`` to derive generators of their own), are seeded with the batch's key.
    After it, the generators not seeded are compared with those (first by a few words each, the position
    counters: ``rng_memory``'s marks): a seeded generator that moved is one the dataset draws from;
    an unseeded one that moved means the dataset drew from the caller's generator, so its state is put
    back, it is learned as drawn, and the fetch is done again, seeded (values are then the batch key's, as
    if it had been seeded from the start). Finally every seeded generator gets the caller's state back.
    A dataset that draws no random number thus pays a copy and a comparison of three small blocks of memory
    a batch and torch's seeding (~1 µs); one that draws pays a second read of one batch, once per generator
    it first draws from after the loader's first batch.
    """

    __slots__ = ("_drawn", "_fetcher", "_next")

    def __init__(self, fetcher: Any, drawn: DrawnGenerators, next_fetch: NextFetch | None) -> None:
        self._fetcher, self._drawn, self._next = fetcher, drawn, next_fetch

    def __getattr__(self, name: str) -> Any:  # torch's fetcher's own attributes (dataset, collate_fn, ...)
        if name == "_fetcher":
            raise AttributeError(name)
        return getattr(self._fetcher, name)

    def fetch(self, indices: Any) -> Any:
        slot = self._next
        if slot is not None and slot.indices is indices:
            slot.indices = None
            return self._keyed(indices, slot.mask, slot.keys, slot.position)
        spec: KeySpec | None = getattr(indices, "spec", None)
        if spec is None or not spec.mask:
            return self._fetcher.fetch(indices)
        if spec.sample_base is not None:  # each item is seeded again as the list is iterated
            return self._seeded(indices, spec.key, spec.mask)
        return self._keyed(indices, spec.mask, None, spec.key)

    def _seeded(self, indices: Any, key: int, mask: int) -> Any:
        states = generator_states()
        caller = states.take()
        try:
            seed_generators(key, mask)
            return self._fetcher.fetch(indices)
        finally:
            states.put(caller, mask)

    def _keyed(self, indices: Any, mask: int, keys: KeysUnder | None, position: int) -> Any:
        """Fetch ``indices`` keyed by ``keys(position)`` (``keys`` None: ``position`` is the key)."""
        drawn = self._drawn
        if not drawn.learned:
            return self._learn(indices, position if keys is None else keys(position), mask)
        states = generator_states()
        caller = states.take()
        # NOTE: torch's generator is seeded for every batch all the same: torch.initial_seed(), which datasets
        # read (without drawing) to derive their own generators from, must report the batch's key.
        seeded = (drawn.mask | TORCH) & mask
        key: int | None = None
        try:
            while True:
                if seeded:
                    if key is None:
                        key = position if keys is None else keys(position)
                    seed_generators(key, seeded)
                unseeded = mask & ~seeded
                marks = states.marks(unseeded) if unseeded else None
                data = self._fetcher.fetch(indices)
                if not unseeded or states.marks(unseeded) == marks:
                    return data
                strays = states.changed(caller, unseeded)
                if not strays:
                    return data
                logger.debug("the dataset drew from generator(s) %d unkeyed: fetching the batch again, keyed", strays)
                states.put(caller, strays)
                drawn.mask |= strays
                seeded |= strays
        finally:
            if seeded:
                states.put(caller, seeded)

    def _learn(self, indices: Any, key: int, mask: int) -> Any:
        """A loader's first keyed fetch: every keyed generator seeded; those that move are the ones drawn from."""
        states = generator_states()
        caller = states.take()
        try:
            seed_generators(key, mask)
            keyed = states.take()
            data = self._fetcher.fetch(indices)
            drawn = self._drawn
            drawn.learned, drawn.mask = True, states.changed(keyed, mask)
            return data
        finally:
            states.put(caller, mask)
