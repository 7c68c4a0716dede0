"""The main process's side of iterable datasets: per-worker progress of delivered batches, as state.

State layout under the loader state's ``"stream"`` key (``None`` for map-style data)::

    {"rank": 0, "next_worker": 1, "delivered": 5,
     "workers": [{"batches": 3, "items": 6, "state": <dataset.state_dict() or None>,
                  "iterator": <state_dict() of the iterator iter(dataset) returned, or None>,
                  "dry": <bool: the worker's stream ended in this epoch>,
                  "self_iterator": <bool: iter(dataset) returned the dataset; state is loaded
                                    after iter()>,
                  "before_epoch": <bool: state is from the end of the previous epoch, loaded
                                   before set_epoch>,
                  "own": [<attributes the copy's own iter() changed (no state restores them)>]},
                  ...]}

``workers`` has one entry per worker (one for ``num_workers=0``), in worker order; ``next_worker``
is the worker whose batch comes next in torch's round-robin; ``delivered`` counts the batches this
rank handed to the caller in the epoch (before state version 3 it was the state's ``position``,
which now means global samples of map-style data only). ``iterator`` and ``dry`` are new in state
version 2, ``self_iterator`` and ``before_epoch`` later in version 2, ``own`` in version 3; an entry
without them reads as ``None``, ``False`` and ``[]``.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from loader_resume.state import StateError
from loader_resume.streams.stream_tasks import WorkerMeta
from loader_resume.streams.stream_worker import Progress

__all__ = ["SavedStream", "StreamPass", "parse_stream", "stream_to_dict"]

logger = logging.getLogger(__name__)
HISTORY = 8


@dataclass(slots=True)
class StreamPass:
    """One ``iter()`` over an iterable dataset, as delivered to the caller so far."""

    epoch: int
    progress: list[Progress]
    next_worker: int
    delivered: int = 0
    done: bool = False
    lives_on: bool = False
    """Its dataset copies live on into the next pass (``num_workers=0`` or persistent workers, at
    its ``iter()``)."""
    history: deque[tuple[int, Progress, int, bool]] = field(
        default_factory=lambda: deque(maxlen=HISTORY)
    )
    """What each of the last deliveries replaced, and whether it was a batch, to rewind (see
    ``rewound``)."""

    def deliver(self, meta: WorkerMeta, *, batch: bool = True) -> None:
        """Record a batch handed to the caller, or (``batch=False``) a worker's end-of-stream
        progress."""
        worker, progress = meta
        self.history.append((worker, self.progress[worker], self.next_worker, batch))
        self.progress[worker] = progress
        self.next_worker = (worker + 1) % len(self.progress)
        self.delivered += batch

    def rewound(self, batches: int) -> StreamPass:
        """This pass as it was ``batches`` deliveries ago (frameworks that fetch ahead need it)."""
        recorded = sum(batch for *_, batch in self.history)
        if batches > recorded:
            raise ValueError(f"batches_ago={batches}: only the last {recorded} deliveries of this "
                             f"pass can be rewound (at most {HISTORY})")
        past = StreamPass(
            self.epoch, list(self.progress), self.next_worker, self.delivered - batches
        )
        past.history = copy.copy(self.history)
        undone = 0
        # end-of-stream records after the batch rewound to are undone with it
        while undone < batches:
            worker, progress, next_worker, batch = past.history.pop()
            past.progress[worker], past.next_worker = progress, next_worker
            undone += batch
        return past


def stream_to_dict(rank: int, pass_: StreamPass) -> dict[str, Any]:
    workers = [
        {
            "batches": p.batches,
            "items": p.items,
            "state": p.state,
            "iterator": p.iterator,
            "dry": p.ended,
            "self_iterator": p.self_iterator,
            "before_epoch": p.before_epoch,
            "own": list(p.own),
        }
        for p in pass_.progress
    ]
    return {
        "rank": rank,
        "next_worker": pass_.next_worker,
        "delivered": pass_.delivered,
        "workers": workers,
    }


class SavedStream(NamedTuple):
    """A saved ``"stream"`` value, validated."""

    progress: list[Progress]
    """Each worker's progress, in worker order."""
    next_worker: int
    delivered: int


def parse_stream(saved: Any, rank: int) -> SavedStream:
    """The validated ``SavedStream`` of a saved ``"stream"`` value."""
    if not isinstance(saved, Mapping) or set(saved) != {
        "rank",
        "next_worker",
        "delivered",
        "workers",
    }:
        raise StateError("stream", saved, "a dict with keys rank, next_worker, delivered, workers",
                         "The state was edited or corrupted.")
    if saved["rank"] != rank:
        raise StateError(
            "stream.rank",
            saved["rank"],
            repr(rank),
            "This is another rank's state: give each rank its own (see loader_resume.distributed).",
        )
    workers = saved["workers"]
    if type(workers) is not list or not workers:
        raise StateError("stream.workers", workers, "a non-empty list")
    progress = [_parse_worker(i, entry) for i, entry in enumerate(workers)]
    next_worker = saved["next_worker"]
    if type(next_worker) is not int or not 0 <= next_worker < len(progress):
        raise StateError("stream.next_worker", next_worker, f"an int in [0, {len(progress)})")
    delivered = saved["delivered"]
    if type(delivered) is not int or delivered < 0:
        raise StateError("stream.delivered", delivered, "an int >= 0")
    return SavedStream(progress, next_worker, delivered)


def _parse_worker(index: int, entry: Any) -> Progress:
    where = f"stream.workers[{index}]"
    if not isinstance(entry, Mapping) or not _WORKER_KEYS_V1 <= set(entry) <= _WORKER_KEYS:
        raise StateError(where, entry, f"a dict with keys {', '.join(sorted(_WORKER_KEYS_V1))} and "
                         f"optionally {', '.join(sorted(_WORKER_KEYS - _WORKER_KEYS_V1))}")
    for key in ("batches", "items"):
        if type(entry[key]) is not int or entry[key] < 0:
            raise StateError(f"{where}.{key}", entry[key], "an int >= 0")
    dry = entry.get("dry", False)  # absent only in a version-1 entry (checked above)
    if type(dry) is not bool:
        raise StateError(f"{where}.dry", dry, "a bool")
    flags = {}
    for key in ("self_iterator", "before_epoch"):
        flags[key] = entry.get(key, False)
        if type(flags[key]) is not bool:
            raise StateError(f"{where}.{key}", flags[key], "a bool")
    own = entry.get("own", [])
    if type(own) is not list or not all(type(name) is str for name in own):
        raise StateError(f"{where}.own", own, "a list of attribute names")
    return Progress(
        entry["batches"],
        entry["items"],
        entry["state"],
        entry.get("iterator"),
        dry,
        **flags,
        own=tuple(own),
    )


_WORKER_KEYS_V1 = frozenset({"batches", "items", "state"})
_WORKER_KEYS = _WORKER_KEYS_V1 | {"iterator", "dry", "self_iterator", "before_epoch", "own"}
