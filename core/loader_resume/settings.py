"""A loader's own settings, checked and fixed in one place when it is built (``Setup``):
the order, the random keys and the state all read them from there."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from loader_resume.audit.log import audit_log
from loader_resume.distributed import rank_and_world
from loader_resume.keyed.keyed_rng import KEYING_MODES, generator_mask
from loader_resume.order.map_position import MapPosition
from loader_resume.order.sampler import Order, ShardedSampler, classify_order
from loader_resume.position import Position, Setup
from loader_resume.streams.stream_position import StreamPosition
from loader_resume.workers.torch_internals import caps_worker_tasks
from loader_resume.workers.worker_transport import MAX_BY_VALUE_BYTES

__all__ = ["positioned", "settings"]


def settings(
    dataset: Any,
    *,
    seed: int,
    keying: str,
    keyed_generators: Sequence[str],
    snapshot_every_n_steps: int | None,
    sampler: Any,
    batch_size: int | None,
    unbatched: bool,
    drop_last: bool,
    num_workers: int,
    persistent_workers: bool,
    rank: int | None,
    world_size: int | None,
    in_order: bool,
    by_value_bytes: int,
) -> Setup:
    """The ``Setup`` of a loader built with these arguments; ``ValueError`` naming a bad one."""
    if snapshot_every_n_steps is not None and (
        type(snapshot_every_n_steps) is not int or snapshot_every_n_steps < 0
    ):
        raise ValueError(
            f"snapshot_every_n_steps={snapshot_every_n_steps!r}: expected None or an int >= 0 "
            "(as StatefulDataLoader; the state is exact at every step whatever the value)"
        )
    if type(by_value_bytes) is not int or not 0 <= by_value_bytes <= MAX_BY_VALUE_BYTES:
        raise ValueError(
            f"by_value_bytes={by_value_bytes!r}: expected an int from 0 (every tensor through "
            f"shared memory, as DataLoader) to {MAX_BY_VALUE_BYTES}"
        )
    if keying not in KEYING_MODES:
        raise ValueError(f"keying={keying!r}: expected one of {list(KEYING_MODES)}")
    # NOTE: torch 2.6 has in_order=False, without the cap it needs
    if not in_order and not caps_worker_tasks():
        raise ValueError(
            f"in_order=False needs torch >= 2.7: torch {torch.__version__}'s DataLoader hands "
            "index lists to its workers in turn however many each holds, so the batches after a "
            "slow one pile up behind it and wait (upgrade torch, or build the loader with "
            "in_order=True)"
        )
    shard_drop_last = None
    if type(sampler) in (DistributedSampler, ShardedSampler):
        # NOTE: a DistributedSampler (the user's, or the one Lightning injects by rebuilding the
        # loader) becomes our sharded permutation with its rank, world size and drop_last, so it
        # is never applied on top of our own sharding; a ShardedSampler's custom order likewise.
        rank = sampler.rank if rank is None else rank
        world_size = sampler.num_replicas if world_size is None else world_size
        shard_drop_last = sampler.drop_last or drop_last
    rank_and_world(rank, world_size)  # fail at construction on an impossible explicit pair
    return Setup(
        dataset=dataset, seed=seed, keying=keying, generators=tuple(keyed_generators),
        mask=generator_mask(keyed_generators), batch_size=batch_size, unbatched=unbatched,
        drop_last=drop_last, num_workers=num_workers, persistent_workers=persistent_workers,
        rank=rank, world_size=world_size, shard_drop_last=shard_drop_last, in_order=in_order,
        by_value_bytes=by_value_bytes,
    )


def positioned(
    setup: Setup,
    map_style: bool,
    sampler: Any,
    batch_sampler: Any,
    shuffle: bool | None,
    audit: str | os.PathLike[str] | None,
) -> tuple[Order, Position]:
    """What orders a loader's data and where it stands: a ``MapPosition`` (``map_style``) or a
    ``StreamPosition``, with the ``AuditLog`` of ``audit=DIR`` in its setup (the log only records:
    nothing delivered depends on it)."""
    if map_style:
        order = classify_order(setup.dataset, sampler, batch_sampler, shuffle)
        position: Position = MapPosition(setup, order)
    else:
        order, position = Order(None, "iterable", False), StreamPosition(setup)
    if audit is not None:
        position.setup = audit_log(
            audit, setup, position.dataset_len(), order.name, order.shuffle, setup.num_workers
        )
    return order, position
