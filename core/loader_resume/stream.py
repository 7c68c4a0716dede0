"""Producing one pass of index lists: what torch's iterator draws from, and what it has not delivered.

Kept apart from the loader on purpose: nothing here refers back to the loader. A persistent-workers
iterator is held by its loader, so a producer that held the loader would make a reference cycle; the
garbage collector then finalises the worker queues before the iterator and every shutdown waits out
torch's 5 s join timeout per worker.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, NamedTuple

from .keyed_rng import GENERATORS, CallerRng, derive_key, generator_mask, keyed_indices, seed_generators
from .permutation import KeyedPermutation
from .sampler import Shard, Step, permutation_steps, source_steps
from .thirdparty import unrestorable

__all__ = ["Pass", "Pending", "Plan", "foreign_state_dict", "index_lists", "is_stateful"]

logger = logging.getLogger(__name__)
_ALL_GENERATORS = generator_mask(GENERATORS)


class Pending(NamedTuple):
    """A step handed to torch and not yet delivered: where the position goes once it is."""

    end: int
    last: bool
    sampler_state: Any


class Pass:
    """One ``iter()`` of a loader: where it starts, and the steps produced but not yet delivered."""

    __slots__ = ("done", "epoch", "pending", "sampler_state_to_load", "start")

    def __init__(self, epoch: int, start: int, sampler_state_to_load: Any = None) -> None:
        self.epoch, self.start, self.done = epoch, start, False
        self.sampler_state_to_load = sampler_state_to_load
        self.pending: deque[Pending] = deque()


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a pass needs from its loader, copied so the producer does not hold the loader."""

    source: Any
    """The user's sampler or batch sampler, or None for our keyed permutation of ``range(n)``."""
    n: int | None
    shard: Shard
    seed: int
    shuffle: bool
    keying: str
    mask: int
    unit_is_batch: bool
    workers: int = 0
    """``num_workers`` when workers seed ahead, else 0: a worker's next batch is most likely ``workers`` steps later."""
    fetch_here: bool = False
    """The batches are fetched in this process (``num_workers=0``): seed each batch's key as its list is
    handed out, since torch's single-process iterator fetches right after drawing it (the loader restores
    the caller's generators once the fetch is done)."""


def index_lists(plan: Plan, pass_: Pass) -> Iterator[list[int]]:
    """Index lists of one pass; records each step in ``pass_.pending`` as it is produced.

    NOTE: a generator, so nothing runs until the first ``next()``: torch's multi-process iterator
    calls ``iter(index_sampler)`` twice (base ``__init__``, then ``_reset``) and drops the first; a user
    sampler must not be advanced, nor a loaded sampler state used up, by the dropped one.
    """
    batch_base = derive_key(plan.seed, pass_.epoch, "batch")
    sample_base = derive_key(plan.seed, pass_.epoch, "sample") if plan.keying == "sample" else None
    off = plan.keying == "off"
    ahead_keys: dict[int, int] = {}  # key position -> key, derived when it was sent ahead (seeding ahead)
    for units, key_position, end, last, sampler_state in _steps(plan, pass_):
        pass_.pending.append(Pending(end, last, sampler_state))
        indices = units[0] if plan.unit_is_batch else units
        if off:
            yield indices
            continue
        key = ahead_keys.pop(key_position) if key_position in ahead_keys else derive_key(batch_base, key_position)
        ahead = None
        if plan.workers and sample_base is None:
            ahead_position = key_position + plan.workers * plan.shard.step
            ahead = ahead_keys[ahead_position] = derive_key(batch_base, ahead_position)
        if plan.fetch_here:
            seed_generators(key, plan.mask)
        yield keyed_indices(indices, (key, sample_base, plan.mask), ahead)


def is_stateful(owner: Any) -> bool:
    """Whether ``owner`` implements the Stateful protocol: ``state_dict()`` and ``load_state_dict(state)``.

    A ``state_dict`` that requires arguments (litdata's ``StreamingDataset.state_dict(num_samples_yielded,
    num_workers, batch_size)``, Mosaic's ``state_dict(num_samples, from_beginning)``) is another library's
    protocol, not this one: such an object is treated as stateless (see :func:`foreign_state_dict`), and so
    is one whose state is known not to restore it exactly (:func:`loader_resume.thirdparty.unrestorable`).
    """
    state_dict, load = getattr(owner, "state_dict", None), getattr(owner, "load_state_dict", None)
    if not (callable(state_dict) and callable(load)):
        return False
    return foreign_state_dict(owner) is None and unrestorable(owner) is None


_FOREIGN: dict[Any, str | None] = {}


def foreign_state_dict(owner: Any) -> str | None:
    """The signature of ``owner.state_dict`` when it requires arguments (another library's protocol), else None."""
    state_dict = getattr(owner, "state_dict", None)
    function = getattr(state_dict, "__func__", state_dict)
    try:
        return _FOREIGN[function]
    except (KeyError, TypeError):
        pass
    try:
        signature = inspect.signature(state_dict)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: take it at its word
        found = None
    else:
        required = [p for p in signature.parameters.values() if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        found = f"state_dict({', '.join(p.name for p in required)})" if required else None
    with contextlib.suppress(TypeError):
        _FOREIGN[function] = found
    return found


def _steps(plan: Plan, pass_: Pass) -> Iterator[Step]:
    if plan.source is None:
        assert plan.n is not None  # a permutation source is only planned for sized datasets
        key = derive_key(plan.seed, pass_.epoch, "perm")
        perm = KeyedPermutation(plan.n, key) if plan.shuffle else None
        return permutation_steps(perm, plan.n, pass_.start, plan.shard)
    snapshot = plan.source.state_dict if is_stateful(plan.source) else None
    return source_steps(_source_units(plan, pass_), pass_.start, plan.shard, snapshot)


def _source_units(plan: Plan, pass_: Pass) -> Iterator[Any]:
    """The user's sampler positioned at ``pass_.start``: by its own loaded state, else by replay."""
    source = plan.source
    if hasattr(source, "set_epoch"):
        source.set_epoch(pass_.epoch)
    to_load, pass_.sampler_state_to_load = pass_.sampler_state_to_load, None
    if to_load is not None:
        source.load_state_dict(to_load)
    skip = pass_.start if to_load is None else 0
    if skip:
        logger.warning(
            "%s has no state_dict(): replaying %d of its indices to resume (no data is loaded); "
            "give it state_dict()/load_state_dict() to resume in O(1)", type(source).__name__, skip,
        )
    # NOTE: a sampler that draws its seed from the global RNG when iteration starts (torch's
    # RandomSampler without a generator does) is given a keyed seed, so a replay is exact.
    caller = CallerRng(_ALL_GENERATORS).save() if plan.keying != "off" else None
    try:
        if caller is not None:
            seed_generators(derive_key(plan.seed, pass_.epoch, "sampler"), _ALL_GENERATORS)
        units = iter(source)
        head = list(islice(units, skip, skip + 1))
    finally:
        if caller is not None:
            caller.restore()
    return chain(head, units)
