"""``Mixture``: several datasets drawn in proportions that may change during training, resumed
exactly.

The mixture is an endless sequence of samples cut into epochs of ``samples_per_epoch``; global
position ``g = epoch * samples_per_epoch + position``. Its order is a pure function of ``(seed, g,
the weight changes so far)``:

1. The weights in force form segments: segment ``k`` starts at the position of the ``k``-th change
   (segment 0 at 0) and runs to the next change.
2. A segment is cut into blocks of ``block_size`` positions from its start. Each block gives each
   source the same count, the weights' largest-remainder apportionment of ``block_size``:
   proportions are exact per block, not only in expectation. The last block before a change may be
   cut short.
3. A block's slots are assigned to sources by a keyed permutation of the block (``seed``, segment,
   block): a slot's source follows from its permuted value; its rank among that source's slots of
   the block, in slot order, says which of the source's draws it is.
4. Source ``s``'s ``t``-th draw is item ``perm(seed, s, t // len(s))[t % len(s)]``: each source
   walks its own keyed permutation, epoch after epoch of its own. ``t`` counts the draws before the
   block (per segment: full blocks times the count, plus the cut block's) plus the rank.

So resuming at any position costs one bisection over the changes, one block and one chunk of 4096
draws of each source's permutation (vectorised, and kept for the lists that follow: consecutive
positions cost a slice), and the state is the sources' lengths and one entry per change (its start
and weights): JSON.

Under ``ResumableDataLoader``, positions are resolved into ``(source, item)`` keys in the main
process as torch requests each batch, so DataLoader workers only fetch. ``Mixture.set_weights``
takes effect from the first position whose batch has not yet been requested (with ``num_workers=0``:
the next batch; with workers: after the batches torch prefetches). The same calls at the same steps
on every rank give the same position on every rank, and a rerun that makes the same calls continues
as the uninterrupted run. A call made while the last change still lies ahead (not yet requested)
replaces that change: the later call wins from its position.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from loader_resume.order.permutation import KeyedPermutation
from loader_resume.state import StateError
from loader_resume.thirdparty import is_stateful

__all__ = ["Mixture"]

MIXTURE_VERSION = 1
_CHUNK = 4096
"""A source's draws resolved per chunk of this many (its permutation evaluated at once, cached)."""


class Mixture:
    """A map-style dataset drawing from named ``sources`` in proportion to ``weights``; see the
    module docstring.

    ``len(mixture)`` is ``samples_per_epoch`` (default: the sources' total length). Use it with
    ``ResumableDataLoader(mixture, shuffle=False, ...)``: the mixture orders its samples itself.
    Items are the sources' items as they are. ``seed`` chooses the order (the loader's ``seed``
    chooses the batches' keys).
    """

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, float], *, seed: int = 0,
                 block_size: int = 1024, samples_per_epoch: int | None = None) -> None:
        if not sources:
            raise ValueError("Mixture(sources={}): expected at least one dataset")
        self.names = sorted(sources)
        """The sources' names, sorted: the order every computation uses."""
        self.sources = {name: sources[name] for name in self.names}
        self._datasets = [sources[name] for name in self.names]
        self.lengths = [_length(name, sources[name]) for name in self.names]
        for name, value, least in (("block_size", block_size, 1), ("seed", seed, 0)):
            if type(value) is not int or value < least:
                raise ValueError(f"Mixture({name}={value!r}): expected an int >= {least}")
        total = sum(self.lengths) if samples_per_epoch is None else samples_per_epoch
        if type(total) is not int or total < 1:
            raise ValueError(
                f"Mixture(samples_per_epoch={samples_per_epoch!r}): expected an int >= 1"
            )
        self.seed, self.block_size, self.samples_per_epoch = seed, block_size, total
        self._weights = [self._checked(weights, "weights")]
        self._starts = [0]  # segment k starts at global position _starts[k]
        self._drawn = [[0] * len(self.names)]  # draws of each source before segment k
        self._requested = 0  # the first global position not yet requested from the workers
        # per source: its last chunk's items
        self._chunks: dict[int, tuple[int, npt.NDArray[np.int64]]] = {}
        self._resolved_blocks: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self._count_cache: dict[int, npt.NDArray[np.int64]] = {}

    # --- the public API ---------------------------------------------------------------------------
    @property
    def weights(self) -> dict[str, float]:
        """The weights in force for the next position not yet requested."""
        return dict(zip(self.names, self._weights[-1], strict=True))

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New proportions from the first position not yet requested (see the module docstring).
        Call it at the same step on every rank; weights equal to those in force change nothing."""
        new = self._checked(weights, "set_weights")
        if new == self._weights[-1]:
            return
        start = self._requested
        if start <= self._starts[-1]:
            # NOTE: the last change applies from a position not requested yet (two calls before a
            # request, or a change loaded from a state taken while prefetched batches were in
            # flight): the later call wins there
            self._weights[-1] = new
            self._count_cache.pop(len(self._weights) - 1, None)
            self._resolved_blocks.clear()
            return
        self._drawn.append(self._drawn_until(len(self._starts) - 1, start))
        self._starts.append(start)
        self._weights.append(new)
        self._resolved_blocks.clear()  # NOTE: the block the change cuts short was resolved whole

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, key: Any) -> Any:
        """A ``(source index, item index)`` key (what the loader hands the workers), or a position
        of epoch 0."""
        if type(key) is tuple:
            return self._datasets[key[0]][key[1]]
        return self.__getitem__(self.resolve(0, [int(key)])[0])

    def resolve(self, epoch: int, positions: list[int]) -> list[tuple[int, int]]:
        """The ``(source index, item index)`` of each position of ``epoch``. Whole blocks are
        resolved at once and kept, so the lists of consecutive positions a loader hands out cost a
        slice each."""
        base, out = epoch * self.samples_per_epoch, list[tuple[int, int]]()
        count, i = len(positions), 0
        consecutive = count > 0 and positions[-1] - positions[0] == count - 1 and \
            positions == list(range(positions[0], positions[0] + count))
        while i < count:
            g = base + int(positions[i])
            k = bisect.bisect_right(self._starts, g) - 1
            block, slot = divmod(g - self._starts[k], self.block_size)
            sources, items = self._resolved(k, block)
            run = min(count - i, len(sources) - slot) if consecutive else 1
            out.extend(zip(sources[slot:slot + run], items[slot:slot + run], strict=True))
            i += run
        return out

    def requested(self, epoch: int, position: int) -> None:
        """Loader hook: positions before ``position`` of ``epoch`` have been requested (a pass
        begins there, or a batch ending there was handed to torch)."""
        self._requested = epoch * self.samples_per_epoch + position

    def state_dict(self) -> dict[str, Any]:
        """The sources' names and lengths, the weights and their changes (plain JSON), and the own
        state of each source that has one (the Stateful protocol), as a loader saves a dataset's."""
        return {
            "version": MIXTURE_VERSION,
            "sources": dict(zip(self.names, self.lengths, strict=True)),
            "seed": self.seed,
            "block_size": self.block_size,
            "samples_per_epoch": self.samples_per_epoch,
            "changes": [
                [start, list(w)] for start, w in zip(self._starts, self._weights, strict=True)
            ],
            "source_states": {
                name: self.sources[name].state_dict()
                for name in self.names
                if is_stateful(self.sources[name])
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The weights and changes of ``state`` (checked by
        [`check_state`][loader_resume.Mixture.check_state] first)."""
        self.check_state(state)
        states = state["source_states"]
        self._starts, self._weights, self._drawn = [], [], []
        # NOTE: before the rebuild, which reads the counts
        self._count_cache, self._resolved_blocks = {}, {}
        for start, weights in state["changes"]:
            new = self._checked(dict(zip(self.names, weights, strict=True)), "load_state_dict")
            if self._starts:
                self._drawn.append(self._drawn_until(len(self._starts) - 1, start))
            else:
                self._drawn.append([0] * len(self.names))
            self._starts.append(start)
            self._weights.append(new)
        for name, source_state in states.items():
            self.sources[name].load_state_dict(source_state)

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raises [`StateError`][loader_resume.StateError] if ``state`` was saved by another
        mixture: other sources, a source of another length (named), other settings. A loader checks
        it before its own fields."""
        if not isinstance(state, Mapping) or state.get("version") != MIXTURE_VERSION:
            found = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise StateError(
                "dataset_state.version", found, repr(MIXTURE_VERSION), "Not a Mixture state."
            )
        saved = dict(state["sources"])
        if sorted(saved) != self.names:
            raise StateError("dataset_state.sources", sorted(saved), repr(self.names),
                             "The mixture's sources are not the saving run's.")
        for name, length in zip(self.names, self.lengths, strict=True):
            if saved[name] != length:
                raise StateError(
                    f"dataset_state.sources.{name}",
                    saved[name],
                    repr(length),
                    f"Source {name!r} has {length} items; the state was saved with {saved[name]}.",
                )
        for field in ("seed", "block_size", "samples_per_epoch"):
            if state[field] != getattr(self, field):
                raise StateError(f"dataset_state.{field}", state[field], repr(getattr(self, field)),
                                 "The mixture's settings are not the saving run's.")
        states = state["source_states"]
        for name in self.names:
            if is_stateful(self.sources[name]) != (name in states):
                expected = (
                    f"the state of {type(self.sources[name]).__name__}"
                    if name not in states
                    else "none"
                )
                raise StateError(
                    f"dataset_state.source_states.{name}",
                    states.get(name),
                    expected,
                    f"Source {name!r} is not the saving run's (one has a state of its own, one "
                    "not).",
                )

    # --- internals --------------------------------------------------------------------------------
    def _resolved(self, k: int, block: int) -> tuple[list[int], list[int]]:
        """Each position's source and item in block ``block`` of segment ``k`` (cut short at the
        next change)."""
        cached = self._resolved_blocks.get((k, block))
        if cached is not None:
            return cached
        first = self._starts[k] + block * self.block_size
        end = self._starts[k + 1] if k + 1 < len(self._starts) else first + self.block_size
        size = min(self.block_size, end - first)
        sources = self._block_sources(k, block)[:size]
        before = self._drawn[k]
        counts = self._counts(k)
        items = np.empty(size, dtype=np.int64)
        for source, length in enumerate(self.lengths):
            # NOTE: in slot order: the source's draws in this block
            mine = np.flatnonzero(sources == source)
            if not mine.size:
                continue
            width = min(_CHUNK, length)
            draws = np.arange(mine.size, dtype=np.int64) + (
                before[source] + block * int(counts[source])
            )
            epochs, within = np.divmod(draws, length)
            # the source's chunks, numbered across epochs
            chunks = epochs * (-(-length // width)) + within // width
            # NOTE: a source's draws rise in slot order
            for chunk in range(int(chunks[0]), int(chunks[-1]) + 1):
                chosen = chunks == chunk
                items[mine[chosen]] = self._chunk(source, chunk)[within[chosen] % width]
        if len(self._resolved_blocks) >= 4:
            self._resolved_blocks.clear()
        resolved = self._resolved_blocks[(k, block)] = (sources.tolist(), items.tolist())
        return resolved

    def _block_sources(self, k: int, block: int) -> npt.NDArray[np.int64]:
        """Each slot's source in block ``block`` of segment ``k``: the slots, permuted by a keyed
        permutation, are dealt to the sources by their counts."""
        size = self.block_size
        values = KeyedPermutation(size, _key("block", self.seed, k, block))[
            np.arange(size, dtype=np.int64)
        ]
        return np.searchsorted(np.cumsum(self._counts(k)), values, side="right").astype(np.int64)

    def _counts(self, k: int) -> npt.NDArray[np.int64]:
        """Segment ``k``'s count of each source per full block."""
        cached = self._count_cache.get(k)
        if cached is None:
            cached = self._count_cache[k] = np.asarray(
                _apportion(self._weights[k], self.block_size), dtype=np.int64
            )
        return cached

    def _drawn_until(self, k: int, end: int) -> list[int]:
        """Draws of each source before global position ``end`` (in segment ``k``)."""
        blocks, part = divmod(end - self._starts[k], self.block_size)
        counts = self._counts(k).tolist()
        drawn = [
            before + blocks * count for before, count in zip(self._drawn[k], counts, strict=True)
        ]
        if part:
            sources = self._block_sources(k, blocks)[:part]
            for source in range(len(drawn)):
                drawn[source] += int(np.count_nonzero(sources == source))
        return drawn

    def _chunk(self, source: int, chunk: int) -> npt.NDArray[np.int64]:
        """Items of ``source``'s chunk ``chunk``: up to ``_CHUNK`` consecutive draws within one of
        its epochs, the permutation evaluated for all of them at once (draws come in order: one
        evaluation serves many lists)."""
        cached = self._chunks.get(source)
        if cached is not None and cached[0] == chunk:
            return cached[1]
        length = self.lengths[source]
        width = min(_CHUNK, length)
        epoch, part = divmod(chunk, -(-length // width))
        key = _key("source", self.seed, self.names[source], epoch)
        items = KeyedPermutation(length, key)[
            np.arange(part * width, min((part + 1) * width, length), dtype=np.int64)
        ]
        self._chunks[source] = (chunk, items)
        return items

    def _checked(self, weights: Mapping[str, float], call: str) -> list[float]:
        unknown = sorted(set(weights) - set(self.names))
        missing = [name for name in self.names if name not in weights]
        if unknown or missing:
            raise ValueError(
                f"Mixture {call}: unknown source(s) {unknown}, missing {missing}; expected a "
                f"weight for each of {self.names}"
            )
        values = [weights[name] for name in self.names]
        if (
            not all(isinstance(w, int | float) and math.isfinite(w) and w >= 0 for w in values)
            or sum(values) <= 0
        ):
            raise ValueError(
                f"Mixture {call}: weights {dict(weights)}; expected finite numbers >= 0, not all 0"
            )
        return [float(w) for w in values]


def _apportion(weights: list[float], size: int) -> list[int]:
    """``size`` slots in proportion to ``weights``, by largest remainder (ties to the earlier
    source)."""
    total = sum(weights)
    quotas = [w * size / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    return counts


def _key(*parts: Any) -> int:
    digest = hashlib.blake2b(
        "/".join(map(str, ("mixture", *parts))).encode(), digest_size=16
    ).digest()
    return int.from_bytes(digest, "little")


def _length(name: str, source: Any) -> int:
    try:
        length = len(source)
    except TypeError:
        raise TypeError(
            f"Mixture source {name!r} ({type(source).__name__}): expected a map-style dataset with "
            "__len__"
        ) from None
    if length < 1:
        raise ValueError(f"Mixture source {name!r}: empty; expected at least one item")
    return length
