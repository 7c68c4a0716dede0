"""The files ``RayResume`` writes into a Ray Train checkpoint, and reads back.

Every rank writes ``loader_resume_rank_R.pt`` (its loaders' states, its generators, the step and
epoch, the world size); rank 0 also writes ``model.pt``, ``optimizer.pt`` and ``scheduler.pt`` for
the objects it was given. Ray merges the ranks' directories into one checkpoint, so a restored
checkpoint holds one rank file per rank of the run that wrote it: a missing one is named in the
error, never replaced by a fresh start.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.checkpoint_entry import checked_entry

__all__ = ["RANK_FILE", "read_ranks", "rank_file", "unwrapped"]

RANK_FILE = "loader_resume_rank_{rank}.pt"
"""Each worker's file inside a checkpoint reported to Ray: its loader states and generators, by
rank."""

NEEDS = ("rank", "world_size", "step", "epoch", "loaders", "rng")
"""The keys of a rank file (beside ``"format"``)."""


def rank_file(directory: Path, rank: int) -> Path:
    return directory / RANK_FILE.format(rank=rank)


def read_ranks(directory: Path) -> list[dict[str, Any]]:
    """Every rank's file of the checkpoint in ``directory``, in rank order; ``CheckpointError``
    naming what is missing (a rank's file, a checkpoint not written by ``RayResume``) or of another
    format."""
    found = sorted(int(match.group(1)) for path in directory.iterdir()
                   if (match := re.fullmatch(r"loader_resume_rank_(\d+)\.pt", path.name)))
    if not found:
        raise CheckpointError(
            f"{directory}: no {RANK_FILE.format(rank='R')} in this checkpoint; expected one per "
            "rank (a checkpoint reported by RayResume.report)"
        )
    first = checked_entry(
        torch.load(rank_file(directory, found[0]), weights_only=True),
        rank_file(directory, found[0]),
        needs=NEEDS,
    )
    world = first["world_size"]
    missing = [rank_file(directory, rank).name for rank in range(world) if rank not in found]
    if missing:
        raise CheckpointError(
            f"{directory}: {', '.join(missing)} missing; the run that wrote it had {world} "
            "ranks and every rank reports its own file (was a rank's upload lost?)"
        )
    ranks = [
        first if rank == found[0] else torch.load(rank_file(directory, rank), weights_only=True)
        for rank in range(world)
    ]
    # NOTE: the entry's format first (checked_entry), then its place
    for rank, state in enumerate(ranks):
        checked_entry(state, rank_file(directory, rank), needs=NEEDS)
        if state["rank"] != rank or state["world_size"] != world:
            raise CheckpointError(
                f"{rank_file(directory, rank)}: rank {state['rank']!r} of {state['world_size']!r}; "
                f"expected rank {rank} of {world}"
            )
    return ranks


def unwrapped(model: Any) -> Any:
    """The module inside a ``DistributedDataParallel`` (``ray.train.torch.prepare_model``'s
    wrapper), so a checkpoint loads into a model built without it."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
