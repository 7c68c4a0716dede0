"""Where a loader stands in its data: the one interface the loader delegates to, and what both kinds
share.

``ResumableDataLoader`` keeps torch's hooks; what a batch handed over means is a ``Position``'s:

- ``loader_resume.order.map_position.MapPosition``: map-style data, a count of global samples
  delivered in one global order (the same on every rank);
- ``loader_resume.streams.stream_position.StreamPosition``: iterable datasets (*streams*), each
  worker's progress and the round-robin's next worker, on this rank.

A position is what torch's iterator draws its index lists from (``iter(position)``), so it holds
nothing that holds the loader: a persistent-workers loader holds its iterator, and a cycle back
would make every shutdown wait out torch's 5 s worker join timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

from loader_resume.distributed import rank_and_world
from loader_resume.keyed.keyed_rng import CallerRng
from loader_resume.order.sampler import Shard
from loader_resume.workers.torch_internals import next_batch, next_numbered
from loader_resume.workers.worker_transport import BY_VALUE_BYTES

__all__ = ["SKIP", "PassStart", "Position", "Setup", "PassIterator", "tell_epoch"]

T = TypeVar("T")

SKIP: Final = object()
"""What ``Position.deliver`` returns for an item of torch's iterator that is not a batch for the
caller."""


@dataclass(frozen=True, slots=True)
class Setup:
    """The loader's settings a position depends on, fixed when the loader is built."""

    dataset: Any
    """``DataLoader.dataset`` (torch wraps a datapipe there so that workers unpickle it with
    dill)."""
    seed: int
    keying: str
    generators: tuple[str, ...]
    """The keyed generators' names (``keyed_generators``)."""
    mask: int
    """The same as a mask (``loader_resume.keyed.keyed_rng.generator_mask``)."""
    batch_size: int | None
    unbatched: bool
    """``batch_size=None`` without a batch sampler: items are handed over one by one, not
    collated."""
    drop_last: bool
    num_workers: int
    persistent_workers: bool
    rank: int | None
    """Explicit rank, else None: read from ``torch.distributed`` when needed (it may start
    later)."""
    world_size: int | None
    shard_drop_last: bool | None = None
    """A ``DistributedSampler``'s own ``drop_last`` when the loader took one over, else None."""
    in_order: bool = True
    """``DataLoader(in_order=...)``: ``False`` lets workers' batches arrive in any order."""
    by_value_bytes: int = BY_VALUE_BYTES
    """Tensors up to this size come back from workers by value
    (``loader_resume.workers.worker_transport``)."""
    audit: Any = None
    """The loader's ``loader_resume.audit.log.AuditLog`` (``audit=DIR``), else None: nothing is
    recorded."""

    def audit_log(self) -> Any:
        """The audit log, opened for this rank (None when the loader keeps none)."""
        if self.audit is not None:
            self.audit.open(*rank_and_world(self.rank, self.world_size))
        return self.audit

    def shard(self) -> Shard:
        """This rank's view of the global order (rank and world size resolved now)."""
        rank, world = rank_and_world(self.rank, self.world_size)
        drop_last = self.drop_last if self.shard_drop_last is None else self.shard_drop_last
        return Shard(rank, world, self.batch_size or 1, drop_last)

    @property
    def workers(self) -> int:
        """Dataset copies that make batches: one per worker, one in this process for
        ``num_workers=0``."""
        return max(self.num_workers, 1)

    @property
    def seeds_ahead(self) -> bool:
        """Whether workers seed each next batch ahead (``keyed_fetch.SeedAhead``): per-batch keying
        in workers."""
        return bool(self.num_workers and self.keying == "batch" and self.mask)

    @property
    def fetches_here(self) -> bool:
        """Whether keyed batches are fetched in this process (seeded here, caller's generators
        restored)."""
        return bool(self.num_workers == 0 and self.keying != "off" and self.mask)


@dataclass(frozen=True, slots=True)
class PassStart:
    """A pass a position has begun: what the loader hands torch's iterator while it is built."""

    pass_: Any
    """The pass's token: deliveries are recorded against it, and only while it is the position's
    current one."""
    attributes: dict[str, Any]
    """Loader attributes torch reads while building its iterator (``collate_fn``,
    ``worker_init_fn``, ``dataset``)."""
    restart_workers: bool
    """A persistent worker pool must be started afresh (its dataset copies are stale)."""


class Position(Protocol):
    """Where a loader stands; fresh start and resume go through one entry, ``reset`` (as torchdata
    nodes)."""

    kind: str
    """The state's ``kind``: ``"map"`` or ``"iterable"``."""
    setup: Setup
    """The loader's settings (replaced by the loader when its ``num_workers`` changes between
    passes)."""
    epoch: int
    """The epoch the next batch belongs to."""

    def reset(self, state: Mapping[str, Any] | None) -> None:
        """Stand at the start of epoch 0 (``None``), or where a validated loader ``state`` says."""

    def begin(
        self, collate_fn: Callable[[Any], Any], worker_init_fn: Callable[[int], None] | None
    ) -> PassStart:
        """Begin a pass at the current position (the next epoch's start if the last pass was left
        mid-epoch)."""

    def deliver(self, pass_: Any, item: Any, number: int | None = None) -> Any:
        """torch's iterator produced ``item`` for the caller (``number``: which of the pass's index
        lists it was made from, when they may arrive out of order): move the position; return the
        batch (or ``SKIP``)."""

    def end(self, pass_: Any) -> None:
        """torch's iterator of ``pass_`` is exhausted: the next pass is the next epoch."""

    def progress(self) -> tuple[int, int | None]:
        """The pass in flight on this rank: batches delivered in its epoch, and the epoch's batches
        (None for a stream, which has no length); for the log line about a state that continues a
        pass."""

    def state(self, batches_ago: int = 0, pass_ended: bool = False) -> dict[str, Any]:
        """The state's position fields (``epoch``, ``position``, ``ahead``, ``sampler_state``,
        ``dataset_state``, ``stream``), as a value: the loader lays them over its identity fields,
        and those not returned keep the identity's zeroed values. A pass in flight is described
        where it continues, whether or not its iterator still exists; ``pass_ended``: where the
        next pass starts instead (a loop that leaves the pass on purpose)."""

    def batches_per_epoch(self) -> int:
        """This rank's batches in a whole epoch (TypeError for a stream: it has no length to
        compute)."""

    def dataset_len(self) -> int | None:
        """The dataset length the state records (None for a stream)."""

    def __iter__(self) -> Iterator[Any]:
        """The index lists of the current pass: what torch's iterator draws from
        (``_index_sampler``)."""


class PassIterator(Generic[T]):
    """What ``iter(loader)`` returns: torch's iterator, each item recorded by the position as it is
    handed over (or skipped).

    ``caller`` (a keyed stream, ``num_workers=0``): the caller's generators are saved before torch's
    iterator reads the next batch (seeded with its key where the stream is read) and restored once
    after the whole fetch and collate, so model code (dropout) sees its own sequence undisturbed
    (map-style batches do this at the fetch: ``keyed_fetch.KeyedFetch``). torch's iterator stays
    reachable (``_workers``), as DataLoader code and tests read it.
    """

    __slots__ = ("__weakref__", "_caller", "_inner", "_numbered", "_pass", "_position")

    def __init__(
        self, position: Position, pass_: Any, inner: Iterator[Any], caller: CallerRng | None
    ) -> None:
        self._position, self._pass, self._inner, self._caller = position, pass_, inner, caller
        self._numbered = (
            position.kind == "map"
            and not position.setup.in_order
            and position.setup.num_workers > 0
        )

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __iter__(self) -> PassIterator[T]:
        return self

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __next__(self) -> T:
        caller, position, pass_ = self._caller, self._position, self._pass
        if caller is not None:
            caller.save()
        try:
            if self._numbered:
                number, batch = next_numbered(self._inner)
                batch = position.deliver(pass_, batch, number)
            else:
                batch = position.deliver(pass_, next_batch(self._inner))
            while batch is SKIP:
                batch = position.deliver(pass_, next_batch(self._inner))
        except StopIteration:
            position.end(pass_)
            raise
        finally:
            if caller is not None:
                caller.restore()
        return batch  # type: ignore[no-any-return]

    @property
    def mid_epoch(self) -> bool:
        """Whether this iterator's pass is still going on.

        NOTE: no ``__del__``: a pass left early (``break``, an exception) stays the pass in flight
        whether or not this iterator still exists, so a state never depends on the garbage
        collector; only the next ``iter()`` (or a loop that says ``pass_ended=True``) moves past
        it."""
        return not self._pass.done


def tell_epoch(dataset: Any, epoch: int) -> bool:
    """Call ``dataset.set_epoch(epoch)`` if it has one (as ``DistributedSampler``'s users do);
    whether it had."""
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
        return True
    return False
