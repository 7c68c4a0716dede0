"""Where keys are applied in a DataLoader worker: as a batch's index list arrives.

A batch's index list carries its key (``KeyedIndices``); unpickled in a worker (``_arrived``), it
seeds the generators the dataset draws from (``WorkerFetch``), usually ahead, off the critical path,
by a helper thread (``SeedAhead``). In the main process keys are applied by
``loader_resume.keyed.keyed_fetch``; how keys are derived and generators seeded is
``loader_resume.keyed.keyed_rng``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple

from torch.utils.data import get_worker_info

from loader_resume.keyed.keyed_rng import TORCH, DrawnGenerators, derive_key, seed_generators
from loader_resume.keyed.rng_memory import generator_states
from loader_resume.workers.torch_internals import fetch_items

__all__ = [
    "SEED_AHEAD",
    "WORKER_FETCH",
    "KeySpec",
    "KeyedIndices",
    "SampleKeyedIndices",
    "SeedAhead",
    "SeedAheadCollate",
    "WorkerFetch",
    "check_read_again",
    "keyed_indices",
]

logger = logging.getLogger(__name__)


def check_read_again(states: Any, marks: tuple[Any, ...], strays: int) -> None:
    """A batch that drew from generators ``strays`` unkeyed was read again with them seeded
    (``marks``: their marks right after that seeding). If one of them did not move this time, the
    first read left something behind (a dataset that memoizes what it drew): its values cannot be
    the keyed ones, and a resume may see others. Said loudly, as a warning naming the remedy."""
    quiet = strays & ~states.moved(marks, strays)
    if quiet:
        logger.warning(
            "the dataset drew from generator(s) %d before they were keyed, and did not draw from "
            "them when the "
            "batch was read again keyed: it keeps what it drew (a cache?). Those values are not "
            "keyed, and a "
            'resume may NOT reproduce them; use keying="sample" (every generator seeded before '
            'every item) or '
            "a dataset that does not keep its random draws",
            quiet,
        )


class KeySpec(NamedTuple):
    """How one batch's fetch is keyed."""

    key: int
    """The batch's key: the generators are seeded with it before the fetch."""
    sample_base: int | None
    """``keying="sample"``: each item is keyed by ``derive_key(sample_base, index)``; else None."""
    mask: int
    """Which generators are keyed (``loader_resume.keyed.keyed_rng.generator_mask``)."""


class KeyedIndices(list[int]):
    """A batch's indices, carrying the key its fetch is seeded with.

    ``spec`` says how (``KeySpec``). The batch key is applied at the *fetch*, never when the list is
    iterated, so it holds whatever the dataset does with the list (HF ``datasets`` iterates it three
    times before its transform runs; other datasets convert it with numpy or torch and never call
    ``__iter__``): in a worker as the list arrives (``_arrived``, the last thing before torch's
    fetcher reads the dataset), in the main process as the loader hands the list to the fetcher (the
    loader restores the caller's generators once the whole fetch is done). With ``sample_base`` set
    (``keying="sample"``), ``SampleKeyedIndices`` also re-seeds before each item while the list is
    iterated, with ``derive_key(sample_base, index)``.

    ``ahead``: the key of the batch this worker will most likely fetch next (``num_workers`` batches
    later; see ``SeedAhead``). Only a hint: a wrong guess costs a second seeding, never a wrong
    value.
    """

    __slots__ = ("ahead", "spec")

    def __init__(self, indices: Sequence[int], spec: KeySpec, ahead: int | None = None) -> None:
        super().__init__(indices)
        self.spec = spec
        self.ahead = ahead

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: self[:] is a plain list and does not go through a subclass's __iter__, which would
        # seed. The spec's fields travel as plain values (a NamedTuple pickles its class too: +2 µs
        # per batch measured).
        key, sample_base, mask = self.spec
        return (_arrived, (self[:], key, sample_base, mask, self.ahead))


class SampleKeyedIndices(KeyedIndices):
    """``keying="sample"``: each item is keyed by its index as the list is iterated (see
    ``KeyedIndices``)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[int]:
        _, sample_base, mask = self.spec
        assert sample_base is not None  # only built for per-sample keying
        for index in list.__iter__(self):
            seed_generators(derive_key(sample_base, index), mask)
            yield index


def keyed_indices(indices: Sequence[int], spec: KeySpec, ahead: int | None = None) -> KeyedIndices:
    """The ``KeyedIndices`` (or ``SampleKeyedIndices``) for ``spec``."""
    return (KeyedIndices if spec.sample_base is None else SampleKeyedIndices)(indices, spec, ahead)


def _arrived(
    indices: list[int], key: int, sample_base: int | None, mask: int, ahead: int | None
) -> KeyedIndices:
    """Unpickling a batch's indices in a worker: the last thing a worker does before fetching the
    batch.

    Per-batch keying: ``WORKER_FETCH`` seeds what the batch needs (see ``WorkerFetch``). Per-sample
    keying: waits for ``SEED_AHEAD`` and seeds the batch key for everything the batch reads outside
    its items. In torch's worker loop only a few checks of the message (no random draws) lie between
    this and ``fetcher.fetch(indices)``.
    """
    arrived = keyed_indices(indices, KeySpec(key, sample_base, mask), ahead)
    worker = get_worker_info()
    if worker is not None:  # NOTE: a copy.deepcopy in the main process also comes here
        if sample_base is None:
            WORKER_FETCH.arrive(worker, arrived, key, mask, ahead)
        else:
            if SEED_AHEAD.take() != (key, mask):
                seed_generators(key, mask)
            SEED_AHEAD.plan(None, mask)
    return arrived


class WorkerFetch:
    """A worker's keyed fetches (per-batch keying): only the generators the dataset draws from are
    seeded.

    A worker's first batch seeds every keyed generator and learns which ones the dataset moves
    (``DrawnGenerators``, per worker process). Afterwards a batch's arrival seeds those, and torch's
    always (``torch.initial_seed()`` must report the batch's key), and notes a few words of the
    others (``rng_memory``'s marks); once the batch is collated (``SeedAheadCollate``), an unseeded
    generator whose words moved was drawn from: it is learned, and the batch is read again with it
    seeded, so its values are those of a fetch seeded in full. The generators for the next batch are
    then seeded ahead (``SeedAhead``). A dataset that draws no random number thus pays torch's
    seeding a batch instead of the three generators' (~19 µs on cold caches); one that starts
    drawing later pays one more read of one batch per worker and generator. Only a seeding beyond
    torch's goes to the helper thread: torch's alone costs less in line than a wake of the helper
    (measured in pipeline CPU time at 2 workers: 0.96x DataLoader with the wake, 1.05x without).

    Should a batch's fetch end without the collate check (an exception in the dataset, a collate
    that is not ours), the worker seeds every keyed generator for every later batch: slower, never
    unkeyed.
    """

    __slots__ = ("_drawn", "_eager", "_pending", "_worker")

    def __init__(self) -> None:
        self._start_over(None)

    def _start_over(self, worker: Any) -> None:
        # the WorkerInfo of the worker these belong to (a fork inherits its parent's copy)
        self._worker = worker
        self._drawn = DrawnGenerators()
        self._eager = False
        # (indices, key, mask, seeded, before, ahead) of the batch being fetched: ``before`` is the
        # states after seeding (learning) or the marks of the generators not seeded
        self._pending: tuple[KeyedIndices, int, int, int, Any, int | None] | None = None

    def seeds_for(self, mask: int) -> int:
        """The generators of ``mask`` seeded for a batch."""
        drawn = self._drawn
        return (drawn.mask | TORCH) & mask if drawn.learned and not self._eager else mask

    def arrive(
        self, worker: Any, indices: KeyedIndices, key: int, mask: int, ahead: int | None
    ) -> None:
        """``indices`` arrived in ``worker`` (its ``WorkerInfo``): seed for its fetch (unless seeded
        ahead) and note what to check."""
        if worker is not self._worker:
            self._start_over(worker)
        if self._pending is not None:  # the last fetch was not checked: see the class docstring
            self._eager = True
        seeded = self.seeds_for(mask)
        if SEED_AHEAD.take() != (key, seeded):
            seed_generators(key, seeded)
        states = generator_states()
        if not self._drawn.learned:
            before: Any = states.take()
        else:
            unseeded = mask & ~seeded
            before = states.marks(unseeded) if unseeded else None
        self._pending = (indices, key, mask, seeded, before, ahead)

    def collated(self, batch: Any, collate_fn: Callable[[list[Any]], Any]) -> Any:
        """The batch is collated: learn, read it again if it drew from a generator not seeded, seed
        ahead."""
        pending, self._pending = self._pending, None
        if pending is None:
            return batch
        indices, key, mask, seeded, before, ahead = pending
        states, drawn = generator_states(), self._drawn
        if not drawn.learned:
            drawn.learned, drawn.mask = True, states.changed(before, mask)
        else:
            unseeded = mask & ~seeded
            while unseeded and (strays := states.moved(before, unseeded)):
                logger.debug(
                    "the dataset drew from generator(s) %d unkeyed: fetching the batch again, "
                    "keyed",
                    strays,
                )
                drawn.mask |= strays
                seeded |= strays
                seed_generators(key, seeded)
                fresh = states.marks(strays)
                unseeded = mask & ~seeded
                before = states.marks(unseeded) if unseeded else None
                batch = collate_fn(fetch_items(self._worker.dataset, indices))
                check_read_again(states, fresh, strays)
        seeds = self.seeds_for(mask)
        # NOTE: torch's seeding alone (~1 µs) costs less in line than a wake of the helper thread
        SEED_AHEAD.plan(ahead if seeds & ~TORCH else None, seeds)
        return batch


WORKER_FETCH: Final = WorkerFetch()


class SeedAhead:
    """Seeds a worker's generators for its next batch while the worker waits for that batch's
    indices.

    In a DataLoader worker, seeding the three generators costs ~19 µs per batch (cold caches), and
    on tiny items torch's worker pipeline is latency-bound: every µs a worker spends between
    receiving indices and handing over the batch shows in throughput, ~2.5x over (measured: 0.95x
    plain DataLoader with the seeding in line). So after a batch is collated (``SeedAheadCollate``),
    a helper thread seeds for the batch this worker will most likely get next
    (``KeyedIndices.ahead``) while the worker ships the batch and waits. When that batch's indices
    arrive, the worker first waits for the helper (``_arrived``) and keeps the seeding only if the
    key matches; otherwise (an epoch's first batches, a tail) it seeds in line as before. Values
    drawn are therefore always those of the batch's own key. Between the collate and the next
    indices, only torch's worker loop runs (queue put and get), which draws no random numbers.
    """

    __slots__ = ("_idle", "_job", "_next", "_pid", "_running", "_seeded", "_wake")

    def __init__(self) -> None:
        self._start_over(None)

    def _start_over(self, pid: int | None) -> None:
        self._pid = pid  # the process whose helper thread this is
        self._next: tuple[int, int] | None = None  # (key, mask) to seed once this batch is collated
        self._job: tuple[int, int] | None = None
        self._seeded: tuple[int, int] | None = None  # what the helper left in the generators
        self._running = False  # a job was handed to the helper and not yet taken
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()

    def plan(self, key: int | None, mask: int) -> None:
        """Once this batch is collated, seed ``mask``'s generators for ``key`` (None: nothing)."""
        self._next = None if key is None else (key, mask)

    def start(self) -> None:
        """The batch is collated: seed for the planned key in the background (no-op if none)."""
        job, self._next = self._next, None
        if job is None:
            return
        if self._pid != os.getpid():  # first use in this worker (a fork inherits no running thread)
            self._start_over(os.getpid())
            threading.Thread(target=self._run, name="loader-resume-seed-ahead", daemon=True).start()
        self._job, self._running = job, True
        self._idle.clear()
        self._wake.set()

    def take(self) -> tuple[int, int] | None:
        """The (key, mask) the generators were seeded with ahead, once; None if they were not."""
        # NOTE: no job handed over (a dataset drawing from torch alone): no wait (~5 µs)
        if not self._running:
            return None
        self._running = False
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
            # the in-line seeding of the batch itself will raise it where it can be seen
            except Exception:
                logger.debug("seeding ahead failed", exc_info=True)
            finally:
                self._idle.set()


SEED_AHEAD: Final = SeedAhead()


class SeedAheadCollate:
    """Wraps a worker's collate_fn: once a batch is collated, start seeding for the next
    (``SeedAhead``)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        batch = WORKER_FETCH.collated(self.collate_fn(items), self.collate_fn)
        SEED_AHEAD.start()
        return batch
