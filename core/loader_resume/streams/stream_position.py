"""Iterable datasets (streams): the position is each worker's progress and the round-robin's next
worker.

A stream's position lives in the dataset copies (one per worker, per rank); the main process keeps
the progress each delivered batch was tagged with (``loader_resume.streams.stream_tasks``) and
restores the workers from it. Ticket keys and the saved layout:
``loader_resume.streams.stream_tasks``, ``loader_resume.streams.stream_state``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from loader_resume.audit.log import warn_unaudited
from loader_resume.keyed.keyed_rng import derive_key
from loader_resume.position import SKIP, PassStart, Setup, tell_epoch
from loader_resume.state import StateError
from loader_resume.streams.library_protocols import LibraryProtocol, library_protocol
from loader_resume.streams.stream_state import StreamPass, parse_stream, stream_to_dict
from loader_resume.streams.stream_tasks import (
    StreamCollate,
    Ticket,
    TicketSpec,
    WorkerInit,
    WorkerRestore,
)
from loader_resume.streams.stream_worker import ENDED, Progress, StreamStandIn, WorkerStream
from loader_resume.thirdparty import is_stateful, warn_replay, warn_self_kept

__all__ = ["RESHARD_HINT", "StreamPosition"]

logger = logging.getLogger(__name__)

RESHARD_HINT = (
    "An iterable dataset's position lives in each worker's (and rank's) own copy of the dataset, "
    "so it can only resume with the num_workers and world size it was saved with; or give the "
    "dataset a reshard_states(states, num_shards) method (see the docs: Iterable datasets) to "
    "allow a change (world size changes go through loader_resume.distributed.load_rank_state)."
)


@dataclass(frozen=True, slots=True)
class NextStreamPass:
    """Where the next ``iter()`` over a stream starts (the one value that decides it; see
    ``StreamPosition``)."""

    epoch: int
    delivered: int = 0
    """Batches the caller had from this epoch before it (after a load)."""
    restore: tuple[list[Progress], int] | None = None
    """After a load: each worker's progress, and the worker that delivers next."""
    carry: list[Progress] | None = None
    """After a pass whose dataset copies live on: their end-of-epoch states, carried into the next
    pass."""


class StreamPosition:
    """Each worker's progress in the epoch; see ``loader_resume.position.Position`` for the
    interface."""

    kind = "iterable"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.worker_stream = WorkerStream()
        """The owner of each worker's progress (of this process's, at ``num_workers=0``): see
        ``stream_worker``."""
        self._renumbered = False  # the last pool was started renumbered (see begin)
        self.reset(None)

    # --- Position --------------------------------------------------------------------------------
    def reset(self, state: Mapping[str, Any] | None) -> None:
        if state is None:
            self._pass: StreamPass | None = None
            self.epoch = 0
            self._next = NextStreamPass(0)
            return
        shard = self.setup.shard()
        if state["world_size"] != shard.world:
            raise StateError("world_size", state["world_size"], repr(shard.world), RESHARD_HINT)
        progress, next_worker, delivered = parse_stream(state["stream"], shard.rank)
        if state["num_workers"] != self.setup.num_workers:
            shards = [p.state if p.batches else None for p in progress]
            change = ("num_workers", state["num_workers"], self.setup.num_workers)
            progress, next_worker = self._reshard(shards, change), 0
        self._restore_to(state["epoch"], delivered, progress, next_worker)

    def begin(
        self, collate_fn: Callable[[Any], Any], worker_init_fn: Callable[[int], None] | None
    ) -> PassStart:
        setup = self.setup
        # NOTE: one left mid-way
        start = self._next if self._pass is None or self._pass.done else _after(self._pass)
        self.epoch = start.epoch
        tell_epoch(setup.dataset, self.epoch)
        # NOTE: a carried end-of-epoch state is not loaded into copies that live on (they hold it);
        # it stands for each worker in this pass's state until that worker delivers.
        carry = (
            start.carry if start.carry is not None and len(start.carry) == setup.workers else None
        )
        fresh = carry or [Progress() for _ in range(setup.workers)]
        restored = start.restore is not None
        progress, offset = start.restore or (fresh, 0)
        protocol = library_protocol(setup.dataset)
        if protocol is not None:
            progress, offset = self._through_library(protocol, progress, offset, restored)
        if len(progress) != setup.workers:
            raise ValueError(
                f"num_workers={setup.num_workers}, but the state loaded holds {len(progress)} "
                "workers' positions: set num_workers before load_state_dict() (a stream re-shards "
                "only there)"
            )
        # NOTE: a pass left mid-epoch ends its epoch: the iter() after it starts the next one, from
        # nothing (set once nothing above can raise: a failed iter() leaves the start where it was)
        self._next = NextStreamPass(start.epoch + 1)
        self._pass = StreamPass(self.epoch, list(progress), offset, start.delivered,
                                lives_on=setup.num_workers == 0 or setup.persistent_workers)
        replay = sum(p.items for p in progress if p.needs_replay()) if restored else 0
        if replay:
            warn_replay(setup.dataset, replay)
        audit = setup.audit_log()
        if audit is not None:
            audit.record({"t": "pass", "e": self.epoch, "wb": [p.batches for p in progress]})
        else:
            warn_unaudited(setup)
        stream = self.worker_stream
        collate = StreamCollate(
            collate_fn,
            stream,
            unbatch=setup.unbatched,
            drop_last=setup.drop_last,
            batch_size=setup.batch_size or 1,
        )
        if setup.num_workers == 0:
            stream.start(self.epoch, 0, progress[0] if restored else None)
            attributes = {"collate_fn": collate, "dataset": StreamStandIn(setup.dataset, stream)}
            return PassStart(self._pass, attributes, False)
        load, restart = restored, False
        if setup.persistent_workers and (restored or self._renumbered):
            # NOTE: restored or renumbered workers must be started afresh: a persistent pool keeps
            # the numbering and the dataset copies it was started with (DataLoader's own
            # `_iterator`). The fresh copies of a renumbered pool are given what the old ones
            # carried out of their last epoch.
            restart, load = True, restored or any(p.before_epoch for p in progress)
        self._renumbered = offset != 0
        init = WorkerInit(worker_init_fn, WorkerRestore(
            self.epoch, offset, tuple(progress) if load else (None,) * setup.workers,
            report=protocol is None or protocol.per_worker), stream)
        attributes = {
            "collate_fn": collate,
            "worker_init_fn": init,
            "dataset": StreamStandIn(setup.dataset, stream),
        }
        return PassStart(self._pass, attributes, restart)

    def deliver(self, pass_: StreamPass, item: Any, number: int | None = None) -> Any:
        batch, meta = item
        ours = pass_ is self._pass
        if batch is ENDED:  # a worker's stream ended with nothing left to batch: record, go on
            if ours:
                pass_.deliver(meta, batch=False)
            return SKIP
        if ours:
            pass_.deliver(meta)
            # epoch, worker, and the worker's batches and items after this one
            if self.setup.audit is not None:
                self.setup.audit.delivered(
                    ("w", pass_.epoch, meta[0], meta[1].batches, meta[1].items)
                )
        return batch

    def end(self, pass_: StreamPass) -> None:
        """The pass is over: the next starts the next epoch, carrying what copies that live on hold
        (``_after``)."""
        if pass_ is not self._pass or pass_.done:
            return
        pass_.done = True
        # NOTE: a stream's end is written at once (see audit.map_step)
        if self.setup.audit is not None:
            self.setup.audit.flush()
        self.epoch += 1
        self._next = _after(pass_)

    def progress(self) -> tuple[int, int | None]:
        return self._current().delivered, None

    def state(self, batches_ago: int = 0, pass_ended: bool = False) -> dict[str, Any]:
        if pass_ended and batches_ago:
            raise ValueError(
                f"batches_ago={batches_ago} with pass_ended=True: a pass that ended has no batches "
                "to go back over"
            )
        current = self._current(pass_ended)
        current = current.rewound(batches_ago) if batches_ago else current
        return {"epoch": current.epoch, "stream": stream_to_dict(self.setup.shard().rank, current)}

    def batches_per_epoch(self) -> int:
        raise TypeError("an IterableDataset's stream has no length for the loader to compute")

    def dataset_len(self) -> None:
        return None

    def __iter__(self) -> Iterator[Ticket]:
        """Endless tasks (torch's own sampler for an iterable dataset is endless too)."""
        epoch = self._pass.epoch if self._pass is not None else self.epoch
        setup = self.setup
        stream_key = derive_key(setup.seed, epoch, "stream", setup.shard().rank)
        spec = TicketSpec(
            epoch, stream_key, 0 if setup.keying == "off" else setup.mask, setup.batch_size or 1
        )
        return _endless(spec, self.worker_stream)

    # --- beyond the interface --------------------------------------------------------------------
    @property
    def batches_delivered(self) -> int:
        """Batches handed to the caller in the current pass (what ``state(batches_ago)`` can go back
        over)."""
        return self._current().delivered

    def reset_resharded(self, ranks: list[dict[str, Any]]) -> None:
        """Resume from every old rank's validated state, saved at another world size (see
        ``reshard_states``)."""
        shards: list[Any] = []
        for rank, state in enumerate(ranks):
            shards += [
                p.state if p.batches else None for p in parse_stream(state["stream"], rank).progress
            ]
        progress = self._reshard(shards, ("world_size", len(ranks), self.setup.shard().world))
        self._restore_to(ranks[0]["epoch"], 0, progress, 0)

    # --- internals -------------------------------------------------------------------------------
    def _through_library(self, protocol: LibraryProtocol, progress: list[Progress], offset: int,
                         restored: bool) -> tuple[list[Progress], int]:
        """The pass's starting progress when the dataset keeps its own position (see
        ``library_protocols``): its library's protocol is fed with the loader's counts, in this
        process, before any worker starts."""
        dataset, workers, world = self.setup.dataset, self.setup.workers, self.setup.shard().world
        size = self.setup.batch_size or 1
        if protocol.per_worker:
            if not restored:
                return progress, offset
            return [
                replace(
                    p,
                    library=protocol.main_process(
                        dataset,
                        epoch=self.epoch,
                        items=p.items,
                        worker=i,
                        workers=workers,
                        world=world,
                        batch_size=size,
                    ),
                )
                if p.items and not p.ended
                else p
                for i, p in enumerate(progress)
            ], offset
        items = sum(p.items for p in progress) if restored else 0
        handed = protocol.main_process(
            dataset,
            epoch=self.epoch,
            items=items,
            worker=0,
            workers=workers,
            world=world,
            batch_size=size,
        )
        # NOTE: the library re-partitions the rest of the epoch from the worker torch starts first,
        # and reads the worker's number itself (so workers are not renumbered for it, see
        # WorkerRestore.report); in the round-robin that worker's batch is the one the saved
        # next_worker would have made, whose number and count key it, as in the uninterrupted run.
        return ([replace(p, library=handed) for p in progress] if restored else progress), offset

    def _current(self, pass_ended: bool = False) -> StreamPass:
        """The pass a state taken now describes (see the loader's semantics); ``pass_ended``: the
        next one."""
        live = self._pass is not None and not self._pass.done
        if live and not pass_ended:
            return self._pass  # type: ignore[return-value]
        start = _after(self._pass) if live else self._next  # type: ignore[arg-type]
        if start.restore is not None:
            progress, next_worker = start.restore
            return StreamPass(start.epoch, list(progress), next_worker, start.delivered)
        carry = (
            start.carry
            if start.carry is not None and len(start.carry) == self.setup.workers
            else None
        )
        return StreamPass(
            start.epoch, list(carry or [Progress() for _ in range(self.setup.workers)]), 0
        )

    def _reshard(self, shards: list[Any], change: tuple[str, int, int]) -> list[Progress]:
        """This rank's workers' progress after the dataset re-shards ``shards`` (all old shards'
        states, rank-major; None where a worker had delivered nothing)."""
        dataset = self.setup.dataset
        reshard = getattr(dataset, "reshard_states", None)
        if not callable(reshard):
            field, saved, now = change
            raise StateError(field, saved, repr(now), RESHARD_HINT)
        workers = self.setup.workers
        shard = self.setup.shard()
        rank, world = (shard.rank, shard.world) if change[0] == "world_size" else (0, 1)
        states = list(reshard(shards, world * workers))
        if len(states) != world * workers:
            raise ValueError(
                f"{type(dataset).__name__}.reshard_states returned {len(states)} states, "
                f"expected {world * workers} (one per new worker of every rank)"
            )
        logger.warning(
            "re-sharded %s for %s %d -> %d: delivery continues exactly once as its "
            "reshard_states() "
            "guarantees, but order and keyed values differ from an uninterrupted run",
            type(dataset).__name__,
            *change,
        )
        return [Progress(0, 0, s) for s in states[rank * workers : (rank + 1) * workers]]

    def _restore_to(
        self, epoch: int, delivered: int, progress: list[Progress], next_worker: int
    ) -> None:
        workers = self.setup.workers
        if len(progress) != workers:
            raise StateError(
                "stream.workers",
                f"{len(progress)} workers",
                repr(f"{workers} workers"),
                "The state was edited or corrupted.",
            )
        stateful = is_stateful(self.setup.dataset)
        for i, p in enumerate(progress):
            if (p.state is not None and not stateful) or (
                stateful and p.batches > 0 and p.state is None
            ):
                expected = (
                    f"the state of {type(self.setup.dataset).__name__}" if stateful else "None"
                )
                raise StateError(f"stream.workers[{i}].state", p.state, expected)
        own = sorted({name for p in progress for name in p.own})
        lives_on = self.setup.num_workers == 0 or self.setup.persistent_workers
        if (
            own
            and epoch > 0
            and lives_on
            and not stateful
            and library_protocol(self.setup.dataset) is None
        ):
            warn_self_kept(self.setup.dataset, own)
        self.epoch, self._pass = epoch, None
        self._next = NextStreamPass(epoch, delivered, (progress, next_worker))


def _after(pass_: StreamPass) -> NextStreamPass:
    """Where the pass after ``pass_`` starts, ``pass_`` ended or left mid-way. Where its dataset
    copies live on (``num_workers=0`` or persistent workers) each one's last state is carried into
    the next pass: a dataset that counts its own epochs, resets at its end, or goes on from where a
    loop left it, resumes as that copy would go on. A dataset that is its own iterator is
    re-initialised by ``iter()`` and carries nothing. Fresh workers start from the main process's
    copy, in the uninterrupted run as after a resume, so nothing is carried for them. NOTE:
    persistent workers left mid-way have read ahead (torch drops what they prefetched): the carried
    state is the last delivered batch's, so a resumed run gets those items where the uninterrupted
    one skips them."""
    carry = None
    if pass_.lives_on:
        left = not pass_.done
        carry = [
            Progress(state=p.state, before_epoch=True, own=p.own)
            if (p.ended or left) and p.state is not None and not p.self_iterator
            else Progress(own=p.own)
            for p in pass_.progress
        ]
    useful = carry is not None and any(p.before_epoch or p.own for p in carry)
    return NextStreamPass(pass_.epoch + 1, carry=carry if useful else None)


def _endless(spec: TicketSpec, stream: WorkerStream) -> Iterator[Ticket]:
    while True:
        yield Ticket(spec, stream)
