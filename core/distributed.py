"""Rank and world-size discovery: explicit arguments win, then ``torch.distributed``, then (0, 1)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank_and_world"]


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The ``(rank, world_size)`` a loader shards for; raises ValueError on an impossible pair."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: expected world_size >= 1 and 0 <= rank < world_size")
    return rank, world_size
