"""Planning one pass over a map-style dataset: its index lists, each keyed, from a plan and a
position.

``plan_indices`` is a function of ``(plan, epoch, start, sampler state)``: it reads nothing else and
writes nothing back (only a user's own sampler, which it iterates, changes). The map-style position
(``loader_resume.order.map_position``) records what each list will move the position to once
delivered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any

from loader_resume.keyed.keyed_fetch import NextFetch
from loader_resume.keyed.keyed_rng import (
    GENERATORS,
    CallerRng,
    KeysUnder,
    derive_key,
    generator_mask,
    seed_generators,
)
from loader_resume.keyed.worker_fetch import KeySpec, keyed_indices
from loader_resume.order.permutation import KeyedPermutation
from loader_resume.order.sampler import Shard, Step, permutation_steps, sampler_steps
from loader_resume.thirdparty import is_stateful

__all__ = ["Pending", "Plan", "plan_indices"]

logger = logging.getLogger(__name__)
_ALL_GENERATORS = generator_mask(GENERATORS)


Pending = tuple[int, bool, Any]
"""A step handed to torch and not yet delivered: where the position goes once it is — ``(end, last,
sampler_state)`` (a plain tuple: one is made per batch)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a pass's index lists depend on besides its epoch and start."""

    sampler: Any
    """The user's sampler or batch sampler, or None for our keyed permutation of ``range(n)``."""
    n: int | None
    shard: Shard
    seed: int
    shuffle: bool
    keying: str
    mask: int
    unit_is_batch: bool
    workers: int = 0
    """``num_workers`` when workers seed ahead, else 0: a worker's next batch is most likely
    ``workers`` steps later."""
    next_fetch: NextFetch | None = None
    """Per-batch keying in this process (``num_workers=0``): each list's key parts are recorded here
    as it is handed out, for the fetch (``keyed_fetch.KeyedFetch``), instead of a key carried by the
    list."""
    resolve: Callable[[int, list[int]], list[Any]] | None = None
    """A ``Mixture``'s ``resolve``: each list's positions of the epoch become the keys
    the dataset is read with, as the list is handed out."""


def plan_indices(
    plan: Plan, epoch: int, start: int, sampler_state: Any = None
) -> Iterator[tuple[list[int], Pending]]:
    """The index lists of ``epoch`` from global position ``start``, each with where it moves the
    position.

    ``sampler_state``: a user sampler's saved state, loaded into it before it is iterated (else the
    sampler is replayed up to ``start``).

    NOTE: a generator, so nothing runs until the first ``next()``: torch's multi-process iterator
    calls ``iter(index_sampler)`` twice (base ``__init__``, then ``_reset``) and drops the first; a
    user sampler must not be advanced, nor its loaded state used, by the dropped one.
    """
    # derive_key(batch_base, position)
    batch_keys = KeysUnder(derive_key(plan.seed, epoch, "batch"))
    sample_base = derive_key(plan.seed, epoch, "sample") if plan.keying == "sample" else None
    off = plan.keying == "off"
    # key position -> key, derived when it was sent ahead (seeding ahead)
    ahead_keys: dict[int, int] = {}
    for units, key_position, end, last, state in _steps(plan, epoch, start, sampler_state):
        pending = (end, last, state)
        indices = units[0] if plan.unit_is_batch else units
        if plan.resolve is not None:
            indices = plan.resolve(epoch, indices)
        if off:
            yield indices, pending
            continue
        if plan.next_fetch is not None and sample_base is None:
            plan.next_fetch.record(indices, batch_keys, key_position, plan.mask)
            yield indices, pending
            continue
        key = (
            ahead_keys.pop(key_position) if key_position in ahead_keys else batch_keys(key_position)
        )
        ahead = None
        if plan.workers and sample_base is None:
            ahead_position = key_position + plan.workers * plan.shard.step
            ahead = ahead_keys[ahead_position] = batch_keys(ahead_position)
        yield keyed_indices(indices, KeySpec(key, sample_base, plan.mask), ahead), pending


def _steps(plan: Plan, epoch: int, start: int, sampler_state: Any) -> Iterator[Step]:
    if plan.sampler is None:
        assert plan.n is not None  # our permutation is only planned for sized datasets
        key = derive_key(plan.seed, epoch, "perm")
        perm = KeyedPermutation(plan.n, key) if plan.shuffle else None
        return permutation_steps(perm, plan.n, start, plan.shard)
    snapshot = plan.sampler.state_dict if is_stateful(plan.sampler) else None
    return sampler_steps(
        _sampler_units(plan, epoch, start, sampler_state), start, plan.shard, snapshot
    )


def _sampler_units(plan: Plan, epoch: int, start: int, sampler_state: Any) -> Iterator[Any]:
    """The user's sampler positioned at ``start``: by its own loaded state, else by replay."""
    sampler = plan.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    skip = start if sampler_state is None else 0
    if skip:
        logger.warning(
            "%s has no state_dict(): replaying %d of its indices to resume (no data is loaded); "
            "give it state_dict()/load_state_dict() to resume in O(1)",
            type(sampler).__name__,
            skip,
        )
    # NOTE: a sampler that draws its seed from the global RNG when iteration starts (torch's
    # RandomSampler without a generator does) is given a keyed seed, so a replay is exact.
    caller = CallerRng(_ALL_GENERATORS).save() if plan.keying != "off" else None
    try:
        if caller is not None:
            seed_generators(derive_key(plan.seed, epoch, "sampler"), _ALL_GENERATORS)
        units = iter(sampler)
        head = list(islice(units, skip, skip + 1))
    finally:
        if caller is not None:
            caller.restore()
    return chain(head, units)
