"""``in_order=False`` over map-style data: batches delivered in any order, the position still exact.

With ``in_order=False`` DataLoader hands over each batch as soon as a worker has it, so a slow item
stalls only its own batch. Here:

1. Every step the plan produces gets an entry, in plan order: where it moves the position once
   delivered (its ``end``, a global sample count), whether it ends the epoch, and whether it is
   delivered.
2. torch numbers the index lists it takes from the plan (0, 1, ... in this iterator); the loader
   reads which number each batch it hands over had (``torch_internals.next_numbered``) and marks
   that entry delivered.
3. The position is the end of the longest delivered prefix; the entries delivered past it are the
   state's ``ahead`` (their ends). A batch's values are keyed by its step, not by its arrival, so
   they are the same in any order.
4. A resume plans from the prefix and skips the steps in ``ahead``: every remaining batch of the
   epoch is delivered exactly once. The skipped steps count as delivered, so the prefix moves past
   them.

``ahead`` names steps of the saving run's world size and batch size: a state with steps ahead
resumes with the same ones (any ``num_workers``); one without resumes anywhere, as every map-style
state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from loader_resume.order.index_plan import Pending
from loader_resume.state import StateError

__all__ = ["OutOfOrder", "checked_ahead"]


class OutOfOrder:
    """One pass's steps, delivered in any order (see the module docstring)."""

    __slots__ = ("_count", "_numbered", "_steps", "skip")

    def __init__(self, skip: frozenset[int]) -> None:
        self.skip = skip
        """The ends of steps delivered before a resume: planned, counted as delivered, not handed to
        torch."""
        # [end, last, sampler_state, delivered], in plan order
        self._steps: deque[list[Any]] = deque()
        self._numbered: dict[int, list[Any]] = {}  # torch's number of a list in flight -> its entry
        self._count = 0

    def planned(self, lists: Iterator[tuple[Any, Pending]]) -> Iterator[Any]:
        """The lists to hand torch: every planned step is entered, those in ``skip`` as
        delivered."""
        for indices, (end, last, sampler_state) in lists:
            entry = [end, last, sampler_state, end in self.skip]
            self._steps.append(entry)
            if not entry[3]:
                self._numbered[self._count] = entry
                self._count += 1
                yield indices

    def deliver(self, number: int | None, advance: Callable[[int, bool, Any], None]) -> None:
        """List ``number`` (``None``: the oldest in flight, for a pass delivered in order) was
        handed over: ``advance(end, last, sampler_state)`` for each step the delivered prefix grows
        by."""
        self._numbered.pop(next(iter(self._numbered)) if number is None else number)[3] = True
        steps = self._steps
        while steps and steps[0][3]:
            end, last, sampler_state, _ = steps.popleft()
            advance(end, last, sampler_state)

    def ahead(self, position: int) -> list[int]:
        """The ends of the steps delivered past the prefix that ends at ``position`` (those skipped
        but not yet planned included)."""
        delivered = {entry[0] for entry in self._steps if entry[3]}
        return sorted(delivered | {end for end in self.skip if end > position})


def checked_ahead(state: Mapping[str, Any], setup: Any) -> list[int]:
    """A state's steps delivered ahead (``in_order=False``), refused where this loader's steps
    differ."""
    ahead = state.get("ahead") or []
    if not ahead:
        return []
    # NOTE: its own states have no `ahead`: a state taken before those steps would lose them
    if setup.in_order:
        raise StateError(
            "ahead",
            ahead,
            "[] for a loader built with in_order=True",
            "Batches were delivered out of order past the position: resume with in_order=False.",
        )
    shard = setup.shard()
    if (state["world_size"], state["batch_size"]) != (shard.world, setup.batch_size):
        raise StateError(
            "ahead",
            ahead,
            f"[] to resume with world_size={shard.world}, batch_size={setup.batch_size}",
            f"Batches were delivered out of order past the position, as steps of world_size="
            f"{state['world_size']} and batch_size={state['batch_size']}: resume with those.",
        )
    return list(ahead)
