"""The loader ``accelerator.prepare`` returns after ``enable_resume``: a ResumableDataLoader that also
plays Accelerate's part (device placement, gradient-state bookkeeping) and reports to the hook."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from accelerate.utils import send_to_device
from torch.utils.data import IterableDataset

from loader_resume import ResumableDataLoader

__all__ = ["AcceleratedResumableDataLoader", "BatchRequests"]


class BatchRequests(Protocol):
    """What the loader reports to whoever decides step boundaries (the hook's ``Resume``)."""

    def before_batch(self, loader: AcceleratedResumableDataLoader) -> None:
        """The training loop asks ``loader`` for its next batch (the place for a step boundary)."""

    def delivered(self, loader: AcceleratedResumableDataLoader) -> None:
        """``loader`` handed a batch to the training loop."""

_END: Any = object()


class AcceleratedResumableDataLoader(ResumableDataLoader[Any], DataLoaderStateMixin):
    """A :class:`~loader_resume.ResumableDataLoader` sharded by us across Accelerate's processes.

    As Accelerate's ``DataLoaderShard`` does, it moves each batch to ``device``, tells the gradient
    state which loader is active, raises ``end_of_dataloader`` with the last batch of an epoch (so
    ``accumulate`` syncs there) and sets ``remainder`` for ``gather_for_metrics``. Unlike it, it does
    not fetch a batch ahead: each request for the next batch is first reported to the hook, which is
    where step boundaries (periodic and preemption checkpoints, automatic resume) happen.
    A map-style loader knows its last batch from its position; a loader over an ``IterableDataset``
    fetches one batch ahead, as ``DataLoaderShard`` does (:meth:`resume_state` accounts for it).
    """

    _is_accelerate_prepared = True  # Accelerate's own prepare_data_loader keeps it as it is
    _hook: BatchRequests | None = None
    _device: torch.device | None = None
    _non_blocking: bool = False
    _held = 0

    def attach(self, hook: BatchRequests, device: torch.device | None, non_blocking: bool) -> None:
        """Report to ``hook``; move batches to ``device`` (``None``: leave them where they are)."""
        self._hook, self._device, self._non_blocking = hook, device, non_blocking
        self.gradient_state = GradientState()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not torch's iterator class
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        hook = self._hook
        if hook is not None:
            hook.before_batch(self)  # the first request of a pass: the previous pass's last step ends here
        inner = super().__iter__()
        self.begin()
        try:
            ahead = isinstance(self.dataset, IterableDataset)  # no length: fetch one batch ahead to see the end coming
            epoch = self.epoch
            current = next(inner, _END)
            while current is not _END:
                upcoming = next(inner, _END) if ahead else None
                self._held = int(ahead and upcoming is not _END)
                self.end_of_dataloader = upcoming is _END if ahead else self.epoch != epoch
                if hook is not None:
                    hook.delivered(self)
                yield current if self._device is None else self._place(current)
                if self.end_of_dataloader:
                    return  # NOTE: no boundary on the request that ends the pass, see resume_state
                if hook is not None:
                    hook.before_batch(self)
                epoch = self.epoch
                current = upcoming if ahead else next(inner, _END)
        finally:
            self._held = 0
            self.end()

    def resume_state(self) -> dict[str, Any]:
        """The state at the last batch handed to the training loop (not at a batch fetched ahead).

        NOTE: a step boundary is never taken on the request that ends a pass, but on the next pass's
        first request: by then the loop has run its end-of-epoch code and moved to the next epoch,
        so the loader's state (the next epoch) and the loop's epoch agree.
        """
        return self.state_dict(batches_ago=self._held) if self._held else self.state_dict()

    def _place(self, batch: Any) -> Any:
        return send_to_device(batch, self._device, non_blocking=self._non_blocking)

    def begin(self) -> None:
        """Register with the gradient state; ``remainder`` as Accelerate computes it (for
        ``gather_for_metrics``: our padded tail is rank-major, as the gathered batch is)."""
        self.reset()
        if not isinstance(self.dataset, IterableDataset) and not self.drop_last and self.batch_size:
            self.remainder = len(self.dataset) % (self.batch_size * self.world_size)  # type: ignore[arg-type]
        # NOTE: Accelerate's own DataLoaderShard registers this way (accelerate 1.15; no public method)
        self.gradient_state._add_dataloader(self)
