"""The global order of an epoch, cut into per-rank batches.

One epoch is one global order of *units* (sample indices, or whole batches when the user brings a
batch sampler). The only state is how many units the whole job has consumed (``position``). Each
global step takes ``world * batch`` units; rank ``r`` takes the ``r``-th slice of ``batch`` units.
So a resume with another world size or batch size simply continues the order at ``position``.

Tail of an epoch (fewer than ``world * batch`` units left):
- ``drop_last=True``: those units are dropped (a fresh permutation each epoch drops different ones);
- otherwise they are spread evenly, ``ceil(left / world)`` per rank, and ranks short of units are
  padded — with the first units of the epoch (permutation) or by cycling the tail (user samplers) —
  so every rank yields the same number of batches, as ``DistributedSampler`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple, TypeVar

import numpy as np
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from loader_resume.keyed.keyed_rng import derive_key
from loader_resume.order.permutation import KeyedPermutation
from loader_resume.workers.torch_internals import random_sampler_num_samples

__all__ = [
    "ShardedSampler",
    "Shard",
    "Order",
    "Step",
    "classify_order",
    "default_seed",
    "loader_seed",
    "permutation_steps",
    "sampler_steps",
    "steps_per_epoch",
    "torch_order",
]

U = TypeVar("U")
# units computed by a pass's first vectorised permutation call (a resume's first batch)
_FIRST_CHUNK_UNITS = 1024
# chunks double up to this: the walk's per-call cost spread over ~1000 batches
_MAX_CHUNK_UNITS = 1 << 16


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's view of the global order."""

    rank: int
    world: int
    batch: int
    """Units per rank per global step."""
    drop_last: bool

    @property
    def step(self) -> int:
        return self.world * self.batch


Step = tuple[list[Any], int, int, bool, Any]
"""One global step, as this rank sees it: ``(units, key_position, end, last, sampler_state)`` — this
rank's units (indices, or index lists for a batch sampler); the global position of its first unit
(what keys the batch's randomness); the epoch position after the whole global step (every rank's
units); whether it is the epoch's last step; a user sampler's state after the step (``None`` for our
own orders). A plain tuple: one is made per batch."""


def steps_per_epoch(total: int, shard: Shard) -> int:
    """Batches a rank yields in a whole epoch of ``total`` units."""
    full, left = divmod(total, shard.step)
    return full + (1 if left and not shard.drop_last else 0)


def permutation_steps(
    perm: KeyedPermutation | None, n: int, start: int, shard: Shard
) -> Iterator[Step]:
    """Steps of a map-style epoch from ``start``; ``perm`` None means the identity order."""
    step, batch = shard.step, shard.batch
    full_end = start + (n - start) // step * step
    ends_clean = full_end == n or shard.drop_last
    offsets = np.arange(batch, dtype=np.int64) + shard.rank * batch
    position, chunk = start, _FIRST_CHUNK_UNITS
    while position < full_end:
        count = min(max(1, chunk // batch), (full_end - position) // step)
        chunk = min(2 * chunk, _MAX_CHUNK_UNITS)
        starts = position + np.arange(count, dtype=np.int64) * step
        positions = starts[:, None] + offsets[None, :]
        rows = (positions if perm is None else perm[positions]).tolist()
        for row, first in zip(rows, starts.tolist(), strict=True):
            end = first + step
            yield row, first + shard.rank * batch, end, end == full_end and ends_clean, None
        position += count * step
    left = n - position
    if left > 0 and not shard.drop_last:
        share = -(-left // shard.world)
        first = position + shard.rank * share
        positions = (first + np.arange(share, dtype=np.int64)) % n
        rows = positions if perm is None else perm[positions]
        yield rows.tolist(), first, n, True, None


def sampler_steps(
    units: Iterator[U], start: int, shard: Shard, snapshot: Callable[[], Any] | None
) -> Iterator[Step]:
    """Steps drawn from a user's sampler or batch sampler, already positioned at ``start``.

    Reads one step ahead so the last step of an epoch is known when it is yielded. ``snapshot``
    (a stateful sampler's ``state_dict``) is taken right after each step's units are drawn.
    """
    step, batch, rank = shard.step, shard.batch, shard.rank

    def take() -> tuple[list[U], Any]:
        chunk = list(islice(units, step))
        return chunk, (snapshot() if snapshot is not None else None)

    current, state = take()
    position = start
    while len(current) == step:
        following, following_state = take()
        last = not following or (shard.drop_last and len(following) < step)
        # NOTE: at the last step the look-ahead has exhausted the sampler, which is when samplers
        # run their end-of-epoch code (e.g. reset a counter); the state after that is the true
        # boundary state.
        mine = current[rank * batch : (rank + 1) * batch]
        yield (
            mine,
            position + rank * batch,
            position + step,
            last,
            following_state if last else state,
        )
        position += step
        current, state = ([], None) if last else (following, following_state)
    if current and not shard.drop_last:
        share = -(-len(current) // shard.world)
        mine = [current[(rank * share + i) % len(current)] for i in range(share)]
        yield mine, position + rank * share, position + len(current), True, state


def torch_order(sampler: Any, dataset: Any) -> bool | None:
    """The ``shuffle`` of DataLoader's own order if ``sampler`` is one over exactly ``dataset`` (it
    then becomes our keyed permutation), else None: a custom order, kept as it is.

    NOTE: only a ``SequentialSampler``/``RandomSampler`` without replacement or ``num_samples``
    whose data source has the dataset's length: ``SequentialSampler(range(5))`` over 10 items is
    custom.
    """
    if (
        type(sampler) not in (RandomSampler, SequentialSampler)
        or getattr(sampler, "data_source", None) is None
    ):
        return None
    if len(sampler) != len(dataset):
        return None
    if type(sampler) is SequentialSampler:
        return False
    return None if sampler.replacement or random_sampler_num_samples(sampler) is not None else True


class Order(NamedTuple):
    """What orders a map-style dataset's units: the user's (batch) sampler, or our keyed
    permutation."""

    sampler: Any
    """The user's sampler or batch sampler, or None for our keyed permutation of
    ``range(len(dataset))``."""
    name: str
    """How the state names it (``"permutation"``, ``"sampler:<class>"``,
    ``"batch_sampler:<class>"``)."""
    shuffle: bool
    """Our permutation shuffles (else it is ``range(n)`` in order)."""
    unit_is_batch: bool = False
    """The units are whole index lists (a batch sampler)."""


class ShardedSampler(DistributedSampler):  # type: ignore[type-arg]
    """Marks a custom sampler as "shard me across ranks" for
    [`ResumableDataLoader`][loader_resume.ResumableDataLoader].

    The loader takes the wrapped sampler's order and gives each rank its slice of every global step
    (the same rules as for shuffled data), saving the wrapped sampler's state if it has one. It is a
    ``DistributedSampler`` so that frameworks which inject one into unsharded loaders (Lightning
    does, wrapping custom samplers in an unsaved, reshuffling ``DistributedSamplerWrapper``) leave
    it alone. Iterated directly (not through the loader), it yields every ``num_replicas``-th index
    from ``rank``.
    """

    def __init__(self, sampler: Any, dataset: Any, *, num_replicas: int, rank: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False
        )
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.sampler), self.rank, None, self.num_replicas)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def default_seed(generator: Any, sampler: Any) -> int:
    """``seed=None``: the seed of the generator (or DistributedSampler) that would have shuffled,
    else 0."""
    if type(sampler) is DistributedSampler:
        return int(sampler.seed)
    if generator is None and type(sampler) is RandomSampler:
        generator = sampler.generator
    return int(generator.initial_seed()) if generator is not None else 0


def loader_seed(seed: int, index: int) -> int:
    """The seed a front-end (``ResumeCallback``, ``FabricResume``, ``enable_resume``) gives the
    ``index``-th loader of a job it converts: ``seed`` itself for the first, for each other a 31-bit
    seed derived from ``(seed, index)``. Loaders of one job thus never share a shuffle order or
    keyed random values, as plain ``DataLoader``s, each seeded from the global generator, never do;
    what decides a loader's seed is its place in the order the job hands its loaders over, which a
    resumed job repeats."""
    return seed if index == 0 else derive_key(seed, "loader", index) & 0x7FFF_FFFF


def classify_order(dataset: Any, sampler: Any, batch_sampler: Any, shuffle: bool | None) -> Order:
    """What orders a map-style ``dataset``'s units, given DataLoader's arguments."""
    if batch_sampler is not None:
        return Order(
            batch_sampler, f"batch_sampler:{_qualname(batch_sampler)}", False, unit_is_batch=True
        )
    if type(sampler) is ShardedSampler:
        return Order(sampler.sampler, f"sampler:{_qualname(sampler.sampler)}", False)
    if sampler is None:
        return Order(None, "permutation", bool(shuffle))
    ordered = torch_order(sampler, dataset)
    if ordered is not None:
        return Order(None, "permutation", ordered)
    if type(sampler) is DistributedSampler:
        return Order(None, "permutation", bool(sampler.shuffle))
    return Order(sampler, f"sampler:{_qualname(sampler)}", False)


def _qualname(obj: Iterable[Any]) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
