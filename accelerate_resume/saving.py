"""Writing one checkpoint through Accelerate's ``save_state``: atomically, and agreed by every process."""

from __future__ import annotations

import os
from pathlib import Path

from accelerate import Accelerator

from loader_resume.checkpoint import write_sealed
from loader_resume.distributed import any_rank

__all__ = ["write_checkpoint"]


def write_checkpoint(accelerator: Accelerator, final: Path, *, step: int, checksums: bool, keep: int) -> bool:
    """``accelerator.save_state`` into a temporary directory beside ``final``, sealed with a manifest and
    renamed to ``final``; checkpoints beyond the newest ``keep`` are deleted. Every process calls it
    (:func:`loader_resume.checkpoint.write_sealed`: a failed write is agreed by all and returns ``False``).
    """
    return write_sealed(final, lambda directory: _save_state_to(accelerator, directory),
                        main=accelerator.is_main_process, agree=any_rank, step=step, checksums=checksums, keep=keep)


def _save_state_to(accelerator: Accelerator, directory: Path) -> None:
    """``save_state`` into ``directory`` exactly (Accelerate's automatic naming would ignore it)."""
    project = accelerator.project_configuration
    naming, iteration = project.automatic_checkpoint_naming, project.iteration
    project.automatic_checkpoint_naming = False
    try:
        accelerator.save_state(os.fspath(directory))
    finally:
        project.automatic_checkpoint_naming, project.iteration = naming, iteration
