"""The loader's state: a small, plain, versioned dict, validated field by field on load.

Version history:
  1 — first release: map-style datasets (permutation, custom sampler or batch sampler sources)
      and iterable datasets (per-worker progress under ``"stream"``, ``None`` for map-style).
  2 — each stream worker also records its iterator's state (torchdata's Stateful protocol) and
      whether it ran dry in the epoch. Version-1 states still load (the new fields read as None
      and False).
  3 — ``position`` means one thing: global samples delivered of map-style data (None for
      iterable datasets, whose delivered-batch count moved to ``stream["delivered"]``). Version-1
      and -2 states still load: ``check_state`` returns them in this layout. A loader built with
      ``in_order=False`` adds ``ahead``: the ends (global sample counts) of the steps delivered
      past ``position``.

Every key is always present (constant shape), values are ints, strings, bools, None or lists of
those, plus whatever a user's stateful sampler or dataset returns under
``sampler_state``/``dataset_state``.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from loader_resume.errors import StateError

__all__ = ["STATE_KEYS", "STATE_VERSION", "StateError", "check_state"]

logger = logging.getLogger(__name__)

STATE_VERSION: Final = 3
"""The layout ``state_dict()`` writes (``"version"`` in it). States of versions 1 to 3 load (an
older one is read in this layout); any other is refused with a ``StateError`` naming ``version``."""
READABLE_VERSIONS: Final = (1, 2, 3)

# Fields the position depends on: a saved value must equal the current one, or the order differs.
MUST_MATCH: Final = (
    "kind",
    "source",
    "dataset_len",
    "seed",
    "shuffle",
    "keying",
    "keyed_generators",
)
# Fields that may legitimately change between save and resume (elastic): accepted and logged.
MAY_CHANGE: Final = ("world_size", "batch_size", "num_workers", "drop_last")
STATE_KEYS: Final = (
    "version",
    *MUST_MATCH,
    "epoch",
    "position",
    *MAY_CHANGE,
    "sampler_state",
    "dataset_state",
    "stream",
)



def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_opt_int(value: Any) -> bool:
    return value is None or type(value) is int


_TYPES: Final[dict[str, tuple[str, Callable[[Any], bool]]]] = {
    "version": ("an int", _is_int),
    "kind": ("a str", lambda v: type(v) is str),
    "source": ("a str", lambda v: type(v) is str),
    "dataset_len": ("an int or None", _is_opt_int),
    "seed": ("an int", _is_int),
    "shuffle": ("a bool", lambda v: type(v) is bool),
    "keying": ("a str", lambda v: type(v) is str),
    "keyed_generators": (
        "a list of str",
        lambda v: type(v) is list and all(type(x) is str for x in v),
    ),
    "epoch": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "position": ("an int >= 0 or None", lambda v: v is None or (_is_int(v) and v >= 0)),
    "world_size": ("an int >= 1", lambda v: _is_int(v) and v >= 1),
    "batch_size": ("an int or None", _is_opt_int),
    "num_workers": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "drop_last": ("a bool", lambda v: type(v) is bool),
    "sampler_state": ("any value", lambda v: True),
    "dataset_state": ("any value", lambda v: True),
    "stream": ("a dict or None", lambda v: v is None or isinstance(v, dict)),
}
ENDING: Final = "ending"
"""The key of a state taken between a pass's last batch and its iterator's end, for a loop that will
end that pass itself after a load: the first ``iter()`` after loading it is empty
(``ResumableDataLoader.state_dict(ending=True)`` writes it; nothing else does)."""
OPTIONAL: Final[dict[str, tuple[str, Callable[[Any], bool]]]] = {
    "ahead": (
        "a list of ints > 0",
        lambda v: type(v) is list and all(_is_int(x) and x > 0 for x in v),
    ),
    ENDING: ("True", lambda v: v is True),
}
"""Keys only some loaders' states have (``ahead``: ``in_order=False``; ``ending``: taken between a
pass's last batch and its iterator's end, by a loader of a hand-written loop,
``step_boundary.ReportingDataLoader``)."""


def check_state(saved: Any, current: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` in this version's layout; raises ``StateError`` unless it can resume a loader whose
    own state is ``current``.

    ``current`` is the loader's state as it would be saved now. Nothing is modified (an older
    version's state is returned as a new dict), so a loader that refuses a state stays usable.
    """
    if not isinstance(saved, Mapping):
        hint = "Pass the dict that state_dict() returned."
        raise StateError("<state>", type(saved).__name__, "a dict", hint)
    _check_keys(saved)
    if saved["version"] not in READABLE_VERSIONS:
        hint = "This state comes from an unknown loader-resume release."
        raise StateError("version", saved["version"], f"one of {list(READABLE_VERSIONS)}", hint)
    state = _upgraded(saved)
    for field, (expected, ok) in [
        *_TYPES.items(),
        *((k, v) for k, v in OPTIONAL.items() if k in state),
    ]:
        if not ok(state[field]):
            raise StateError(field, state[field], expected, "The state was edited or corrupted.")
    if state.get("ahead") and (not _is_map(state) or min(state["ahead"]) <= state["position"]):
        raise StateError(
            "ahead",
            state["ahead"],
            "ends of map-style steps past position",
            "The state was edited or corrupted.",
        )
    for field in MUST_MATCH:
        if state[field] != current[field]:
            raise StateError(field, state[field], repr(current[field]), _MATCH_HINT)
    is_map = current["kind"] == "map"
    corrupted = "The state was edited or corrupted."
    if (state["stream"] is None) != is_map:
        raise StateError("stream", state["stream"], "None" if is_map else "a dict", corrupted)
    if (state["position"] is None) == is_map:
        raise StateError(
            "position", state["position"], "an int >= 0" if is_map else "None", corrupted
        )
    length = state["dataset_len"]
    if current["source"] == "permutation" and length is not None and state["position"] > length:
        limit = f"at most dataset_len={length}"
        raise StateError("position", state["position"], limit, "The state was edited or corrupted.")
    for field in MAY_CHANGE:
        if state[field] != current[field]:
            logger.info("resuming with %s=%r (saved with %r)", field, current[field], state[field])
    return state


def _is_map(state: Mapping[str, Any]) -> bool:
    return state["kind"] == "map" and state["position"] is not None


def _upgraded(saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` in the current layout: before version 3, an iterable's ``position`` was its
    delivered count."""
    state = dict(saved)
    stream = state["stream"]
    if state["version"] < 3 and isinstance(stream, Mapping) and "delivered" not in stream:
        state["stream"] = {**stream, "delivered": state["position"]}
        state["position"] = None
    state["version"] = STATE_VERSION
    return state


_MATCH_HINT: Final = (
    "The data order depends on this field, so resuming would deliver different samples; "
    "build the loader with the same dataset and settings as the run that saved it."
)


def _check_keys(saved: Mapping[str, Any]) -> None:
    missing = [k for k in STATE_KEYS if k not in saved]
    unknown = [k for k in saved if k not in STATE_KEYS and k not in OPTIONAL]
    if unknown:
        key = str(unknown[0])
        close = difflib.get_close_matches(key, STATE_KEYS, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise StateError(key, saved[unknown[0]], "no such key",
                         f"Unknown key; {guess}Known keys: {', '.join(STATE_KEYS)}.")
    if missing:
        raise StateError(
            missing[0],
            "<missing>",
            f"a value for {missing[0]!r}",
            "Required key missing from state.",
        )
