"""The files ``ResumableTrainer`` adds to a Trainer ``checkpoint-N``, and what they say about Trainer's step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loader_resume.checkpoint import CHECKPOINT_FORMAT, CheckpointError

__all__ = ["LOADER_STATE_FILE", "RNG_STATE_FILE", "TRAINER_STATE", "agreed_checkpoint", "load_state_file",
           "missing_file", "step_at"]

LOADER_STATE_FILE = "loader_resume_{rank}.pt"
"""Each rank's training-loader state inside a Trainer ``checkpoint-N`` (beside ``rng_state_<rank>.pth``)."""
TRAINER_STATE = "trainer_state.json"
RNG_STATE_FILE = "rng_state_{rank}.pth"
"""Trainer's own RNG state of each rank (``rng_state.pth`` on one process)."""


def step_at(state: dict[str, Any], *, world_size: int, batch_size: int, accumulation: int, steps_per_epoch: int,
            checkpoint: Path) -> int:
    """Trainer's ``global_step`` at ``world_size`` for the position of the map-style loader ``state``: completed
    epochs * ``steps_per_epoch`` + the optimizer steps (``world_size`` * ``batch_size`` * ``accumulation``
    samples each) into the epoch. A position between two of those steps is refused."""
    epoch, position = state["epoch"], state["position"]
    per_step = world_size * batch_size * accumulation
    if position % per_step:
        raise CheckpointError(
            f"{checkpoint}: sample {position} of epoch {epoch} is not an optimizer-step boundary on {world_size} "
            f"process(es) (steps of {world_size} * batch {batch_size} * accumulation {accumulation} = {per_step} "
            "samples); expected a number of processes whose steps end there (e.g. the saving run's)")
    return int(epoch * steps_per_epoch + position // per_step)


def missing_file(checkpoint: Path) -> Path | None:
    """The first file a complete checkpoint must have and ``checkpoint`` lacks (``None``: complete): every rank's
    loader state, every rank's RNG state as Trainer names it (unless saved with ``save_only_model``), and
    ``trainer_state.json``."""
    first = checkpoint / LOADER_STATE_FILE.format(rank=0)
    if not first.is_file():
        return first
    saved = load_state_file(first)
    world = saved["world_size"]
    needed = [checkpoint / LOADER_STATE_FILE.format(rank=r) for r in range(1, world)]
    if saved.get("rng_files", True):  # NOTE: absent in files written before it was recorded (Trainer's default)
        needed += [checkpoint / RNG_STATE_FILE.format(rank=r) for r in range(world)] if world > 1 else \
            [checkpoint / "rng_state.pth"]
    for path in [*needed, checkpoint / TRAINER_STATE]:
        if not path.is_file():
            return path
    return None


def load_state_file(path: Path) -> dict[str, Any]:
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable ({error}); expected a loader state written by ResumableTrainer") \
            from None
    found = saved.get("format") if isinstance(saved, dict) else None
    if found != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: format {found!r}; expected {CHECKPOINT_FORMAT}")
    absent = [key for key in ("world_size", "rank", "global_step", "loader") if key not in saved]
    if absent:
        raise CheckpointError(f"{path}: {', '.join(absent)} missing; expected a loader state written by "
                              "ResumableTrainer")
    return saved  # type: ignore[no-any-return]


def agreed_checkpoint(found: str | None) -> str | None:
    """``found`` (this rank's newest complete checkpoint, or None), checked to be every rank's choice under
    ``torch.distributed`` (a collective): ranks that see different checkpoints (no shared ``output_dir``, a
    lagging network file system) would resume different steps, or one from the beginning, and drift apart."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return found
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, None if found is None else Path(found).name)
    if len(set(every)) > 1:
        seen = ", ".join(f"rank {rank}: {name or 'none'}" for rank, name in enumerate(every))
        raise CheckpointError(f"the ranks found different newest complete checkpoints ({seen}); expected the same "
                              "one on every rank (an output_dir every rank sees alike)")
    return found
