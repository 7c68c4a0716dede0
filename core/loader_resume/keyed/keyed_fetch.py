"""Where keys are applied in the main process: the fetch of a batch at ``num_workers=0``.

torch's single-process iterator fetches each index list right after drawing it from the loader's
plan (``NextFetch`` records its key's parts); ``KeyedFetch`` wraps torch's fetcher, seeds the
generators the dataset draws from and gives the caller's generators back. In a worker, keys are
applied as the list arrives: ``loader_resume.keyed.worker_fetch``. How keys are derived and
generators seeded is ``loader_resume.keyed.keyed_rng``.
"""

from __future__ import annotations

import logging
from typing import Any

from loader_resume.keyed.keyed_rng import TORCH, DrawnGenerators, KeysUnder, seed_generators
from loader_resume.keyed.rng_memory import generator_states
from loader_resume.keyed.worker_fetch import KeySpec, check_read_again

__all__ = ["KeyedFetch", "NextFetch"]

logger = logging.getLogger(__name__)


class NextFetch:
    """``num_workers=0``, per-batch keying: the index list torch's single-process iterator fetches
    next, and its key's parts (the list itself carries nothing: no key is derived for a batch
    nothing is seeded for).

    torch's single-process iterator fetches each list right after drawing it from the loader's index
    plan, which records it here as it hands it out (``KeyedFetch`` checks it is the same list
    object).
    """

    __slots__ = ("indices", "keys", "mask", "position")

    def __init__(self) -> None:
        self.indices: Any = None
        self.keys: KeysUnder | None = None
        self.position = self.mask = 0

    def record(self, indices: Any, keys: KeysUnder, position: int, mask: int) -> None:
        """``indices`` is handed out next; its key is ``keys(position)``."""
        self.indices, self.keys, self.position, self.mask = indices, keys, position, mask


class KeyedFetch:
    """The main process's fetch of a keyed batch (``num_workers=0``): the caller's generators stay
    as they were, and only the generators the dataset draws from are seeded.

    Wraps torch's fetcher. Before the fetch, the generators' states are copied (as memory,
    ``loader_resume.keyed.rng_memory``); the generators the dataset is known to draw from
    (``DrawnGenerators``; at a loader's first keyed fetch, all of them), and torch's always
    (datasets read ``torch.initial_seed()`` to derive generators of their own), are seeded with the
    batch's key. After it, the generators not seeded are compared with those copies: one that moved
    means the dataset drew from the caller's generator, so its state is put back, it is learned as
    drawn, and the fetch is done again, seeded (values are then the batch key's, as if it had been
    seeded from the start). Finally every seeded generator gets the caller's state back. A dataset
    that draws no random number thus pays a copy of three small blocks of memory a batch, torch's
    seeding and a comparison of the other two; one that draws pays a second read of one batch, once
    per generator it first draws from after the loader's first batch.
    """

    __slots__ = ("_drawn", "_fetcher", "_next")

    def __init__(self, fetcher: Any, drawn: DrawnGenerators, next_fetch: NextFetch | None) -> None:
        self._fetcher, self._drawn, self._next = fetcher, drawn, next_fetch

    # torch's fetcher's own attributes (dataset, collate_fn, ...)
    def __getattr__(self, name: str) -> Any:
        if name == "_fetcher":
            raise AttributeError(name)
        return getattr(self._fetcher, name)

    def fetch(self, indices: Any) -> Any:
        slot = self._next
        if slot is not None and slot.indices is indices:
            slot.indices = None
            return self._keyed(indices, slot.mask, slot.keys, slot.position)
        spec: KeySpec | None = getattr(indices, "spec", None)
        if spec is None or not spec.mask:
            return self._fetcher.fetch(indices)
        if spec.sample_base is not None:  # each item is seeded again as the list is iterated
            return self._seeded(indices, spec.key, spec.mask)
        return self._keyed(indices, spec.mask, None, spec.key)

    def _seeded(self, indices: Any, key: int, mask: int) -> Any:
        states = generator_states()
        caller = states.take()
        try:
            seed_generators(key, mask)
            return self._fetcher.fetch(indices)
        finally:
            states.put(caller, mask)

    def _keyed(self, indices: Any, mask: int, keys: KeysUnder | None, position: int) -> Any:
        """Fetch ``indices`` keyed by ``keys(position)`` (``keys`` None: ``position`` is the
        key)."""
        drawn = self._drawn
        if not drawn.learned:
            return self._learn(indices, position if keys is None else keys(position), mask)
        states = generator_states()
        caller = states.take()
        # NOTE: torch's generator is seeded for every batch all the same: torch.initial_seed(),
        # which datasets read (without drawing) to derive their own generators from, must report the
        # batch's key, and a draw inside torch.random.fork_rng() leaves the state as it found it (it
        # would look undrawn).
        seeded = (drawn.mask | TORCH) & mask
        key: int | None = None
        # a read again: the marks of the generators it seeded anew
        again: tuple[tuple[Any, ...], int] | None = None
        try:
            while True:
                if seeded:
                    if key is None:
                        key = position if keys is None else keys(position)
                    seed_generators(key, seeded)
                    if again is not None:
                        again = (states.marks(again[1]), again[1])
                unseeded = mask & ~seeded
                try:
                    data = self._fetcher.fetch(indices)
                except Exception:
                    # NOTE: the dataset may have raised because of what it drew unkeyed: read it
                    # again, keyed, as a fetch seeded in full would have (if that raises, the
                    # exception is the batch's own)
                    if not unseeded or not (strays := states.changed(caller, unseeded)):
                        raise
                else:
                    if again is not None:
                        check_read_again(states, *again)
                    if not unseeded or not (strays := states.changed(caller, unseeded)):
                        return data
                logger.debug(
                    "the dataset drew from generator(s) %d unkeyed: fetching the batch again, "
                    "keyed",
                    strays,
                )
                states.put(caller, strays)
                drawn.mask |= strays
                seeded |= strays
                again = ((), strays)
        finally:
            if seeded:
                states.put(caller, seeded)

    def _learn(self, indices: Any, key: int, mask: int) -> Any:
        """A loader's first keyed fetch: every keyed generator seeded; those that move are the ones
        drawn from."""
        states = generator_states()
        caller = states.take()
        try:
            seed_generators(key, mask)
            keyed = states.take()
            data = self._fetcher.fetch(indices)
            drawn = self._drawn
            drawn.learned, drawn.mask = True, states.changed(keyed, mask)
            return data
        finally:
            states.put(caller, mask)
