"""``ResumableDataLoader``: a drop-in ``torch.utils.data.DataLoader`` that resumes exactly.

A real ``DataLoader`` subclass: torch's iterators, workers and pin-memory thread run unchanged. Two
points of torch are taken over on the loader object (``IndexHooks``): torch's iterator draws index
lists from the loader's ``Position``, and map-style data is fetched as lists so each can key the
RNGs (``keyed_fetch``). Batches are counted as *handed to the caller* (prefetching never skews the
position); what a delivered batch means is the position's (``map_position``, ``stream_position``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import Dataset, default_collate, default_convert

from loader_resume.audit.log import record_state, state_digest
from loader_resume.distributed import rank_and_world
from loader_resume.identity import ENDED_PASS, StateIdentity
from loader_resume.job.preemption import held_while_forking
from loader_resume.keyed.keyed_fetch import KeyedFetch
from loader_resume.keyed.keyed_rng import GENERATORS, CallerRng, DrawnGenerators, derive_key
from loader_resume.load_warnings import LoadWarnings
from loader_resume.order.map_position import MapPosition
from loader_resume.order.sampler import default_seed
from loader_resume.pass_notes import PassNotes
from loader_resume.position import PassIterator
from loader_resume.settings import positioned, settings
from loader_resume.state import ENDING, check_state
from loader_resume.streams.stream_position import StreamPosition
from loader_resume.thirdparty import refuse_stock_accelerate, warn_at_construction
from loader_resume.workers.torch_internals import (
    IndexHooks,
    forget_persistent_iterator,
    is_map_style,
    set_past_guard,
    wrap_fetcher,
)
from loader_resume.workers.worker_start import WorkerStart
from loader_resume.workers.worker_transport import BY_VALUE_BYTES, by_value_init

__all__ = ["ResumableDataLoader"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


_FIXED = frozenset(
    {"seed", "keying", "keyed_generators", "rank", "world_size", "in_order", "by_value_bytes"}
)
"""Settings read-only after construction (the loader's own, and ``in_order``, which its state
follows)."""


class ResumableDataLoader(IndexHooks[T]):
    """A ``DataLoader`` whose ``state_dict()`` resumes the exact batch sequence, elastically.

    Accepts every ``DataLoader`` argument with the same names, defaults and errors, plus:

    Args:
        seed: decides the shuffle order and every keyed random number. ``None``: the
            ``initial_seed()`` of ``generator`` (or of a ``RandomSampler``'s) when given, else ``0``
            (as ``DistributedSampler``). Loaders iterated together should each have their own (the
            front-ends: ``loader_seed``).
        snapshot_every_n_steps: as torchdata's (None or an int >= 0), ignored: the state is exact at
            every step.
        keying: ``"batch"`` (default) seeds the keyed generators before each batch from ``(seed,
            epoch, the batch's global position)`` (with ``num_workers=0``, only torch's and those
            the dataset is seen to draw from: a batch that first draws from another is read again,
            keyed); ``"sample"`` before each sample from ``(seed, epoch, index)`` (values then also
            survive a change of batch or world size; costs ~8 µs per sample); ``"off"`` leaves every
            generator alone.
        keyed_generators: the global generators keyed, of ``"torch"``, ``"numpy"`` (legacy
            ``np.random``), ``"random"``.
        rank: shard for this rank (with ``world_size``); default from ``torch.distributed`` when
            initialised.
        world_size: shard across so many ranks; default from ``torch.distributed`` when initialised.
        by_value_bytes: tensors up to this size come back from workers by value
            (``worker_transport``); 0: never.
        audit: a directory or fsspec URL where each rank logs every batch and state (``loader-resume
            audit DIR``).

    Semantics: ``state_dict()`` may be called at any time and describes where the next batch comes
    from; after ``load_state_dict(s)`` the next ``iter()`` continues there; without a load each
    ``iter()`` starts a new epoch, as ``DataLoader``. After an epoch's last batch a state resumes at
    the next epoch; after a pass was left early (``break``, an exception) it continues that pass,
    unless ``pass_ended=True``. ``len()``: this rank's batches.
    """

    def __init__(
        self,
        dataset: Dataset[T],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        snapshot_every_n_steps: int | None = 1,
        keying: str = "batch",
        keyed_generators: Sequence[str] = GENERATORS,
        rank: int | None = None,
        world_size: int | None = None,
        by_value_bytes: int = BY_VALUE_BYTES,
        audit: str | os.PathLike[str] | None = None,
    ) -> None:
        unbatched = batch_size is None and batch_sampler is None
        if collate_fn is None:
            collate_fn = default_convert if unbatched else default_collate
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        setup = settings(
            self.dataset, seed=seed if seed is not None else default_seed(generator, sampler),
            keying=keying, keyed_generators=keyed_generators,
            snapshot_every_n_steps=snapshot_every_n_steps, sampler=sampler, batch_size=batch_size,
            unbatched=unbatched, drop_last=drop_last, num_workers=num_workers,
            persistent_workers=persistent_workers, rank=rank, world_size=world_size,
            in_order=in_order, by_value_bytes=by_value_bytes,
        )
        order, self._position = positioned(
            setup, is_map_style(self), sampler, batch_sampler, shuffle, audit
        )
        self._identity = StateIdentity(
            self._position,
            order.name,
            order.shuffle,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )
        # NOTE: how the logs name this loader
        name = f"{type(self).__name__} over {type(self.dataset).__name__}"
        self._loads = LoadWarnings(
            name, self.dataset, seed=setup.seed, keying=setup.keying, owner=weakref.ref(self)
        )
        self._notes = PassNotes(name, self._position)
        # the generators this dataset draws from in this process (num_workers=0)
        self._drawn = DrawnGenerators()
        warn_at_construction(
            dataset, batch_read=self._position.kind == "map" and keying == "sample"
        )

    # seconds a new worker may take to start (``worker_start``); None: wait
    worker_start_timeout: float | None = 120.0
    _torch_building = False  # True while torch's iterator is built (see _building)
    _rest_empty = False  # a loaded state was taken with ending=True: the first iter() is empty

    def _fetches_lists(self) -> bool:
        # NOTE: torch's iterator, built inside `_building`, always fetches through a list of indices
        # (batch_size=None: one index, unwrapped after collate), keyed right before the read. Else
        # DataLoader's answer.
        return self._torch_building or self.batch_sampler is not None

    def _index_lists(self) -> Any:
        return self._position

    @property
    def _is_accelerate_prepared(self) -> bool:
        # NOTE: Accelerate's prepare_data_loader reads this right before it rebuilds a DataLoader
        # into its own, dropping what this loader guarantees: refused there (enable_resume's loaders
        # say True). Its frame:
        reader = sys._getframe(1)
        refuse_stock_accelerate(reader.f_globals.get("__name__"), reader.f_locals.get("self"))
        return False

    def __iter__(self) -> Any:
        setup = self._position.setup
        self._loads.taken_up()
        # a state was taken, the loop said nothing: was it where it leaves?
        if self._notes.taken is not None:
            self._notes.leaving(
                self._identity.at_pass,
                lambda: ResumableDataLoader.state_dict(self, pass_ended=False),
            )
        # NOTE: the saved pass's rest is empty: this iter() ends at once (a pass over)
        if self._rest_empty:
            self._rest_empty = False
            self._identity.pass_began(ENDED_PASS)
            return iter(())
        begun = self._position.begin(self.collate_fn, self.worker_init_fn)
        if begun.restart_workers:
            forget_persistent_iterator(self)
        # NOTE: keyed fetches here: map-style batches by KeyedFetch, streams' with the caller's RNG
        # kept around next()
        by_fetch = setup.fetches_here and isinstance(position := self._position, MapPosition)
        caller = CallerRng(setup.mask) if setup.fetches_here and not by_fetch else None
        by_value_init(begun.attributes, self.worker_init_fn, self.num_workers, setup.by_value_bytes)
        start = WorkerStart(self, begun.attributes)
        with held_while_forking(self.worker_init_fn), self._building(**begun.attributes):
            inner = super().__iter__()
        # NOTE: our signals no longer held (a stuck worker: it raises before the pass is ours)
        start.wait(inner)
        # NOTE: wrap_fetcher calls the lambda at once
        if by_fetch and isinstance(position, MapPosition):
            wrap_fetcher(
                inner, lambda fetcher: KeyedFetch(fetcher, self._drawn, position.next_fetch)
            )
        iterator: PassIterator[T] = PassIterator(self._position, begun.pass_, inner, caller)
        self._loads.iterating(iterator)
        self._identity.pass_began(begun.pass_)
        return iterator

    @contextlib.contextmanager
    def _building(self, **attributes: Any) -> Iterator[None]:
        """Hand torch's iterator our collate/worker_init_fn while it is built, then the user's
        again. NOTE: workers' base seed comes from ``loader.generator`` (else the caller's: dropout
        would shift), keyed by (seed, epoch)."""
        if self.generator is None and self.keying != "off":
            key = derive_key(self.seed, self._position.epoch, "workers")
            attributes["generator"] = torch.Generator().manual_seed(key)
        saved = {name: getattr(self, name) for name in attributes}
        for name, value in attributes.items():
            # NOTE: DataLoader refuses to set `dataset` after __init__
            set_past_guard(self, name, value)
        self._torch_building = True
        try:
            yield
        finally:
            self._torch_building = False
            for name, value in saved.items():
                set_past_guard(self, name, value)

    # --- public state API ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The rank this loader shards for (explicit, else from ``torch.distributed``, else 0)."""
        return rank_and_world(self._position.setup.rank, self._position.setup.world_size)[0]

    @property
    def world_size(self) -> int:
        """The world size this loader shards for (explicit, else from ``torch.distributed``, else
        1)."""
        return rank_and_world(self._position.setup.rank, self._position.setup.world_size)[1]

    @property
    def seed(self) -> int:
        """The seed of the order and of every keyed random number (fixed when the loader is
        built)."""
        return self._position.setup.seed

    @property
    def keying(self) -> str:
        """``"batch"``, ``"sample"`` or ``"off"`` (fixed when the loader is built)."""
        return self._position.setup.keying

    @property
    def keyed_generators(self) -> tuple[str, ...]:
        """The global generators keyed (fixed when the loader is built)."""
        return self._position.setup.generators

    @property
    def by_value_bytes(self) -> int:
        """Tensors up to this size come back from workers by value (fixed when the loader is
        built)."""
        return self._position.setup.by_value_bytes

    def __setattr__(self, name: str, value: Any) -> None:
        # NOTE: as DataLoader refuses `batch_size`: the order, the keys and the state follow the
        # built settings
        if name in _FIXED and "_position" in self.__dict__:
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized "
                "(the order, the random keys and the state follow the value it was built with): "
                f"build a new loader with {name}={value!r}"
            )
        super().__setattr__(name, value)
        # DataLoader lets it change: for the next pass
        if name == "num_workers" and "_position" in self.__dict__:
            self._position.setup = dataclasses.replace(self._position.setup, num_workers=value)

    @property
    def epoch(self) -> int:
        """The epoch a state taken now continues: the pass in flight's (after a ``break`` too), else
        the next one's."""
        return self._position.epoch

    def state_dict(self, *, batches_ago: int = 0, pass_ended: bool | None = None,
                   ending: bool = False) -> dict[str, Any]:
        """The position after the last batch handed to the caller: plain, versioned, < 1 KB. A pass
        in flight, left (``break``, an exception) or not, continues with its very next batch.
        ``pass_ended=True``: the next pass's start instead (a loop that leaves passes on purpose);
        ``False``: continues, said; unsaid, the first state of a pass in flight logs which (once per
        loader). ``batches_ago`` (streams): that many deliveries ago. ``ending=True``: the pass's
        last batch is out and the loop will still end that pass itself (a hand-written loop's
        front-end, at a step boundary inside its last step): after a load, the first ``iter()`` is
        that pass's empty rest (the ``"ending"`` key), the next one the next pass."""
        ended = bool(pass_ended)
        position = self._position
        state = self._identity.for_state(position.state(batches_ago, ended), ended)
        if position.setup.audit is not None:
            record_state(position.setup, "state", state, ended=ended)
        # NOTE: a loaded "ending" no iter() has taken up: still the same
        if ending or self._rest_empty:
            state[ENDING] = True
        # NOTE: per call only a reference kept; the note looks once (see pass_notes)
        elif pass_ended is None:
            self._notes.taken = state
            if not self._notes.said:
                self._notes.first(self._identity.at_pass, state)
        return state

    @property
    def pass_finished(self) -> bool:
        """Whether the pass the last ``iter()`` began is over (its last batch handed out): a pass
        left early is not."""
        return self._identity.at_pass is not None and bool(self._identity.at_pass[0].done)

    @property
    def batches_delivered(self) -> int:
        """Streams: batches handed out in the current pass (what ``batches_ago`` can go back over);
        map-style: 0."""
        return self._position.batches_delivered if isinstance(self._position, StreamPosition) else 0

    def planned_indices(self, *, epoch: int | None = None) -> list[list[Any]]:
        """Map-style: the index lists of the next pass (or of ``epoch`` from its start), read from
        no data."""
        if not isinstance(self._position, MapPosition):
            raise TypeError(
                "planned_indices(): an iterable dataset's order is its own; only map-style data is "
                "planned"
            )
        return self._position.planned(epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next ``iter()``; raises
        [`StateError`][loader_resume.StateError] if not.

        Map-style: world size, batch size, ``num_workers`` and ``drop_last`` may differ from the
        saving run (logged); what the order depends on (dataset length, seed, shuffle, keying) may
        not. Iterable: ``num_workers`` and the world size must match, unless the dataset can
        re-shard (``load_resharded``). Earlier versions' states load. After a state taken with
        ``ending=True`` the first ``iter()`` is empty. A state that would be ignored is warned of
        once per loader and case: loaded while an iterator of this loader is mid-epoch (it goes on),
        or over an earlier state that no ``iter()`` took up."""
        state = self._identity.checked(state_dict)
        record_state(self._position.setup, "load", state_dict)
        self._loads.loading()
        self._notes.taken = None
        self._identity.forget_pass()
        self._position.reset(state)
        self._rest_empty = bool(state.get(ENDING))

    def load_resharded(self, ranks: list[dict[str, Any]]) -> None:
        """Resume a stream saved at another world size from every old rank's state
        (``reshard_states``)."""
        if not isinstance(self._position, StreamPosition):
            raise TypeError(
                "load_resharded(): map-style states load at any world size through "
                "load_state_dict()"
            )
        states = [check_state(state, self._identity.fields()) for state in ranks]
        record_state(
            self._position.setup, "load", {"resharded": [state_digest(state) for state in ranks]}
        )
        self._loads.loading()
        self._identity.forget_pass()
        self._position.reset_resharded(states)
        self._rest_empty = any(state.get(ENDING) for state in states)
