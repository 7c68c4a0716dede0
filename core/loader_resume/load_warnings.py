"""What a loader says, once per loader and case, about a loaded state: that it would be ignored, or
that the continuation will not be bit-identical (a third-party object that cannot be restored
exactly); and that it is iterated together with another loader of the same seed (both then draw the
same random values)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

from loader_resume.thirdparty import irreproducible

__all__ = ["LoadWarnings", "warn_sampler_left"]

logger = logging.getLogger(__name__)


class LoadWarnings:
    """The warnings of one loader about the states loaded into it (see
    ``ResumableDataLoader.load_state_dict``)."""

    def __init__(
        self, name: str, dataset: Any, *, seed: int, keying: str, owner: weakref.ref[Any]
    ) -> None:
        self.name, self.dataset, self.seed, self.keying = name, dataset, seed, keying
        """The loader's values (fixed once it is built): ``name`` as the log names it, what it
        reads, its seed and keying."""
        self.owner = owner
        """The loader, weakly: whether it still exists (a pass of a loader that is gone is nobody's
        to iterate)."""
        self.live: weakref.ref[Any] | None = None
        """The last iterator handed out."""
        self.unused = False
        """A loaded state no ``iter()`` has taken up yet."""
        self.warned: set[str] = set()

    def iterating(self, iterator: Any) -> None:
        """``iter(loader)`` handed out ``iterator`` (whose ``mid_epoch`` says whether it is still in
        its pass)."""
        self.live = weakref.ref(iterator)
        if self.keying != "off":
            for other in list(_ITERATING):
                if other is not self and other.mid_pass() and other.seed == self.seed:
                    self.warn(
                        "shared seed",
                        f"another loader with the same seed ({self.seed}) is mid-pass: loaders "
                        "iterated together with one seed draw the same random values at the same "
                        "positions (the same augmentation in both). Give each its own seed= (the "
                        "front-ends do: loader_seed)",
                    )
                    break
            _ITERATING.add(self)

    def mid_pass(self) -> bool:
        """Whether this loader and its last iterator are alive, and the iterator still in its
        pass."""
        if self.owner() is None:
            return False
        live = self.live() if self.live is not None else None
        return live is not None and bool(live.mid_epoch)

    def taken_up(self) -> None:
        """An ``iter()`` took up the loaded state, if any."""
        self.unused = False

    def loading(self) -> None:
        """A state is being loaded: warn where it would be ignored, or where the continuation cannot
        be exact."""
        live = self.live() if self.live is not None else None
        if live is not None and live.mid_epoch:
            self.warn(
                "mid-epoch",
                "load_state_dict() was called while an iterator of this loader is still mid-epoch: "
                "that iterator goes on from where it was and ignores the loaded state, which takes "
                "effect at the next iter(loader). Load before iterating (e.g. before the epoch "
                "loop) for the loaded position to be the one trained on",
            )
        if self.unused:
            self.warn(
                "unused",
                "load_state_dict() was called twice with no iter() in between: the state loaded "
                "first was never used and is replaced by this one",
            )
        self.unused = True
        dataset = self.dataset
        reason = irreproducible(dataset)
        if reason is not None:
            logger.warning(
                "resuming %s: the continuation will NOT be bit-identical to the uninterrupted run: "
                "%s",
                type(dataset).__name__,
                reason,
            )

    def warn(self, case: str, message: str) -> None:
        if case not in self.warned:
            self.warned.add(case)
            logger.warning("%s: %s", self.name, message)


_ITERATING: weakref.WeakSet[LoadWarnings] = weakref.WeakSet()
"""The loaders' warnings whose loader began a pass (weak: gone with their loader)."""


def warn_sampler_left(sampler: Any) -> None:
    """A pass over a user's stateful sampler was left early: its state is its own to interpret."""
    logger.warning(
        "a pass over %s was left before its end: the state holds that sampler's own state_dict() "
        "as it is now, so whether the next pass resumes its old epoch or starts a new one is up to "
        "the sampler (loader-resume's own order, with no sampler, starts the next epoch as the "
        "uninterrupted run does)",
        type(sampler).__name__,
    )
