"""Iterable datasets: each worker's state travels with its batches; the round-robin resumes in place.

An ``IterableDataset`` owns its position, one copy per worker. Everything here runs through public
DataLoader hooks, torch's worker loop untouched:

- the *index list* of each task (:class:`Ticket`) is iterated by torch's fetcher right before it pulls
  items from the stream: there the keyed generators are reseeded from (seed, epoch, rank, worker, batch
  ordinal of that worker), and skipped items are replayed for datasets without state;
- the *collate function* (:class:`StreamCollate`) runs in the worker right after: it tags the batch with
  the worker's progress and its dataset's ``state_dict()``; the main process keeps the tags of batches
  actually handed to the caller;
- the *worker_init_fn* (:class:`WorkerInit`) restores each worker's saved state before it iterates and
  renumbers workers, so torch's round-robin, which always starts with the first worker it started,
  continues at the worker after the last one delivered (:func:`report_worker_id`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import get_worker_info

from .keyed_rng import CallerRng, derive_key, seed_generators

__all__ = ["Progress", "StreamCollate", "Ticket", "WorkerInit", "WorkerRestore", "WorkerSide", "report_worker_id"]


@dataclass(slots=True)
class Progress:
    """One worker's progress in an epoch: batches and items it produced, and its dataset's state."""

    batches: int = 0
    items: int = 0
    state: Any = None


@dataclass(slots=True)
class WorkerSide:
    """What a worker knows of itself. Worker processes use the module's one instance; with
    ``num_workers=0`` each loader has its own, so two loaders in one process never mix counts."""

    epoch: int = -1
    worker: int = 0
    progress: Progress = field(default_factory=Progress)
    replay: int = 0
    """Items to pull and drop before the next batch, to reach a restored position (no dataset state)."""

    def start(self, epoch: int, worker: int, restore: Progress | None, replay: bool) -> None:
        """Become ``worker`` of ``epoch``, at the progress it is restored to (if any)."""
        self.epoch, self.worker = epoch, worker
        self.progress = Progress(restore.batches, restore.items, restore.state) if restore else Progress()
        self.replay = restore.items if restore is not None and replay else 0


_IN_WORKER = WorkerSide()


class Ticket(list[None]):
    """The ``[None] * batch_size`` task torch sends a worker; iterating it keys the pull of one batch.

    ``spec = (epoch, stream_key, mask, batch_size)``; ``mask`` 0 means keying is off. ``side`` is set
    only for ``num_workers=0`` (a ticket sent to a worker is pickled without it).
    """

    __slots__ = ("side", "spec")

    def __init__(self, spec: tuple[int, int, int, int], side: WorkerSide | None = None) -> None:
        super().__init__([None] * spec[3])
        self.spec, self.side = spec, side

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ticket, (self.spec,))

    def _side(self) -> WorkerSide:
        return self.side if self.side is not None else _IN_WORKER

    def __len__(self) -> int:
        # NOTE: torch's fetcher compares the items it got with len(index) for drop_last.
        return self.spec[3] + self._side().replay

    def __iter__(self) -> Iterator[None]:
        epoch, stream_key, mask, batch_size = self.spec
        side = self._side()
        if side.epoch != epoch:  # a persistent worker entering a new epoch
            side.start(epoch, side.worker, None, False)
        if self.side is None and not side.replay:
            # NOTE: in a worker with nothing to replay: seed, then C's list iterator (no generator).
            if mask:
                seed_generators(derive_key(stream_key, side.worker, side.progress.batches), mask)
            return list.__iter__(self)
        return self._guarded(stream_key, mask, batch_size, side)

    def _guarded(self, stream_key: int, mask: int, batch_size: int, side: WorkerSide) -> Iterator[None]:
        """Replay and/or the caller's RNG restored after the last pull (main process)."""
        caller = CallerRng(mask).save() if mask and self.side is not None else None
        try:
            # NOTE: replayed items are pulled under the keys of the batches they first came in.
            left, ordinal = side.replay, 0
            while left > 0:
                yield from _keyed_pull(stream_key, mask, side.worker, ordinal, min(batch_size, left))
                left, ordinal = left - batch_size, ordinal + 1
            yield from _keyed_pull(stream_key, mask, side.worker, side.progress.batches, batch_size)
        finally:
            if caller is not None:
                caller.restore()


def _keyed_pull(stream_key: int, mask: int, worker: int, ordinal: int, count: int) -> Iterator[None]:
    if mask:
        seed_generators(derive_key(stream_key, worker, ordinal), mask)
    yield from [None] * count


class StreamCollate:
    """Collate in the worker, then tag the batch with the worker's progress and dataset state."""

    def __init__(self, collate_fn: Callable[[Any], Any], *, unbatch: bool, drop_last: bool, batch_size: int,
                 side: WorkerSide | None = None, dataset: Any = None) -> None:
        self.collate_fn, self.unbatch, self.drop_last, self.batch_size = collate_fn, unbatch, drop_last, batch_size
        self.side, self.dataset = side, dataset

    def __call__(self, items: list[Any]) -> tuple[Any, tuple[int, int, int, Any]]:
        side = self.side if self.side is not None else _IN_WORKER
        replayed, side.replay = side.replay, 0
        items = items[replayed:]
        progress = side.progress
        progress.items += replayed
        if not items or (self.drop_last and len(items) < self.batch_size):
            # NOTE: torch's worker loop (and the single-process iterator) take a StopIteration
            # raised while fetching as the end of this worker's stream.
            raise StopIteration
        progress.batches += 1
        progress.items += len(items)
        dataset = self.dataset if self.side is not None else getattr(get_worker_info(), "dataset", None)
        state_dict = getattr(dataset, "state_dict", None)
        progress.state = state_dict() if callable(state_dict) else None
        batch = self.collate_fn(items[0]) if self.unbatch else self.collate_fn(items)
        return batch, (side.worker, progress.batches, progress.items, progress.state)


@dataclass(frozen=True, slots=True)
class WorkerRestore:
    """What each worker needs at start: its new number and the progress it resumes from."""

    epoch: int
    offset: int
    """The ``p``-th worker torch starts becomes worker ``(p + offset) % num_workers``."""
    progress: tuple[Progress | None, ...]
    replay: bool


class WorkerInit:
    """``worker_init_fn`` wrapper: renumber, restore the dataset copy, then call the user's function."""

    def __init__(self, user_fn: Callable[[int], None] | None, restore: WorkerRestore) -> None:
        self.user_fn, self.restore = user_fn, restore

    def __call__(self, started_as: int) -> None:
        info = get_worker_info()
        assert info is not None  # torch calls worker_init_fn inside a worker, with its info set
        worker = (started_as + self.restore.offset) % info.num_workers
        report_worker_id(worker)
        progress = self.restore.progress[worker]
        if progress is not None and progress.state is not None:
            info.dataset.load_state_dict(progress.state)  # type: ignore[attr-defined]
        _IN_WORKER.start(self.restore.epoch, worker, progress, self.restore.replay)
        if self.user_fn is not None:
            self.user_fn(worker)


def report_worker_id(worker: int) -> None:
    """Make ``get_worker_info().id`` report ``worker`` in this worker process.

    NOTE: the one private torch detail of this module: ``WorkerInfo`` is frozen (a frozen slotted
    dataclass in torch 2.13, a class guarding ``__setattr__`` before), and ``object.__setattr__`` is
    how its ``id`` is changed in place. torch's round-robin always hands the first task to the first
    worker it started; renumbering which shard each started worker serves is how the order continues
    at the right worker without forking torch's worker loop. Pinned by a test.
    """
    info = get_worker_info()
    if info is None:
        raise RuntimeError("report_worker_id() must run inside a DataLoader worker")
    object.__setattr__(info, "id", worker)
