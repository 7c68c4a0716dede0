"""What a loader says about states of a pass in flight when the loop has not said what it means by
leaving it.

A state describes where the pass in flight continues, whether or not its iterator still exists: a
loop that ``break``s (or fails) and then saves is most often a job that stops, and continuing the
pass loses nothing. A loop that leaves passes on purpose (an epoch limit of its own) says so with
``state_dict(pass_ended=True)``; the front-ends say it for theirs. Where the loop said neither, the
loader says which it did, once per loader:

1. at the first such state: that loading it continues the pass, and how to choose the other;
2. at an ``iter()`` that leaves a pass at the very batch a state was taken there (the loop left the
   pass on purpose, in this process): that the state continues the pass this process just left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from loader_resume.position import Position

__all__ = ["PassNotes"]

logger = logging.getLogger(__name__)

_HOW = ("a loop that leaves passes on purpose (an epoch limit of its own) takes its states with "
        "state_dict(pass_ended=True)")


class PassNotes:
    """One loader's notes about states of its passes in flight (see the module docstring)."""

    __slots__ = ("name", "position", "said", "taken", "warned")

    def __init__(self, name: str, position: Position) -> None:
        self.name, self.position = name, position
        """``name``: the loader as the log names it (``ResumableDataLoader over MyDataset``)."""
        self.said = self.warned = False
        self.taken: dict[str, Any] | None = None
        """The last state taken without ``pass_ended`` since the last ``iter()`` or load (the loader
        sets it)."""

    def first(self, at_pass: Any, state: dict[str, Any]) -> None:
        """The first states without ``pass_ended``, until one is of a pass in flight (``at_pass``:
        the loader's last ``iter()``, see ``StateIdentity``): that one says once what loading it
        does."""
        if at_pass is None or at_pass[0].done:
            return
        self.said = True
        done, total = self.position.progress()
        logger.info(
            "%s: state_dict() continues the pass of epoch %d at batch %d of %s when loaded "
            "(whether or not the loop left it: a stopped job loses no sample); %s",
            self.name,
            state["epoch"],
            done + 1,
            "?" if total is None else total,
            _HOW,
        )

    def leaving(self, at_pass: Any, now: Callable[[], dict[str, Any]]) -> None:
        """``iter()`` begins a new pass; ``at_pass``: the loader's last, ``now()``: its state as it
        stands."""
        taken, self.taken = self.taken, None
        if self.warned or taken is None or at_pass is None or at_pass[0].done:
            return
        # NOTE: one pass's states differ in position: equal ones were taken where it is left
        state = now()
        # NOTE: .get: the state was handed to the caller, who may edit it
        fields = ("epoch", "position", "stream")
        if tuple(taken.get(name) for name in fields) == tuple(state[name] for name in fields):
            self.warned = True
            done, total = self.position.progress()
            logger.warning(
                "%s: the loop left the pass of epoch %d after batch %d of %s, where a state was "
                "taken; this iter() starts epoch %d, but that state, loaded, continues epoch %d "
                "with batch %d (what a job stopped there needs); %s",
                self.name,
                state["epoch"],
                done,
                "?" if total is None else total,
                state["epoch"] + 1,
                state["epoch"],
                done + 1,
                _HOW,
            )
