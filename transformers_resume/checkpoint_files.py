"""The files ``ResumableTrainer`` adds to a Trainer ``checkpoint-N``, what they say about Trainer's
step, and how a checkpoint is verified before it is resumed.

``verify_checkpoint``: complete (every file ``missing_file`` asks for) and intact, as far as its
files allow: each file ``torch.save`` wrote (``*.pt``, ``*.pth``, ``*.bin``) against the CRC-32
stored for each of its records, each safetensors file's structure (it stores no checksum: a flipped
bit inside a tensor is not seen), each JSON file parsed. On several ranks each rank reads its share
of the files, so the job reads each file once.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.checkpoint_entry import checked_entry
from loader_resume.job.torch_file import verify_safetensors, verify_torch_file

__all__ = [
    "LOADER_STATE_FILE",
    "RNG_STATE_FILE",
    "TRAINER_STATE",
    "agreed_checkpoint",
    "load_state_file",
    "missing_file",
    "newest_complete",
    "newest_resumable",
    "read_states",
    "step_at",
    "verify_named",
]

logger = logging.getLogger(__name__)

LOADER_STATE_FILE = "loader_resume_{rank}.pt"
"""Each rank's training-loader state inside a Trainer ``checkpoint-N`` (beside
``rng_state_<rank>.pth``)."""
TRAINER_STATE = "trainer_state.json"
RNG_STATE_FILE = "rng_state_{rank}.pth"
"""Trainer's own RNG state of each rank (``rng_state.pth`` on one process)."""


def step_at(
    state: dict[str, Any],
    *,
    world_size: int,
    batch_size: int,
    accumulation: int,
    steps_per_epoch: int,
    checkpoint: Path,
) -> int:
    """Trainer's ``global_step`` at ``world_size`` for the position of the map-style loader
    ``state``: completed epochs * ``steps_per_epoch`` + the optimizer steps (``world_size`` *
    ``batch_size`` * ``accumulation`` samples each) into the epoch. A position between two of those
    steps is refused."""
    epoch, position = state["epoch"], state["position"]
    per_step = world_size * batch_size * accumulation
    if position % per_step:
        raise CheckpointError(
            f"{checkpoint}: sample {position} of epoch {epoch} is not an optimizer-step boundary "
            f"on {world_size} process(es) (steps of {world_size} * batch {batch_size} * "
            f"accumulation {accumulation} = {per_step} samples); expected a number of processes "
            "whose steps end there (e.g. the saving run's)"
        )
    return int(epoch * steps_per_epoch + position // per_step)


def missing_file(checkpoint: Path) -> Path | None:
    """The first file a complete checkpoint must have and ``checkpoint`` lacks (``None``: complete):
    every rank's loader state, every rank's RNG state as Trainer names it (unless saved with
    ``save_only_model``), and ``trainer_state.json``."""
    first = checkpoint / LOADER_STATE_FILE.format(rank=0)
    if not first.is_file():
        return first
    saved = load_state_file(first)
    world = saved["world_size"]
    needed = [checkpoint / LOADER_STATE_FILE.format(rank=r) for r in range(1, world)]
    # NOTE: absent in files written before it was recorded (Trainer's default)
    if saved.get("rng_files", True):
        needed += (
            [checkpoint / RNG_STATE_FILE.format(rank=r) for r in range(world)]
            if world > 1
            else [checkpoint / "rng_state.pth"]
        )
    for path in [*needed, checkpoint / TRAINER_STATE]:
        if not path.is_file():
            return path
    return None


def load_state_file(path: Path) -> dict[str, Any]:
    verify_torch_file(path)
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable ({error}); expected a loader state written "
                              "by ResumableTrainer") from None
    return checked_entry(saved, path, needs=("world_size", "rank", "global_step", "loader"))


def agreed_checkpoint(found: str | None) -> str | None:
    """``found`` (this rank's newest complete checkpoint, or None), checked to be every rank's
    choice under ``torch.distributed`` (a collective): ranks that see different checkpoints (no
    shared ``output_dir``, a lagging network file system) would resume different steps, or one from
    the beginning, and drift apart."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return found
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, None if found is None else Path(found).name)
    if len(set(every)) > 1:
        seen = ", ".join(f"rank {rank}: {name or 'none'}" for rank, name in enumerate(every))
        raise CheckpointError(
            f"the ranks found different newest complete checkpoints ({seen}); expected the same "
            "one on every rank (an output_dir every rank sees alike)"
        )
    return found


def _checkpoints_in(root: Path) -> list[Path]:
    """The ``checkpoint-N`` directories in ``root``, newest (highest ``N``) first."""
    found = [(int(match.group(1)), path) for path in (root.iterdir() if root.is_dir() else ())
             if (match := re.fullmatch(r"checkpoint-(\d+)", path.name)) and path.is_dir()]
    return [path for _, path in sorted(found, reverse=True)]


def _complete(root: Path, warn: bool) -> list[Path]:
    """The complete checkpoints in ``root`` (``missing_file``), newest first; others skipped
    (named)."""
    complete = []
    for path in _checkpoints_in(root):
        try:
            missing = missing_file(path)
        except CheckpointError as error:
            missing, reason = path, str(error)
        else:
            reason = f"{missing.name if missing else ''} is missing (killed while saving?)"
        if missing is None:
            complete.append(path)
        elif warn:
            logger.warning("skipping %s: %s", path, reason)
    return complete


def newest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint in ``root`` (its files there, none verified), or ``None``."""
    complete = _complete(root, warn=False)
    return complete[0] if complete else None


def newest_resumable(root: Path, *, rank: int = 0, world_size: int = 1,
                     agree: Callable[[bool], bool] | None = None) -> Path | None:
    """The newest complete checkpoint in ``root`` whose files verify (each rank its share;
    ``agree``: whether a flag holds on any rank, a collective), or ``None`` if there is none. A
    newer one that fails is skipped with a warning naming the file and why; ``CheckpointError`` if
    none verifies (never a silent start from scratch). With ``agree``, each candidate is checked to
    be every rank's (``agreed_checkpoint``); without it, this process alone decides."""
    complete, skipped = _complete(root, warn=True), None
    for index in range(len(complete) + 1):
        candidate = os.fspath(complete[index]) if index < len(complete) else None
        candidate = candidate if agree is None else agreed_checkpoint(candidate)
        if candidate is None:
            break
        failure = None
        try:
            _verify_files(Path(candidate), rank, world_size)
        except CheckpointError as error:
            failure = error
        if not (failure is not None if agree is None else agree(failure is not None)):
            if skipped is not None:
                logger.warning("resuming from %s, the newest checkpoint that verifies", candidate)
            return Path(candidate)
        reason = str(failure or "a file failed verification on another process (its log names it)")
        logger.warning("skipping %s: %s; trying the one before it", candidate, reason)
        skipped = skipped or reason
    if skipped is not None:
        raise CheckpointError(
            f"{skipped}; and no older checkpoint in {root} verifies either (expected at least one "
            "intact: move them away to start over)"
        )
    return None


def verify_named(
    checkpoint: Path, *, rank: int, world_size: int, agree: Callable[[bool], bool]
) -> None:
    """Raise ``CheckpointError`` on every rank unless ``checkpoint`` (named by the user) is complete
    and its files verify (each rank its share; ``agree`` as for ``newest_resumable``)."""
    failure = None
    try:
        missing = missing_file(checkpoint)
        if missing is not None:
            raise CheckpointError(
                f"{missing}: missing; expected a complete checkpoint written by ResumableTrainer "
                "(killed while saving, or saved by another Trainer?)"
            )
        _verify_files(checkpoint, rank, world_size)
    except CheckpointError as error:
        failure = error
    if agree(failure is not None):
        raise failure or CheckpointError(f"{checkpoint}: a file failed verification on another "
                                         "process (its log names it); refusing to load it")


def _verify_files(checkpoint: Path, rank: int, world_size: int) -> None:
    """This rank's share of ``checkpoint``'s files (every ``world_size``-th, from ``rank``),
    verified (see the module's description)."""
    files = sorted(path for path in checkpoint.rglob("*") if path.is_file())
    for path in files[rank::world_size]:
        if path.suffix in (".pt", ".pth", ".bin"):
            verify_torch_file(path)
        elif path.suffix == ".safetensors":
            verify_safetensors(path)
        elif path.suffix == ".json":
            try:
                json.loads(path.read_bytes())
            except (OSError, ValueError) as error:
                raise CheckpointError(
                    f"{os.fspath(path)}: unreadable ({type(error).__name__}: {error}; truncated?); "
                    "refusing to load it"
                ) from None


def read_states(checkpoint: Path, world_size: int, *, can_move: bool
                ) -> tuple[dict[str, Any], tuple[Path, int, dict[str, Any]] | None]:
    """Every saved rank's loader state, as ``gather_states`` returns them, and, when the checkpoint
    was written on another number of processes than ``world_size``, the change (the checkpoint, its
    world size, rank 0's state) for ``ResumableTrainer`` to move Trainer's step (refused for an
    iterable dataset's state, and unless ``can_move``: this Trainer can move its step)."""
    first = load_state_file(checkpoint / LOADER_STATE_FILE.format(rank=0))
    world = first["world_size"]
    ranks = [first] + [
        load_state_file(checkpoint / LOADER_STATE_FILE.format(rank=r)) for r in range(1, world)
    ]
    moved = None
    if world != world_size:
        state = first["loader"]
        if not isinstance(state, dict) or state.get("kind") != "map":
            raise CheckpointError(
                f"{checkpoint}: written by {world} process(es), resumed on {world_size}; an "
                "iterable dataset resumes under Trainer on the same number of processes only "
                "(Trainer's steps would not name the same samples)"
            )
        if not can_move:
            raise CheckpointError(
                f"{checkpoint}: written by {world} process(es), resumed on {world_size}; another "
                f"number of processes needs transformers >= 5.3 (found {transformers.__version__})"
            )
        moved = (checkpoint, world, state)
    return {"world_size": world, "ranks": [saved["loader"] for saved in ranks]}, moved
