"""Writing one checkpoint through Accelerate's ``save_state``: atomically, and agreed by every process."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from accelerate import Accelerator

from loader_resume.checkpoint import complete_checkpoints, prune, seal, temporary_name
from loader_resume.distributed import any_rank

__all__ = ["write_checkpoint"]

logger = logging.getLogger(__name__)


def write_checkpoint(accelerator: Accelerator, final: Path, *, step: int, checksums: bool, keep: int) -> bool:
    """``accelerator.save_state`` into a temporary directory beside ``final``, sealed with a manifest and
    renamed to ``final``; checkpoints beyond the newest ``keep`` are deleted. Every process calls it.

    A failed write (a full disk, a lost mount) on any process is agreed by all: the partial directory is
    removed, the error is logged, the previous checkpoints stay and ``False`` is returned. NOTE: every
    process takes the same branch at each agreement, so the collectives stay paired.
    """
    temporary = temporary_name(final)
    failure: OSError | None = None
    try:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
    except OSError as error:
        failure = error
    if not any_rank(failure is not None):
        try:
            _save_state_to(accelerator, temporary)
        except OSError as error:
            failure = error
        if not any_rank(failure is not None) and accelerator.is_main_process:
            try:
                seal(temporary, final, checksums=checksums)
                prune(final.parent, keep)
            except OSError as error:
                failure = error
        if not any_rank(failure is not None):
            return True
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    kept = complete_checkpoints(final.parent)
    logger.error("checkpoint at step %d failed (%s); training goes on, the newest checkpoint is still %s",
                 step, failure or "on another process", kept[-1] if kept else "none")
    return False


def _save_state_to(accelerator: Accelerator, directory: Path) -> None:
    """``save_state`` into ``directory`` exactly (Accelerate's automatic naming would ignore it)."""
    project = accelerator.project_configuration
    naming, iteration = project.automatic_checkpoint_naming, project.iteration
    project.automatic_checkpoint_naming = False
    try:
        accelerator.save_state(os.fspath(directory))
    finally:
        project.automatic_checkpoint_naming, project.iteration = naming, iteration
