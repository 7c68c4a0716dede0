"""``ResumeCallback``'s checkpoint files under storage faults: written atomically under a name of their own,
verified before Lightning loads them, and a corrupted preemption checkpoint passed over at an automatic resume.

- :func:`save_atomically`: ``trainer.save_checkpoint`` into ``.NAME.tmp-TOKEN`` (a name of this write alone), then
  renamed; a failed write on any rank (a full disk, a read-only mount, any exception) is agreed by all ranks, the
  temporary file is removed, the previous checkpoint stays, and ``None`` is returned.
- :func:`usable`: whether a checkpoint file verifies (:func:`loader_resume.torch_file.verify_torch_file`), with
  a warning naming it and why not; :func:`verify_loads`: every file the strategy loads is verified first, so a
  changed or truncated checkpoint is refused naming the file (``fit(ckpt_path=...)`` included).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

from loader_resume.checkpoint import CheckpointError, describe_failure, storage_failure, writer_token
from loader_resume.torch_file import verify_torch_file

__all__ = ["nothing_else_to_resume", "save_atomically", "usable", "verify_loads"]

logger = logging.getLogger(__name__)


def save_atomically(trainer: Trainer, final: str) -> str | None:
    """``trainer.save_checkpoint`` to ``final`` through a temporary file (every rank calls it): ``final``, or
    ``None`` when the write failed on any rank (logged with the path and the cause)."""
    strategy = trainer.strategy
    folder, name = os.path.split(final)  # NOTE: strings, as Lightning's paths may be URLs
    temporary = os.path.join(folder, f".{name}.tmp-{writer_token(strategy.broadcast)}")
    failure: Exception | None = None
    try:
        trainer.save_checkpoint(temporary)
    except Exception as error:  # NOTE: the barrier save_checkpoint ends with, which the other ranks are in
        failure = storage_failure(error)
        strategy.barrier("Trainer.save_checkpoint")
    if not strategy.reduce_boolean_decision(failure is not None, all=False) and trainer.is_global_zero:
        try:
            os.replace(temporary, final)
        except OSError as error:
            failure = error
    if not strategy.reduce_boolean_decision(failure is not None, all=False):
        return final
    cause = describe_failure(failure, Path(final).parent) if failure is not None else "failed on another rank"
    if trainer.is_global_zero:
        with contextlib.suppress(OSError):
            os.remove(temporary)
    logger.error("checkpoint at step %d NOT written to %s: %s", trainer.global_step, final, cause)
    return None


def usable(path: str) -> bool:
    """Whether the checkpoint file at ``path`` verifies; a warning names it and why not (once per version of it:
    Lightning asks for it more than once)."""
    stat = os.stat(path)
    return _usable(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _usable(path: str, size: int, mtime: int) -> bool:
    try:
        verify_torch_file(path)
    except CheckpointError as error:
        logger.warning("skipping checkpoint %s at the automatic resume: %s", path, error)
        return False
    return True


def verify_loads(strategy: Any) -> None:
    """Every checkpoint file ``strategy.load_checkpoint`` reads from now on is verified first (a directory, as a
    sharded strategy saves, or a remote URL, is left to the strategy)."""
    load = strategy.load_checkpoint
    if getattr(load, "verifies", False):
        return

    @functools.wraps(load)
    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isfile(checkpoint_path):
            verify_torch_file(checkpoint_path)
        return load(checkpoint_path, *args, **kwargs)

    load_checkpoint.verifies = True  # type: ignore[attr-defined]
    strategy.load_checkpoint = load_checkpoint


def nothing_else_to_resume(skipped: str) -> CheckpointError:
    """The error when the preemption checkpoint ``skipped`` does not verify and Lightning found no other."""
    return CheckpointError(f"{skipped}: the preemption checkpoint does not verify (the warning above says why) and "
                           "there is no other checkpoint to resume from; expected an intact one: move it away to "
                           "start over")
