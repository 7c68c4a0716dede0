"""The fields of a loader's state that say what it reads and how — the dataset's length, the seed,
the order, the world size — as distinct from the position the loader's ``Position`` fills in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loader_resume.distributed import rank_and_world
from loader_resume.order.mixture import Mixture
from loader_resume.position import Position
from loader_resume.state import STATE_VERSION, check_state

__all__ = ["ENDED_PASS", "StateIdentity"]


class _Ended:
    done = True


ENDED_PASS = _Ended()
"""The pass an ``iter()`` over a saved pass's empty rest begins (over at once)."""


class StateIdentity:
    """A loader's identity fields: a fresh dict per call (``state_dict()`` runs between steps), from
    a template of the fields fixed at construction; while a pass is mid-epoch, those computed at its
    ``iter()`` (the length and world size it was planned with), unless ``num_workers`` changed
    since."""

    __slots__ = ("at_pass", "batch_size", "drop_last", "order", "position", "shuffle", "template")

    def __init__(self, position: Position, order: str, shuffle: bool, *, batch_size: int | None,
                 drop_last: bool) -> None:
        # NOTE: the loader's values, handed over (its batch_size and drop_last are fixed once it is
        # built): no reference back to the loader, which holds this object
        self.position, self.order, self.shuffle = position, order, shuffle
        self.batch_size, self.drop_last = batch_size, drop_last
        """``order``: what orders the data (the state's ``"source"`` field: ``"permutation"``,
        ``"iterable"``, or the user's sampler's class)."""
        self.template: dict[str, Any] | None = None
        self.at_pass: tuple[Any, int, dict[str, Any]] | None = None
        """(the pass, its ``num_workers``, the fields) of the last ``iter()``."""

    def fields(self) -> dict[str, Any]:
        """The identity fields as they are now (the position's fields zeroed)."""
        setup = self.position.setup
        if self.template is None:
            self.template = {
                "version": STATE_VERSION,
                "kind": self.position.kind,
                "source": self.order,
                "dataset_len": None,
                "seed": None,
                "shuffle": self.shuffle,
                "keying": setup.keying,
                "keyed_generators": None,
                "epoch": 0,
                "position": None,
                "world_size": None,
                "batch_size": self.batch_size,
                "num_workers": None,
                "drop_last": self.drop_last,
                "sampler_state": None,
                "dataset_state": None,
                "stream": None,
            }
            if not setup.in_order:
                self.template["ahead"] = []
        state = self.template.copy()
        state["dataset_len"], state["seed"] = self.position.dataset_len(), setup.seed
        state["keyed_generators"] = list(setup.generators)
        state["world_size"] = rank_and_world(setup.rank, setup.world_size)[1]
        state["num_workers"] = setup.num_workers
        return state

    def checked(self, state: Any) -> dict[str, Any]:
        """``state`` checked against these fields (``check_state``); a ``Mixture``
        dataset first checks its own part, which names a source of another length."""
        dataset = self.position.setup.dataset
        if (
            isinstance(dataset, Mixture)
            and isinstance(state, Mapping)
            and isinstance(state.get("dataset_state"), Mapping)
        ):
            dataset.check_state(state["dataset_state"])
        return check_state(state, self.fields())

    def pass_began(self, pass_: Any) -> None:
        """``iter()`` began ``pass_`` (whose ``done`` says when it ends)."""
        self.at_pass = (pass_, self.position.setup.num_workers, self.fields())

    def forget_pass(self) -> None:
        """A state was loaded: its position is reported with the identity as it is now."""
        self.at_pass = None

    def for_state(self, position: dict[str, Any], pass_ended: bool = False) -> dict[str, Any]:
        """The state for ``state_dict()``: these fields with the ``position``'s laid over them, a
        fresh dict (``pass_ended``: for where the next pass starts)."""
        at_pass = self.at_pass
        workers = self.position.setup.num_workers  # NOTE: the loader keeps it equal to its own
        if not pass_ended and at_pass is not None and not at_pass[0].done and at_pass[1] == workers:
            state = at_pass[2] | position
            state["keyed_generators"] = list(self.position.setup.generators)
            return state
        return self.fields() | position
