"""``ResumeCallback``'s checkpoints on object storage (``dirpath`` or ``default_root_dir`` an fsspec
URL such as ``s3://bucket/run``): which checkpoint a restarted ``fit()`` resumes, found on the
remote itself.

Lightning looks for a restarted fit's checkpoint among the ``OnExceptionCheckpoint``s' ``ckpt_path``
and the ``last*.ckpt`` files its ``ModelCheckpoint``s list, but it lists those without the URL's
protocol (``ModelCheckpoint._find_last_checkpoints``, Lightning 2.6; Lightning #18261), so on a
remote it finds none of them. So our ``ckpt_path`` offers, when the preemption checkpoint is absent,
the newest ``last*.ckpt`` of the trainer's ``ModelCheckpoint``s on the remote (``newest_last``); and
a fit that resumes nothing from a remote directory holding checkpoints is refused
(``checkpoints_in``), never a silent start at step 0.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.checkpoint_dir import DirectoryLock, claim
from loader_resume.job.remote_lease import RemoteLease
from loader_resume.job.storage import is_remote, remote_filesystem

logger = logging.getLogger(__name__)

__all__ = ["checkpoints_in", "claim_directory", "newer", "newest_last", "refuse_a_silent_start"]


def _listed(directory: str, pattern: str) -> list[tuple[str, Any]]:
    """``(url, modified)`` of the files in the remote ``directory`` whose name matches
    ``pattern``."""
    fs, path = remote_filesystem(directory)
    try:
        entries = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    protocol = directory.split("://", 1)[0]
    found = []
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") == "file" and re.fullmatch(pattern, name):
            # NOTE: S3 lists it: no request
            modified = entry.get("LastModified") or fs.modified(entry["name"])
            found.append((f"{protocol}://{entry['name']}", modified))
    return found


def newer(ours: str | None, last: str | None) -> str | None:
    """The more recently written of the preemption checkpoint ``ours`` and a ``last.ckpt`` (either
    may be None): a later run that resumed from ``ours``, then wrote ``last.ckpt`` and crashed,
    resumes from its own progress. Written in the same second (object stores keep whole seconds),
    the one of the later step; ``ours`` at the same step: a preemption stop may write ``last.ckpt``
    at the same step after it."""
    if ours is None or last is None:
        return ours or last
    fs, _ = remote_filesystem(ours)
    mine, theirs = fs.modified(ours), fs.modified(last)
    if mine != theirs:
        return last if theirs > mine else ours
    try:
        later = _global_step(last) > _global_step(ours)
    # NOTE: a checkpoint torch cannot read with weights_only: the tie goes to ours
    except Exception as error:
        logger.warning(
            "%s and %s were written in the same second and their steps could not be read (%s): "
            "resuming from %s",
            ours,
            last,
            error,
            ours,
        )
        return ours
    chosen = last if later else ours
    logger.info(
        "%s and %s were written in the same second: resuming from %s, the later step",
        ours,
        last,
        chosen,
    )
    return chosen


def _global_step(url: str) -> int:
    """The ``global_step`` a Lightning checkpoint holds (read whole: only for the same second's
    two)."""
    fs, path = remote_filesystem(url)
    with fs.open(path, "rb") as file:
        return int(torch.load(file, map_location="cpu", weights_only=True)["global_step"])


def _model_checkpoint_folders(trainer: Trainer) -> list[tuple[str, str]]:
    """(the remote folder, the last-file prefix) of each of the trainer's ``ModelCheckpoint``s."""
    folders = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and type(callback).__name__ != "ResumeCallback":
            # NOTE: before setup a ModelCheckpoint without dirpath has not resolved it: Lightning's
            # own resolution
            resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir")  # noqa: B009
            folder = callback.dirpath or resolve(trainer)
            if is_remote(str(folder)):
                folders.append((str(folder), callback.CHECKPOINT_NAME_LAST or "last"))
    return folders


def newest_last(trainer: Trainer | None) -> str | None:
    """The URL of the newest ``last*.ckpt`` the trainer's ``ModelCheckpoint``s keep on a remote,
    else None."""
    if trainer is None:
        return None
    found = [entry for folder, last in _model_checkpoint_folders(trainer)
             for entry in _listed(folder, rf"{re.escape(last)}(-v\d+)?\.ckpt")]
    return max(found, key=lambda entry: entry[1])[0] if found else None


def checkpoints_in(directory: str, trainer: Trainer) -> list[str]:
    """The checkpoint files (``*.ckpt``) in the remote ``directory`` and the trainer's remote
    checkpoint folders."""
    folders = [directory, *(folder for folder, _ in _model_checkpoint_folders(trainer))]
    return sorted({url for folder in folders for url, _ in _listed(folder, r"[^.].*\.ckpt")})


def refuse_a_silent_start(found: list[str]) -> None:
    """A fit resumes nothing from a remote directory: refused if it holds checkpoints
    (``found``)."""
    if found:
        raise CheckpointError(
            f"this fit() resumes nothing, but its remote checkpoint directory holds {found}: "
            "expected to resume from one of them (pass fit(ckpt_path=...)), or an empty directory "
            "to start over"
        )


def claim_directory(
    directory: str, main: bool, agree: Callable[[bool], bool]
) -> DirectoryLock | RemoteLease | None:
    """The job's hold on ``directory``: a local one's lock, a remote one's lease where its store can
    create conditionally (else it is said, at start, not to be locked); see
    ``loader_resume.job.checkpoint_dir.claim``."""
    return claim(directory, main=main, agree=agree, remote=True)
