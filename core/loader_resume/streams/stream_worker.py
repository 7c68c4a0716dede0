"""Iterable datasets: a worker's stream, from the state it resumes from to the progress each batch
carries.

An ``IterableDataset`` owns its position, one copy per worker. Each loader has one ``WorkerStream``,
the one owner of a worker's progress; every object torch hands a worker (the tasks, the collate, the
dataset in its place, the ``worker_init_fn``) holds that same ``WorkerStream``. In a worker process
it is that worker's own copy (inherited by ``fork``, or resolved by its token when unpickled: one
per loader and process); with ``num_workers=0`` it is the loader's. The round trip of a worker's
progress:

1. **Save.** The main process records, for each batch handed to the caller, the ``Progress`` its
   worker tagged it with (``stream_state.StreamPass.deliver``); ``state_dict()`` writes each
   worker's last one.
2. **Load.** ``load_state_dict`` parses them back (``stream_state.parse_stream``): the next pass
   starts from them (``stream_position.StreamPosition``).
3. **iter().** The next pass hands each worker its progress and new number through ``WorkerInit``
   (``stream_tasks``); with ``num_workers=0`` the loader calls ``WorkerStream.start`` itself.
4. **Worker start.** ``WorkerInit`` renumbers the worker (torch's round-robin then continues at the
   right worker) and calls ``WorkerStream.start`` with the progress that worker resumes from.
5. **Each task.** Iterating a ``Ticket`` (the index list of one batch) seeds the keyed generators
   for the worker's next batch (``WorkerStream.seed``), after replaying items a stream without state
   must skip.
6. **First pull.** ``StreamStandIn`` opens the user's stream (``WorkerStream.open``) as torchdata's
   ``StatefulDataLoader`` does — ``set_epoch(epoch)``, the dataset's saved state, ``iter(dataset)``,
   then the saved state of the iterator it returned — and marks a worker whose stream ended (it
   stays ended on resume).
7. **Collate.** ``StreamCollate`` counts the batch into the progress, records the dataset's state
   (``WorkerStream.snapshot``) and tags the batch with the worker's number and a copy of its
   progress.
8. **Delivery.** Back in the main process, the tag of each batch handed over is step 1's record.
"""

from __future__ import annotations

import copy
import itertools
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from torch.utils.data import IterableDataset

from loader_resume.keyed.keyed_rng import derive_key, seed_generators
from loader_resume.state import StateError
from loader_resume.streams.library_protocols import library_protocol
from loader_resume.thirdparty import is_stateful

__all__ = ["END_OF_STREAM", "ENDED", "Progress", "StreamStandIn", "WorkerStream"]


@dataclass(slots=True)
class Progress:
    """One worker's progress in an epoch: batches and items it produced, and what its stream
    saved."""

    batches: int = 0
    items: int = 0
    state: Any = None
    """The dataset's ``state_dict()`` (Stateful protocol), else None."""
    iterator: Any = None
    """The ``state_dict()`` of the iterator ``iter(dataset)`` returned, when that is another
    stateful object."""
    ended: bool = False
    """The worker's stream ended in this epoch (its dataset may already have reset itself for the
    next); the state's ``"dry"``."""
    self_iterator: bool = False
    """The dataset is its own iterator (``__iter__`` returns ``self``): ``state`` is loaded after
    ``iter()`` only, as StatefulDataLoader does (such a dataset may build its position in
    ``__iter__``)."""
    before_epoch: bool = False
    """``state`` is the dataset's state at the end of the previous epoch, carried over because its
    copy lives on (``num_workers=0`` or persistent workers): it is loaded *before* ``set_epoch``, as
    the uninterrupted run told that copy its new epoch after it had ended the last one."""
    own: tuple[str, ...] = ()
    """Attributes the dataset copy changed in its own ``iter()`` (not through ``set_epoch`` or a
    state): a copy that lives on into later epochs carries them, and a replay in a new process
    starts them afresh."""
    library: Any = None
    """Restored through its library's own protocol: what the copy that iterates is handed
    (``loader_resume.streams.library_protocols``). Made at each restore from the counts above; never
    saved."""

    def needs_replay(self) -> bool:
        """Nothing restores this position but pulling and dropping the items delivered so far."""
        return self.items > 0 and not self.ended and self.state is None and self.iterator is None \
            and self.library is None


_TOKENS = itertools.count()


@dataclass
class WorkerStream:
    """One worker's stream and what it knows of itself (see the module docstring): one per loader
    and process.

    Pickled as its token: unpickled in a worker, every object holding it resolves to that worker's
    one copy."""

    token: tuple[int, int] = field(default_factory=lambda: (os.getpid(), next(_TOKENS)))
    epoch: int = -1
    worker: int = 0
    progress: Progress = field(default_factory=Progress)
    replay: int = 0
    """Items to pull and drop before the next batch, to reach a restored position (no dataset
    state)."""
    restore: Progress | None = None
    """What the stream is restored to when it is opened (``open``)."""
    dataset: Any = None
    """The user's dataset copy, once opened; ``dataset_state`` says whether it is Stateful (decided
    once)."""
    dataset_state: bool = False
    iterator: Any = None
    """The iterator the user's dataset returned, once opened, if it is another Stateful object (else
    None)."""
    keyed: tuple[int, int, int] | None = None
    """``(stream_key, key, mask)`` of the batch being pulled (see ``seed``), None when keying is
    off."""

    def __post_init__(self) -> None:
        _STREAMS[self.token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_worker_stream, (self.token,))

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerStream:
        # NOTE: a copy of a loader is another loader: its own WorkerStream (a new token), not this
        # one
        fresh = WorkerStream()
        for name, value in vars(self).items():
            if name != "token":
                setattr(fresh, name, copy.deepcopy(value, memo))
        return fresh

    def seed(self, stream_key: int, mask: int, ordinal: int) -> None:
        """Seed the keyed generators for this worker's batch ``ordinal`` and remember it
        (``open``)."""
        if mask:
            key = derive_key(stream_key, self.worker, ordinal)
            self.keyed = (stream_key, key, mask)
            seed_generators(key, mask)

    def start(self, epoch: int, worker: int, restore: Progress | None) -> None:
        """Become ``worker`` of ``epoch``, at the progress it is restored to (if any)."""
        self.epoch, self.worker, self.restore, self.iterator, self.keyed = (
            epoch,
            worker,
            restore,
            None,
            None,
        )
        # NOTE: sent with every batch of this epoch: the state it makes is of this epoch, never
        # "before" it
        self.progress = (
            replace(restore, library=None, before_epoch=False) if restore else Progress()
        )
        self.replay = restore.items if restore is not None and restore.needs_replay() else 0

    def open(self, dataset: Any) -> Iterator[Any]:
        """The user's stream for this epoch, restored as torchdata's StatefulDataLoader restores it.

        Called at the first pull of a pass, after that batch's key was seeded. NOTE: what opening
        draws (an ``__iter__`` that shuffles its shards) is keyed by the worker's epoch alone, not
        by the batch that happens to open it (the first of the epoch, or the one a resume continues
        with); and the batch's key is seeded again afterwards, since a ``load_state_dict`` may set
        the global generators back (torchdata's own test iterators save ``torch.get_rng_state()``).
        """
        keyed = self.keyed
        if keyed is not None:
            seed_generators(derive_key(keyed[0], self.worker, "open"), keyed[2])
        try:
            return self._open(dataset)
        finally:
            if keyed is not None:
                seed_generators(keyed[1], keyed[2])

    def _open(self, dataset: Any) -> Iterator[Any]:
        restore, self.restore = self.restore or Progress(), None
        # NOTE: decided once per pass, not per batch: is_stateful walks an HF stream's pipeline.
        self.dataset, self.dataset_state = dataset, is_stateful(dataset)
        # else loaded after iter() only
        state = restore.state if not restore.self_iterator else None
        # A state from after the stream ended (an ended worker's; one carried out of the last epoch)
        # is loaded before set_epoch, as the uninterrupted run's copy had it when told its next
        # epoch; a mid-epoch one after, as that copy was told its epoch before it made the state.
        ended = restore.ended or restore.before_epoch
        if ended and state is not None:
            dataset.load_state_dict(state)
        if restore.ended:
            return iter(())
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        protocol = library_protocol(dataset)
        if protocol is not None:
            protocol.in_worker(dataset, restore.library, epoch=self.epoch)
        if not ended and state is not None:
            dataset.load_state_dict(state)
        before = _scalars(dataset) if not self.dataset_state and protocol is None else None
        iterator = iter(dataset)
        if before is not None:
            own = {
                name
                for name, value in _scalars(dataset).items()
                if before.get(name, value) != value
            }
            self.progress.own = tuple(sorted(own.union(self.progress.own)))
        self.progress.self_iterator = iterator is dataset
        if restore.self_iterator and iterator is not dataset:
            raise StateError(
                f"stream.workers[{self.worker}].self_iterator",
                True,
                repr(False),
                f"iter({type(dataset).__name__}) no longer returns the dataset itself.",
            )
        if restore.iterator is not None:
            if not is_stateful(iterator):
                raise StateError(
                    f"stream.workers[{self.worker}].iterator",
                    restore.iterator,
                    "None",
                    f"iter({type(dataset).__name__}) returned a {type(iterator).__name__}, which "
                    "has no state_dict()/load_state_dict().",
                )
            iterator.load_state_dict(restore.iterator)
        elif iterator is dataset and restore.state is not None:
            # NOTE: as StatefulDataLoader does: a dataset whose __iter__ resets its position and
            # returns itself gets its state back *after* iter() too (it is its own iterator).
            dataset.load_state_dict(restore.state)
        self.iterator = iterator if iterator is not dataset and is_stateful(iterator) else None
        return iterator  # type: ignore[no-any-return]

    def snapshot(self) -> None:
        """Record the dataset's and its iterator's states in this worker's progress (after
        ``open``).

        NOTE: deep copies: a ``state_dict()`` may return the live objects the stream goes on
        mutating, and a worker's batch is pickled by the queue's feeder thread some time after it is
        put (as StatefulDataLoader).
        """
        progress = self.progress
        progress.state = _snapshot(self.dataset.state_dict()) if self.dataset_state else None
        progress.iterator = (
            _snapshot(self.iterator.state_dict()) if self.iterator is not None else None
        )


_ATOMIC = frozenset({int, float, str, bool, bytes, type(None)})


def _scalars(dataset: Any) -> dict[str, Any]:
    """The dataset's plain instance attributes (numbers, strings): where a stream keeps its own
    epoch or position."""
    try:
        attributes = vars(dataset)
    except TypeError:  # no __dict__
        return {}
    return {name: value for name, value in attributes.items() if type(value) in _ATOMIC}


def _snapshot(state: Any) -> Any:
    """A copy of ``state`` that later changes to the stream cannot reach.

    NOTE: the common state, a flat dict of numbers, is copied shallowly (~0.3 µs); anything else is
    deep-copied (~3 µs and up), on every batch.
    """
    if type(state) is dict and all(type(v) in _ATOMIC for v in state.values()):
        return dict(state)
    return copy.deepcopy(state)


_STREAMS: weakref.WeakValueDictionary[tuple[int, int], WorkerStream] = weakref.WeakValueDictionary()
"""This process's ``WorkerStream`` of each loader, by token (what an unpickled one resolves to)."""


def _worker_stream(token: tuple[int, int]) -> WorkerStream:
    found = _STREAMS.get(token)
    return found if found is not None else WorkerStream(token)


class StreamStandIn(IterableDataset[Any]):
    """What torch's iterator iterates in place of the user's iterable dataset: step 6 of the module
    docstring."""

    def __init__(self, dataset: Any, stream: WorkerStream) -> None:
        self.dataset, self.stream = dataset, stream

    def __iter__(self) -> Iterator[Any]:
        # NOTE: a generator, so nothing runs until torch's fetcher pulls the first item, after the
        # first Ticket of the pass has told the worker its epoch (a persistent worker is handed a
        # new iterator before it knows the epoch). `yield from` keeps the per-item cost at C speed.
        stream = self.stream
        opened = stream.open(self.dataset)
        # restored ended: its saved progress already holds its end-of-stream state
        if stream.progress.ended:
            return
        yield from _Opened(opened)
        stream.progress.ended = True
        # the state after the stream ended (a dataset may reset or count epochs there)
        stream.snapshot()
        yield END_OF_STREAM  # so the main process learns that state even when no batch carries it


class _EndOfStream:
    """The last item a worker's stream yields (never collated): the batch carrying it, or an
    ``ENDED`` batch, tells the main process the stream's end-of-stream progress."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> str:
        return self.name  # pickled as the module's singleton

    def __repr__(self) -> str:
        return f"loader_resume.streams.stream_worker.{self.name}"


END_OF_STREAM = _EndOfStream("END_OF_STREAM")
ENDED = _EndOfStream("ENDED")
"""What a worker sends in place of a batch when its stream ended with no items left to batch."""


class _Opened:
    """An iterator already opened, for ``yield from``.

    NOTE: ``yield from iterator`` calls ``iter()`` on it a second time, which resets a dataset whose
    ``__iter__`` returns itself; ``iter(iterator.__next__, sentinel)`` compares every item with the
    sentinel, which fails on numpy arrays. This hands the iterator over as it is.
    """

    __slots__ = ("iterator",)

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def __iter__(self) -> Iterator[Any]:
        return self.iterator

