"""Step boundaries of a hand-written training loop, seen from its loaders and optimizers.

A checkpoint must be taken where an uninterrupted run could be cut without a trace: after an
optimizer step *and* after everything the loop does once it stepped (an LR scheduler's step,
logging, an evaluation), before the next batch is fetched. Loops written by hand (Accelerate,
Lightning Fabric) have no hook there, so it is found from two signals:

- ``ReportingDataLoader`` reports every request for a batch, before it fetches, and every batch it
  hands over;
- an optimizer step post-hook (torch's public ``register_step_post_hook``), which fires on real
  steps only (never on a skipped accumulation step).

``StepBoundaries`` combines them: a *step boundary* is a request for the next batch, after an
optimizer step, from a loader that delivered a batch before that step. An evaluation loader iterated
after the step is no boundary, and gradient accumulation is never split. The request that ends a
pass is no boundary either: the next pass's first request is, once the loop has run its end-of-epoch
code.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset

from loader_resume.loader import ResumableDataLoader

__all__ = ["BatchRequests", "ReportingDataLoader", "StepBoundaries"]


class BatchRequests(Protocol):
    """What a ``ReportingDataLoader`` reports to whoever decides step boundaries."""

    def before_batch(self, loader: ReportingDataLoader) -> None:
        """The training loop asks ``loader`` for its next batch (the place for a step boundary)."""

    def delivered(self, loader: ReportingDataLoader) -> None:
        """``loader`` handed a batch to the training loop."""

    def ran_out(self, loader: ReportingDataLoader) -> None:
        """The training loop asked ``loader`` past the last batch of its pass."""


_END: Any = object()


class ReportingDataLoader(ResumableDataLoader[Any]):
    """A ``ResumableDataLoader`` that reports each batch request, before the fetch, to a
    ``BatchRequests`` (``attach``), and can move batches to a device.

    ``end_of_dataloader`` is true while the last batch of a pass is out. A map-style loader knows
    its last batch from its position; a loader over an ``IterableDataset`` fetches one batch ahead
    to see the end coming (``resume_state`` accounts for it).
    """

    _reports: BatchRequests | None = None
    _place: Callable[[Any], Any] | None = None
    # batches fetched ahead of the loop in the pass in flight (streams: one), kept if the loop
    # leaves it
    _held = 0
    _open_at_end = False  # the pass's last batch is out and its generator has not ended yet
    # the first request of a new pass is being reported: the pass before it is left
    _requesting = False
    end_of_dataloader = False

    def attach(self, reports: BatchRequests | None, place: Callable[[Any], Any] | None) -> None:
        """Report to ``reports``; hand each batch over as ``place(batch)`` (the framework's move to
        its device; ``None``: as it is)."""
        self._reports, self._place = reports, place

    # a generator, not torch's iterator class
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._batches()

    def _batches(self) -> Iterator[Any]:
        reports = self._reports
        # the first request of a pass: the previous pass's last step ends here
        if reports is not None:
            self._requesting = True
            try:
                reports.before_batch(self)
            finally:
                self._requesting = False
        inner = super().__iter__()
        self._held, self._open_at_end = 0, False
        self.pass_begins()
        try:
            # no length: fetch one batch ahead to see the end coming
            ahead = isinstance(self.dataset, IterableDataset)
            epoch = self.epoch
            current = next(inner, _END)
            while current is not _END:
                upcoming = next(inner, _END) if ahead else None
                self._held = int(ahead and upcoming is not _END)
                self.end_of_dataloader = upcoming is _END if ahead else self.epoch != epoch
                if reports is not None:
                    reports.delivered(self)
                self._open_at_end = self.end_of_dataloader
                yield current if self._place is None else self._place(current)
                if self.end_of_dataloader:
                    break  # NOTE: no boundary on the request that ends the pass, see resume_state
                if reports is not None:
                    reports.before_batch(self)
                epoch = self.epoch
                current = upcoming if ahead else next(inner, _END)
            # NOTE: only a pass that ran out holds nothing: one the loop left (a `break`, an
            # exception) keeps what was fetched ahead of it, whenever its generator is closed, as
            # its state goes on saying
            self._held, self._open_at_end = 0, False
            if reports is not None:
                reports.ran_out(self)
        finally:
            self.pass_ends()

    def resume_state(
        self, *, pass_ended: bool = False, loop_ends_pass: bool = True
    ) -> dict[str, Any]:
        """The state at the last batch handed to the training loop (not at a batch fetched ahead); a
        pass the loop left continues there, unless ``pass_ended`` (the front-end knows its loop
        moved on: an epoch of its own ended) or the state is taken at the first request of this
        loader's next pass (the loop began it). ``loop_ends_pass=False``: the resumed loop starts
        the next pass with a new ``iter()`` even where the last batch is out (the transformers
        Trainer); else that pass's rest is empty after a load (below).

        NOTE: a step boundary is never taken on the request that ends a pass, but on the next pass's
        first request: by then the loop has run its end-of-epoch code and moved to the next epoch,
        so the loader's state (the next epoch) and the loop's epoch agree. A state taken while the
        last batch is out and the pass not yet ended (a checkpoint in the loop's body; another
        loader's request in a ``zip``) says so (``"ending"``): after a load the rest of that pass is
        empty, as the loop will find it.
        """
        if pass_ended or self._requesting:
            return self.state_dict(pass_ended=True)
        return self.state_dict(
            batches_ago=self._held, pass_ended=False, ending=loop_ends_pass and self._open_at_end
        )

    def pass_begins(self) -> None:
        """A pass begins (after ``iter()``): for subclasses."""

    def pass_ends(self) -> None:
        """A pass ends, or its iterator is dropped: for subclasses."""


class StepBoundaries:
    """Counts a hand-written loop's optimizer steps and tells which batch request is a step boundary
    (see the module docstring). Feed it ``optimizer_stepped`` (an optimizer step post-hook),
    ``delivered`` and ask ``crossed`` at each request (both from ``BatchRequests``)."""

    def __init__(self) -> None:
        self.steps = 0
        """Optimizer steps whose boundary has passed (a loop that steps twice per batch counts
        two)."""
        self._before = 0  # ...as of the boundary before the last one
        self._stepped = 0  # optimizer steps since the last boundary
        # loaders that delivered a batch since the last boundary
        self._participants: set[int] = set()
        # ...of which those that delivered before an optimizer step
        self._step_loaders: set[int] = set()
        self._events = itertools.count()  # orders deliveries and passes that ran out
        # a loader's id: (when, the loop's epoch) of its last batch
        self._last_batch: dict[int, tuple[int, int]] = {}
        # when a training loader's pass ran out, until the loop's next request for a batch
        self._ran_out = -1
        self._trained: set[int] = set()  # loaders that ever delivered before an optimizer step
        self._epochs = 0  # the loop's epochs ended (epoch_ended)

    @property
    def step(self) -> int:
        """Optimizer steps completed (steps whose boundary has not come yet included)."""
        return self.steps + self._stepped

    def hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Count ``optimizer``'s steps, two per batch as two (a Fabric or Accelerate wrapper: the
        optimizer inside it); the hook's handle."""
        return getattr(optimizer, "optimizer", optimizer).register_step_post_hook(
            self.optimizer_stepped
        )

    def optimizer_stepped(self, *_: Any) -> None:
        self._stepped += 1
        # loaders that fed this step (an evaluation after it did not)
        self._step_loaders |= self._participants
        self._trained |= self._participants

    def delivered(self, loader: Any) -> None:
        self._participants.add(id(loader))
        self._last_batch[id(loader)] = (next(self._events), self._epochs)

    def ran_out(self, loader: Any) -> None:
        """``loader``'s pass ran out (the loop asked past its last batch)."""
        # NOTE: an evaluation loader, which feeds no step, ends no epoch
        if id(loader) in self._trained:
            self._ran_out = next(self._events)

    def epoch_ended(self) -> None:
        """The loop's epoch is over: the front-end's ``epochs()`` moves to the next one."""
        self._epochs += 1

    def left(self, loader: Any) -> bool:
        """Whether the loop left ``loader``'s pass, so that its pass in flight, if any, is over and
        a state describes where its next pass starts: the loop's epoch ended since ``loader``'s last
        batch (``epochs()`` moved on), or a training loader's pass ran out after it and the loop has
        asked for no batch since (a save right after a ``zip`` over loaders of unequal length, which
        ends there). A ``break`` runs nothing out: its passes go on; nor does a loader cycled by
        hand (``next()``, a new ``iter()`` at its end), asked again at once. NOTE: an iterator kept
        across ``epochs()`` by hand is left with the epoch, until its next batch."""
        last = self._last_batch.get(id(loader))
        return last is not None and (last[1] < self._epochs or last[0] < self._ran_out)

    def crossed(self, loader: Any) -> bool:
        """Whether this request for a batch from ``loader`` is a step boundary (then counted). A
        pass that ran out before it stands for the loop's end no more (see ``left``)."""
        self._ran_out = -1
        if not (self._stepped and id(loader) in self._step_loaders):
            return False
        self._before, self.steps, self._stepped = self.steps, self.steps + self._stepped, 0
        self._participants.clear()
        self._step_loaders.clear()
        return True

    def reached(self, every: int) -> bool:
        """Whether the boundary just crossed completed a multiple of ``every`` steps (``0``: never):
        a loop that steps its optimizer several times per batch may jump past the multiple
        itself."""
        return bool(every) and self.steps // every > self._before // every

    def reset(self, steps: int) -> None:
        """A checkpoint was loaded: ``steps`` steps are done, none pending."""
        self._before = self.steps = steps
        self._stepped = 0
        self._participants.clear()
        self._step_loaders.clear()
        self._last_batch.clear()
