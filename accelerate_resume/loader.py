"""The loader ``accelerator.prepare`` returns after ``enable_resume``: a ResumableDataLoader that
also plays Accelerate's part (device placement, gradient-state bookkeeping) and reports to the
hook."""

from __future__ import annotations

from functools import partial

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device
from torch.utils.data import IterableDataset

from loader_resume.job.step_boundary import BatchRequests, ReportingDataLoader

__all__ = ["AcceleratedResumableDataLoader", "placed"]


class AcceleratedResumableDataLoader(ReportingDataLoader, DataLoaderStateMixin):
    """A [`ResumableDataLoader`][loader_resume.ResumableDataLoader] sharded by us across
    Accelerate's processes.

    As Accelerate's ``DataLoaderShard`` does, it moves each batch to ``device``, tells the gradient
    state which loader is active, raises ``end_of_dataloader`` with the last batch of an epoch (so
    ``accumulate`` syncs there) and sets ``remainder`` for ``gather_for_metrics``. Unlike it, it
    does not fetch a batch ahead: each request for the next batch is first reported to the hook,
    which is where step boundaries (periodic and preemption checkpoints, automatic resume) happen. A
    map-style loader knows its last batch from its position; a loader over an ``IterableDataset``
    fetches one batch ahead, as ``DataLoaderShard`` does (``resume_state`` accounts for it).
    """

    _is_accelerate_prepared = True  # Accelerate's own prepare_data_loader keeps it as it is

    def attach_accelerate(
        self, reports: BatchRequests | None, device: torch.device | None, non_blocking: bool
    ) -> None:
        """Report to ``reports``; move batches to ``device`` (``None``: leave them where they
        are)."""
        self.attach(reports, None if device is None else partial(send_to_device, device=device,
                                                                 non_blocking=non_blocking))
        self.gradient_state = GradientState()

    def pass_begins(self) -> None:
        self.begin()

    def pass_ends(self) -> None:
        self.end()

    def begin(self) -> None:
        """Register with the gradient state; ``remainder`` as Accelerate computes it (for
        ``gather_for_metrics``: our padded tail is rank-major, as the gathered batch is)."""
        self.reset()
        if not isinstance(self.dataset, IterableDataset) and not self.drop_last and self.batch_size:
            size = len(self.dataset)  # type: ignore[arg-type]
            self.remainder = size % (self.batch_size * self.world_size)
        # NOTE: Accelerate's own DataLoaderShard registers this way (accelerate 1.15; no public
        # method)
        self.gradient_state._add_dataloader(self)


def placed(accelerator: Accelerator, placement: bool | None) -> tuple[torch.device | None, bool]:
    """Where ``prepare(..., device_placement=[placement])`` puts a loader's batches (``None``: left
    where they are), and whether the copies are non-blocking."""
    place = accelerator.device_placement if placement is None else placement
    return (accelerator.device if place else None), bool(accelerator.non_blocking)
