"""Iterable datasets, the tasks and hooks torch runs: keyed pulls, tagged batches, renumbered
workers (steps 3-5 and 7 of the round trip in ``loader_resume.streams.stream_worker``). Each holds
the loader's ``WorkerStream``.

Everything here runs through public DataLoader hooks, torch's worker loop untouched:

- the *index list* of each task (``Ticket``) is iterated by torch's fetcher right before it pulls
  items from the stream: there the keyed generators are reseeded from (seed, epoch, rank, worker,
  batch ordinal of that worker), and skipped items are replayed for datasets without state;
- the *collate function* (``StreamCollate``) runs in the worker right after: it tags the batch with
  the worker's progress and its dataset's ``state_dict()`` (``WorkerMeta``); the main process keeps
  the tags of batches actually handed to the caller;
- the *worker_init_fn* (``WorkerInit``) renumbers workers, so torch's round-robin, which always
  starts with the first worker it started, continues at the worker after the last one delivered
  (``report_worker_id``), and hands each worker the progress it resumes from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from torch.utils.data import get_worker_info

from loader_resume.streams.stream_worker import (
    END_OF_STREAM,
    ENDED,
    Progress,
    StreamStandIn,
    WorkerStream,
)
from loader_resume.workers.torch_internals import set_past_guard

__all__ = [
    "StreamCollate",
    "Ticket",
    "TicketSpec",
    "WorkerInit",
    "WorkerMeta",
    "WorkerRestore",
    "report_worker_id",
]


class TicketSpec(NamedTuple):
    """What every task of one pass over an iterable dataset shares."""

    epoch: int
    stream_key: int
    """This rank's key for the epoch; a worker's batch is keyed by (stream_key, worker, batch
    ordinal)."""
    mask: int
    """The keyed generators; 0 when keying is off."""
    batch_size: int


class WorkerMeta(NamedTuple):
    """The tag a worker sends with each batch: who made it, and that worker's progress after it."""

    worker: int
    progress: Progress


class Ticket(list[None]):
    """The ``[None] * batch_size`` task torch sends a worker; iterating it keys the pull of one
    batch."""

    __slots__ = ("spec", "stream")

    def __init__(self, spec: TicketSpec, stream: WorkerStream) -> None:
        super().__init__([None] * spec.batch_size)
        self.spec, self.stream = spec, stream

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: the spec's fields travel as plain values (a NamedTuple pickles its class too, per
        # batch).
        return (_ticket, (*self.spec, self.stream))

    def __len__(self) -> int:
        # NOTE: torch's fetcher compares the items it got with len(index) for drop_last.
        return self.spec.batch_size + self.stream.replay

    def __iter__(self) -> Iterator[None]:
        epoch, stream_key, mask, batch_size = self.spec
        stream = self.stream
        if stream.epoch != epoch:  # a persistent worker entering a new epoch
            stream.start(epoch, stream.worker, None)
        if not stream.replay:
            # NOTE: seed, then C's list iterator (no generator). In the main process the loader
            # saved the caller's generators before this fetch and restores them after its collate
            # (keyed too).
            stream.seed(stream_key, mask, stream.progress.batches)
            return list.__iter__(self)
        return self._replaying(stream_key, mask, batch_size, stream)

    @staticmethod
    def _replaying(
        stream_key: int, mask: int, batch_size: int, stream: WorkerStream
    ) -> Iterator[None]:
        # NOTE: replayed items are pulled under the keys of the batches they first came in.
        left, ordinal = stream.replay, 0
        while left > 0:
            stream.seed(stream_key, mask, ordinal)
            yield from [None] * min(batch_size, left)
            left, ordinal = left - batch_size, ordinal + 1
        stream.seed(stream_key, mask, stream.progress.batches)
        yield from [None] * batch_size


def _ticket(
    epoch: int, stream_key: int, mask: int, batch_size: int, stream: WorkerStream
) -> Ticket:
    return Ticket(TicketSpec(epoch, stream_key, mask, batch_size), stream)


class StreamCollate:
    """Collate in the worker, then tag the batch with the worker's progress and dataset state."""

    def __init__(
        self,
        collate_fn: Callable[[Any], Any],
        stream: WorkerStream,
        *,
        unbatch: bool,
        drop_last: bool,
        batch_size: int,
    ) -> None:
        self.collate_fn, self.unbatch, self.drop_last, self.batch_size = (
            collate_fn,
            unbatch,
            drop_last,
            batch_size,
        )
        self.stream = stream

    def __call__(self, items: list[Any]) -> tuple[Any, WorkerMeta]:
        stream = self.stream
        ended = bool(items) and items[-1] is END_OF_STREAM
        if ended:
            items = items[:-1]
        replayed, stream.replay = stream.replay, 0
        # NOTE: already counted: the progress starts where the state it resumes stood
        items = items[replayed:]
        progress = stream.progress
        if not items or (self.drop_last and len(items) < self.batch_size):
            if ended:
                return ENDED, WorkerMeta(stream.worker, replace(progress))
            # NOTE: torch's worker loop (and the single-process iterator) take a StopIteration
            # raised while fetching as the end of this worker's stream.
            raise StopIteration
        progress.batches += 1
        progress.items += len(items)
        stream.snapshot()
        batch = self.collate_fn(items[0]) if self.unbatch else self.collate_fn(items)
        return batch, WorkerMeta(stream.worker, replace(progress))


@dataclass(frozen=True, slots=True)
class WorkerRestore:
    """What each worker needs at start: its new number and the progress it resumes from."""

    epoch: int
    offset: int
    """The ``p``-th worker torch starts becomes worker ``(p + offset) % num_workers``."""
    progress: tuple[Progress | None, ...]
    report: bool = True
    """Whether ``get_worker_info().id`` reports the new number; a library that partitions an epoch's
    rest by the number itself keeps torch's (see ``library_protocols``), while keys and tags use the
    new one."""


class WorkerInit:
    """``worker_init_fn`` wrapper: renumber, restore the dataset copy, then call the user's
    function."""

    def __init__(
        self, user_fn: Callable[[int], None] | None, restore: WorkerRestore, stream: WorkerStream
    ) -> None:
        self.user_fn, self.restore, self.stream = user_fn, restore, stream

    def __call__(self, started_as: int) -> None:
        info = get_worker_info()
        assert info is not None  # torch calls worker_init_fn inside a worker, with its info set
        worker = (started_as + self.restore.offset) % info.num_workers
        if self.restore.report:
            report_worker_id(worker)
        if isinstance(info.dataset, StreamStandIn):
            # NOTE: the user's worker_init_fn sees (and may shard) its own dataset, as with
            # DataLoader.
            set_past_guard(info, "dataset", info.dataset.dataset)
        self.stream.start(self.restore.epoch, worker, self.restore.progress[worker])
        if self.user_fn is not None:
            self.user_fn(worker)


def report_worker_id(worker: int) -> None:
    """Make ``get_worker_info().id`` report ``worker`` in this worker process.

    NOTE: ``WorkerInfo`` is frozen; ``set_past_guard`` changes its ``id``
    in place. torch's round-robin always hands the first task to the first
    worker it started; renumbering which shard each started worker serves is how the order continues
    at the right worker without forking torch's worker loop. Pinned by a test.
    """
    info = get_worker_info()
    if info is None:
        raise RuntimeError("report_worker_id() must run inside a DataLoader worker")
    set_past_guard(info, "id", worker)
