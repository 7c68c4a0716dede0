"""The global generators around ``ResumeCallback``'s fit: a checkpoint's put back right before the
first training step after a resume, and training's kept out of the validations that run inside
``fit``."""

from __future__ import annotations

from typing import Any

import torch

from loader_resume.job.checkpoint import global_rng_state, set_global_rng_state

__all__ = ["FitGenerators"]


class FitGenerators:
    """What ``ResumeCallback``'s hooks hand over: a loaded rank's states, each step's end,
    validation's bounds."""

    def __init__(self) -> None:
        self.to_restore: Any = None
        """A loaded checkpoint's states for this rank, until the first training step after the
        resume."""
        self._around_validation: Any = None
        self._torch_after_step: torch.Tensor | None = None

    def step_ended(self) -> None:
        self._torch_after_step = torch.get_rng_state()  # see validation_starts

    def restore(self) -> None:
        """Right before the first training step after the resume, so the model's dropout sequence
        continues exactly. NOTE: not only at epoch start: Lightning skips on_train_epoch_start when
        it resumes in the middle of an epoch. Fetching the batch before it draws nothing from these
        generators."""
        if self.to_restore is not None:
            set_global_rng_state(self.to_restore)
            self.to_restore = None

    def validation_starts(self, fitting: bool) -> None:
        """NOTE: validation inside fit draws from the global generators: a plain val DataLoader
        draws its workers' base seed from torch's when Lightning creates its iterator, before this
        hook. Putting them back afterwards (torch's as of the last training step) makes training's
        random sequence independent of when validation runs, so checkpoints around it resume
        exactly."""
        self._around_validation = global_rng_state() if fitting else None

    def validation_ends(self) -> None:
        if self._around_validation is not None:
            if self._torch_after_step is not None:
                self._around_validation["torch"] = self._torch_after_step
            set_global_rng_state(self._around_validation)
            self._around_validation = None
