"""Accelerate's ``save_state`` into a given directory, and our file in a checkpoint directory read
back."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.checkpoint_entry import checked_entry

__all__ = ["STATE_FILE", "read_state", "save_state_to"]

logger = logging.getLogger(__name__)

STATE_FILE = "loader_resume.pt"
"""Our file inside an Accelerate checkpoint directory (loaded with ``weights_only=True``)."""


def save_state_to(accelerator: Accelerator, directory: Path) -> None:
    """``save_state`` into ``directory`` exactly (Accelerate's automatic naming would ignore it)."""
    project = accelerator.project_configuration
    naming, iteration = project.automatic_checkpoint_naming, project.iteration
    project.automatic_checkpoint_naming = False
    try:
        accelerator.save_state(os.fspath(directory))
    finally:
        project.automatic_checkpoint_naming, project.iteration = naming, iteration


def read_state(path: str) -> dict[str, Any] | None:
    """Our state file of a checkpoint directory; ``None`` (with a warning) where there is none."""
    if not os.path.exists(path):
        logger.warning("%s has no %s (saved before enable_resume?): loaders restart their epoch",
                       os.path.dirname(path), STATE_FILE)
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable ({error}); expected a state written by "
                              "loader-resume") from None
    return checked_entry(state, path)
