"""Where ``loader_resume.testing.assert_resumes_exactly`` sends a state before a fresh loader loads
it: a deep copy, JSON, ``torch.save`` read back with ``weights_only=True``, or
``torch.distributed.checkpoint`` in this process (the ``"process"`` round trip is the helper's own:
a spawned process)."""

from __future__ import annotations

import copy
import inspect
import io
import json
import tempfile
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["load_through_dcp", "through"]


def through(state: dict[str, Any], round_trip: str) -> dict[str, Any]:
    """``state`` as it reads back after ``round_trip`` (``"json"``, ``"torch"``; anything else: a
    deep copy)."""
    if round_trip == "json":
        return json.loads(json.dumps(state))  # type: ignore[no-any-return]
    if round_trip == "torch":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]
    return copy.deepcopy(state)


def load_through_dcp(loader: Any, state: dict[str, Any]) -> None:
    """``torch.distributed.checkpoint.save`` of ``state``, then ``load`` into ``loader`` as a
    ``Stateful`` (DCP reads into the loader's own ``state_dict()`` as its template)."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    with tempfile.TemporaryDirectory() as directory:
        single = _single_process(save)
        save({"loader": _Holding(state)}, checkpoint_id=directory, **single)
        load({"loader": loader}, checkpoint_id=directory, **single)


def _single_process(save: Callable[..., Any]) -> dict[str, Any]:
    """The keyword that keeps a DCP round trip in this process: ``no_dist=True`` (torch >= 2.7).
    Older torch has no such keyword and saves in one process by itself unless a process group is
    initialised (refused then)."""
    if "no_dist" in inspect.signature(save).parameters:
        return {"no_dist": True}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            f"round_trip='dcp' under an initialised process group needs torch >= 2.7 (torch "
            f"{torch.__version__}'s torch.distributed.checkpoint has no no_dist=True); use another "
            "round trip, or call it before init_process_group"
        )
    return {}


class _Holding:
    """A saved state as a DCP ``Stateful``."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict
