"""``ResumableDataLoader``: a drop-in ``torch.utils.data.DataLoader`` that resumes exactly.

It is a real ``DataLoader`` subclass: torch's own iterators, workers and pin-memory thread run
unchanged. Two points of torch are taken over, both on the loader object: ``_index_sampler`` (where
torch's iterator draws index lists from) returns our position-tracking stream, and map-style data is
always auto-collated so each index list can key the RNGs (see ``keyed_rng``). Batches are counted as
they are *handed to the caller*, so prefetching by workers never skews the saved position.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.dataloader import _DatasetKind

from .distributed import rank_and_world
from .iterable import ENDED, Progress, StreamCollate, StreamSource, Ticket, WorkerInit, WorkerRestore, WorkerSide
from .keyed_rng import GENERATORS, KEYING_MODES, CallerRng, SeedAheadCollate, derive_key, generator_mask
from .sampler import Shard, ShardedSampler, steps_per_epoch, torch_order
from .state import STATE_VERSION, StateError, check_state
from .stream import Pass, Plan, foreign_state_dict, index_lists, is_stateful
from .stream_state import StreamPass, parse_stream, stream_to_dict
from .thirdparty import irreproducible, unrestorable

__all__ = ["ResumableDataLoader"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Unbatch:
    """Collate for ``batch_size=None``: the fetcher hands us a one-index batch; give the item alone."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        return self.collate_fn(items[0])


class _IndexStream:
    """What torch's iterator draws index lists from; one object for the loader's lifetime.

    Holds its loader weakly: torch's iterator holds this object, and a persistent-workers loader holds
    that iterator (see ``stream`` for why a cycle there costs seconds).
    """

    def __init__(self, loader: ResumableDataLoader[Any]) -> None:
        self._loader = weakref.ref(loader)

    def _get(self) -> ResumableDataLoader[Any]:
        loader = self._loader()
        if loader is None:
            raise RuntimeError("the ResumableDataLoader of this index stream no longer exists")
        return loader

    def __iter__(self) -> Iterator[list[Any]]:
        return self._get()._index_lists()

    def __len__(self) -> int:
        return self._get()._batches_per_epoch()


class _WrapsTorch:
    """Our iterators keep torch's reachable, as DataLoader code and tests read it (``_workers``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)


class _Tracked(_WrapsTorch, Generic[T]):
    """Wraps torch's iterator; moves the loader's position as each batch is handed over.

    ``caller`` (keyed, ``num_workers=0``): the caller's generators are saved before torch's iterator
    draws the next index list (which seeds the batch's key, see ``stream.Plan.fetch_here``) and restored
    once after the whole fetch and collate, so model code (dropout) sees its own stream undisturbed.
    """

    __slots__ = ("__weakref__", "_caller", "_inner", "_loader", "_pass")

    def __init__(self, loader: ResumableDataLoader[Any], inner: Iterator[T], pass_: Pass,
                 caller: CallerRng | None = None) -> None:
        self._loader, self._inner, self._pass, self._caller = loader, inner, pass_, caller

    def __iter__(self) -> _Tracked[T]:
        return self

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __next__(self) -> T:
        caller = self._caller
        if caller is not None:
            caller.save()
        try:
            batch = next(self._inner)
        except StopIteration:
            self._loader._pass_ended(self._pass)
            raise
        finally:
            if caller is not None:
                caller.restore()
        self._loader._delivered(self._pass)
        return batch


class _StreamTracked(_WrapsTorch, Generic[T]):
    """Wraps torch's iterator over an iterable dataset: unwraps each batch's worker tag and records it.

    ``caller``: as for :class:`_Tracked`, the caller's generators around each in-process fetch.
    """

    __slots__ = ("__weakref__", "_caller", "_inner", "_loader", "_pass")

    def __init__(self, loader: ResumableDataLoader[Any], inner: Iterator[Any], pass_: StreamPass,
                 caller: CallerRng | None = None) -> None:
        self._loader, self._inner, self._pass, self._caller = loader, inner, pass_, caller

    def __iter__(self) -> _StreamTracked[T]:
        return self

    def __next__(self) -> T:
        caller = self._caller
        if caller is not None:
            caller.save()
        ours = self._pass is self._loader._stream_pass
        try:
            batch, meta = next(self._inner)
            while batch is ENDED:  # a worker's stream ended with nothing left to batch: record, go on
                if ours:
                    self._pass.deliver(meta, batch=False)
                batch, meta = next(self._inner)
        except StopIteration:
            self._loader._stream_ended(self._pass)
            raise
        finally:
            if caller is not None:
                caller.restore()
        if ours:
            self._pass.deliver(meta)
        return batch  # type: ignore[no-any-return]


class ResumableDataLoader(DataLoader[T]):
    """A ``DataLoader`` whose ``state_dict()`` resumes the exact batch sequence, elastically.

    Accepts every ``DataLoader`` argument with the same names, defaults and errors, plus:

    Args:
        seed: decides the shuffle order and every keyed random number. ``None`` means the
            ``initial_seed()`` of ``generator`` (or of a ``RandomSampler``'s generator) when one is
            given, else ``0`` — as with ``DistributedSampler``, the order is reproducible unless you
            pass another seed.
        snapshot_every_n_steps: accepted for torchdata compatibility (None or an int >= 0, as there) and
            ignored: the state is a position, so it is exact at every step for free.
        keying: ``"batch"`` (default) seeds the keyed generators before each batch from
            ``(seed, epoch, the batch's global position)``; ``"sample"`` before each sample from
            ``(seed, epoch, index)`` (values then also survive a change of batch or world size; costs
            ~8 µs per sample); ``"off"`` leaves every generator alone.
        keyed_generators: which global generators are keyed: any of ``"torch"`` (default CPU
            generator), ``"numpy"`` (legacy global ``np.random``) and ``"random"``.
        rank, world_size: shard for this rank; default from ``torch.distributed`` when initialised.

    Semantics (as torchdata's ``StatefulDataLoader``): ``state_dict()`` may be called at any time and
    describes the position after the last batch handed to the caller; after ``load_state_dict(s)``
    the next ``iter()`` continues there; a state taken after an epoch's last batch resumes at the next
    epoch's first batch. Without a load, each ``iter()`` starts a new epoch, as with ``DataLoader``.
    ``len(loader)`` is this rank's batches in a whole epoch.
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
    ) -> None:
        unbatched = batch_size is None and batch_sampler is None
        if collate_fn is None:
            collate_fn = default_convert if unbatched else default_collate
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
            drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        _check_options(in_order, snapshot_every_n_steps, keying)
        self.seed = seed if seed is not None else _default_seed(generator, sampler)
        self.keying = keying
        self.keyed_generators = tuple(keyed_generators)
        self._mask = generator_mask(self.keyed_generators)
        if type(sampler) in (DistributedSampler, ShardedSampler):
            # NOTE: a DistributedSampler (the user's, or the one Lightning injects by rebuilding the
            # loader) becomes our sharded permutation with its rank, world size and drop_last, so it
            # is never applied on top of our own sharding; a ShardedSampler's custom stream likewise.
            rank = sampler.rank if rank is None else rank
            world_size = sampler.num_replicas if world_size is None else world_size
            self._shard_drop_last: bool | None = sampler.drop_last or drop_last
        else:
            self._shard_drop_last = None
        self._rank, self._world = rank, world_size
        rank_and_world(rank, world_size)  # fail at construction on an impossible explicit pair
        self._map = self._dataset_kind == _DatasetKind.Map
        self._source, self._source_name, self._shuffle = _classify(self, sampler, batch_sampler, shuffle)
        self._n = len(dataset) if hasattr(dataset, "__len__") else None
        self._unbatched = unbatched
        self._indices = _IndexStream(self)
        self._epoch, self._position, self._fresh = 0, 0, True
        self._pass: Pass | None = None
        self._sampler_state: Any = None
        self._sampler_state_to_load: Any = None
        self._stream_pass: StreamPass | None = None
        self._stream_restore: tuple[list[Progress], int] | None = None
        self._stream_carry: list[Progress] | None = None  # end-of-epoch states that live on (see _stream_ended)
        self._side = WorkerSide()  # this loader's worker view when num_workers=0
        self._renumbered_workers = False
        self._pool_epoch: int | None = None  # the epoch a persistent map-style worker pool was told
        self._live: weakref.ref[Any] | None = None  # the last iterator handed out (see _note_load)
        self._unused_load = False  # a loaded state no iter() has taken up yet
        self._warned: set[str] = set()
        _warn_at_construction(dataset, batch_read=self._map and keying == "sample")

    # --- torch hooks -----------------------------------------------------------------------------
    _torch_building = False  # True while torch's iterator is built (see _building)

    @property
    def _auto_collation(self) -> bool:
        # NOTE: torch's iterator, built inside `_building`, always fetches through a list of indices, even
        # with batch_size=None (then one index, unwrapped again after collate), because iterating that list
        # in the worker, right before the items are read, is where keyed randomness is applied. Asked
        # anywhere else, the answer is DataLoader's.
        return self._torch_building or self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self._indices

    def __iter__(self) -> Any:
        if not self._fresh:  # the previous pass was abandoned mid-epoch: a new iter() is a new epoch
            self._epoch, self._position = self._epoch + 1, 0
            self._stream_restore = self._stream_carry = None
        if self._position == 0:
            self._read_length()
        self._fresh, self._unused_load = False, False
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        iterator = self._iter_stream() if not self._map else self._iter_map(set_epoch)
        self._live = weakref.ref(iterator)
        return iterator

    def _iter_map(self, set_epoch: Any) -> _Tracked[T]:
        if callable(set_epoch) and self.persistent_workers and self._pool_epoch != self._epoch:
            # NOTE: persistent workers keep the dataset copies they started with; a dataset that is
            # told its epoch gets a fresh pool each epoch, so every worker's copy is told too.
            self._iterator, self._pool_epoch = None, self._epoch
        self._pass = Pass(self._epoch, self._position, self._sampler_state_to_load)
        self._sampler_state_to_load = None
        collate = _Unbatch(self.collate_fn) if self._unbatched else self.collate_fn
        if self._seeds_ahead:
            collate = SeedAheadCollate(collate)
        caller = CallerRng(self._mask) if self._fetches_here else None
        with self._building(collate_fn=collate):
            return _Tracked(self, super().__iter__(), self._pass, caller)

    def _iter_stream(self) -> _StreamTracked[T]:
        workers = max(self.num_workers, 1)
        # NOTE: a carried end-of-epoch state is not loaded into copies that live on (they hold it); it stands
        # for each worker in this pass's state until that worker delivers.
        fresh = self._stream_carry or [Progress() for _ in range(workers)]
        progress, offset = self._stream_restore or (fresh, 0)
        restored, self._stream_restore, self._stream_carry = self._stream_restore is not None, None, None
        self._stream_pass = StreamPass(self._epoch, list(progress), offset, self._position if restored else 0)
        replay = sum(p.items for p in progress if p.needs_replay()) if restored else 0
        if replay:
            _warn_replay(self.dataset, replay)
        collate = StreamCollate(self.collate_fn, unbatch=self._unbatched, drop_last=self.drop_last,
                                batch_size=self.batch_size or 1)
        if self.num_workers == 0:
            self._side.start(self._epoch, 0, progress[0] if restored else None)
            collate.side = self._side
            caller = CallerRng(self._mask) if self._fetches_here else None
            with self._building(collate_fn=collate, dataset=StreamSource(self.dataset, self._side)):
                return _StreamTracked(self, super().__iter__(), self._stream_pass, caller)
        load = restored
        if self.persistent_workers and (restored or self._renumbered_workers):
            # NOTE: restored or renumbered workers must be started afresh: a persistent pool keeps the
            # numbering and the dataset copies it was started with (DataLoader's own `_iterator`). The
            # fresh copies of a renumbered pool are given what the old ones carried out of their last epoch.
            self._iterator = None
            load = restored or any(p.before_epoch for p in progress)
        self._renumbered_workers = offset != 0
        init = WorkerInit(self.worker_init_fn, WorkerRestore(
            self._epoch, offset, tuple(progress) if load else (None,) * workers))
        with self._building(collate_fn=collate, worker_init_fn=init, dataset=StreamSource(self.dataset)):
            return _StreamTracked(self, super().__iter__(), self._stream_pass)

    @contextlib.contextmanager
    def _building(self, **attributes: Any) -> Iterator[None]:
        """Hand torch's iterator our collate/worker_init_fn (and keyed generator) while it is built.

        torch reads them once, when the iterator is created; afterwards the loader's public attributes
        are the user's again. NOTE: torch draws each iterator's worker base seed from
        ``loader.generator`` — the caller's default generator when none was given, which would shift
        the model's dropout stream every epoch; while keyed, it draws from a private generator keyed
        by (seed, epoch) instead, which also makes unkeyed worker generators a function of the epoch.
        """
        if self.generator is None and self.keying != "off":
            attributes["generator"] = torch.Generator().manual_seed(derive_key(self.seed, self._epoch, "workers"))
        saved = {name: getattr(self, name) for name in attributes}
        for name, value in attributes.items():
            object.__setattr__(self, name, value)  # NOTE: DataLoader refuses to set `dataset` after __init__
        self._torch_building = True
        try:
            yield
        finally:
            self._torch_building = False
            for name, value in saved.items():
                object.__setattr__(self, name, value)

    # --- public state API ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The rank this loader shards for (explicit, else from ``torch.distributed``, else 0)."""
        return rank_and_world(self._rank, self._world)[0]

    @property
    def world_size(self) -> int:
        """The world size this loader shards for (explicit, else from ``torch.distributed``, else 1)."""
        return rank_and_world(self._rank, self._world)[1]

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (after a load: the loaded one)."""
        return self._epoch

    def state_dict(self, *, batches_ago: int = 0) -> dict[str, Any]:
        """The position after the last batch handed to the caller: plain, versioned, < 1 KB.

        ``batches_ago`` (iterable datasets, up to 8 within the current pass): the state as it was that
        many deliveries ago — for frameworks that fetch ahead of the step they checkpoint (Lightning
        prefetches one batch from a loader without ``__len__``).
        """
        state = self._identity()
        if self._map:
            if batches_ago:
                raise ValueError(f"batches_ago={batches_ago}: map-style states are exact at the last delivered "
                                 "batch; frameworks do not fetch ahead of sized loaders")
            state.update(epoch=self._epoch, position=self._position)
            state["sampler_state"] = self._current_sampler_state()
            state["dataset_state"] = self.dataset.state_dict() if is_stateful(self.dataset) else None  # type: ignore[attr-defined]
        else:
            stream = self._current_stream()
            stream = stream.rewound(batches_ago) if batches_ago else stream
            rank = self._shard().rank
            state.update(epoch=stream.epoch, position=stream.delivered, stream=stream_to_dict(rank, stream))
        return state

    @property
    def batches_delivered(self) -> int:
        """Iterable datasets: batches handed to the caller in the current pass, the deliveries
        ``state_dict(batches_ago=...)`` can go back over; ``0`` for map-style datasets."""
        return 0 if self._map else self._current_stream().delivered

    def planned_indices(self, *, epoch: int | None = None) -> list[list[Any]]:
        """The index lists the next pass hands torch's fetcher — or, with ``epoch``, that whole epoch's from
        its start — computed without reading any data (``loader-resume check`` compares them)."""
        planned = Pass(self._epoch, self._position, self._sampler_state_to_load) if epoch is None else Pass(epoch, 0)
        saved, self._pass = self._pass, planned
        try:
            return list(self._index_lists(plan_only=True))
        finally:
            self._pass = saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next ``iter()``; raises :class:`StateError` if it cannot.

        Map-style: world size, batch size, ``num_workers`` and ``drop_last`` may differ from the saving
        run (logged); anything the order depends on (dataset length, seed, shuffle, keying) may not.
        Iterable: each worker's position lives in its own dataset copy, so ``num_workers`` and the
        world size must match the saving run.

        A state that would be ignored is named in a warning (once per loader and case): loaded while an
        iterator of this loader is still mid-epoch (that iterator goes on from where it was; the state
        applies from the next ``iter()``), or loaded over an earlier state that no ``iter()`` took up.
        """
        check_state(state_dict, self._identity())
        self._note_load()
        reason = irreproducible(self.dataset)
        if reason is not None:
            logger.warning("resuming %s: the continuation will NOT be bit-identical to the uninterrupted run: %s",
                           type(self.dataset).__name__, reason)
        if not self._map:
            self._load_stream(state_dict)
            return
        self._check_user_state("sampler_state", state_dict["sampler_state"], self._source)
        self._check_user_state("dataset_state", state_dict["dataset_state"], self.dataset)
        if state_dict["dataset_state"] is not None:
            self.dataset.load_state_dict(state_dict["dataset_state"])  # type: ignore[attr-defined]
            self._iterator = None  # persistent workers hold copies of the old dataset: start afresh
        epoch, position = state_dict["epoch"], state_dict["position"]
        if self._source is None and position == self._n:
            epoch, position = epoch + 1, 0
        self._epoch, self._position, self._fresh, self._pass = epoch, position, True, None
        self._sampler_state = self._sampler_state_to_load = state_dict["sampler_state"]

    # --- internals -------------------------------------------------------------------------------
    def _note_load(self) -> None:
        """Warn (once per case) when the state being loaded would be ignored; see ``load_state_dict``."""
        live = self._live() if self._live is not None else None
        if live is not None and not live._pass.done:
            self._warn_here("mid-epoch", "load_state_dict() was called while an iterator of this loader is still "
                            "mid-epoch: that iterator goes on from where it was and ignores the loaded state, which "
                            "takes effect at the next iter(loader). Load before iterating (e.g. before the epoch "
                            "loop) for the loaded position to be the one trained on")
        if self._unused_load:
            self._warn_here("unused", "load_state_dict() was called twice with no iter() in between: the state loaded "
                            "first was never used and is replaced by this one")
        self._unused_load = True

    def _warn_here(self, case: str, message: str) -> None:
        if case not in self._warned:
            self._warned.add(case)
            logger.warning("%s over %s: %s", type(self).__name__, type(self.dataset).__name__, message)

    def _identity(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION, "kind": "map" if self._map else "iterable", "source": self._source_name,
            "dataset_len": self._length() if self._map else None, "seed": self.seed, "shuffle": self._shuffle,
            "keying": self.keying, "keyed_generators": list(self.keyed_generators), "epoch": 0, "position": 0,
            "world_size": rank_and_world(self._rank, self._world)[1], "batch_size": self.batch_size,
            "num_workers": self.num_workers, "drop_last": self.drop_last, "sampler_state": None,
            "dataset_state": None, "stream": None,
        }

    def _current_stream(self) -> StreamPass:
        """The stream position a state taken now describes (see the map-style semantics)."""
        if self._stream_restore is not None:
            progress, next_worker = self._stream_restore
            return StreamPass(self._epoch, list(progress), next_worker, self._position)
        if self._stream_pass is not None and not self._stream_pass.done:
            return self._stream_pass
        fresh = self._stream_carry or [Progress() for _ in range(max(self.num_workers, 1))]
        return StreamPass(self._epoch, list(fresh), 0)

    def _load_stream(self, state: dict[str, Any]) -> None:
        rank, world = rank_and_world(self._rank, self._world)
        if state["world_size"] != world:
            raise StateError("world_size", state["world_size"], repr(world), _RESHARD_HINT)
        progress, next_worker = parse_stream(state["stream"], rank)
        if state["num_workers"] != self.num_workers:
            shards = [p.state if p.batches else None for p in progress]
            progress, next_worker = self._reshard(shards, ("num_workers", state["num_workers"], self.num_workers)), 0
        self._set_stream(state["epoch"], state["position"], progress, next_worker)

    def load_resharded(self, ranks: list[dict[str, Any]]) -> None:
        """Resume an iterable-dataset checkpoint taken at another world size: ``ranks`` holds every old
        rank's state (what ``distributed.load_rank_state`` passes on; see there)."""
        self._note_load()
        shards: list[Any] = []
        for rank, state in enumerate(ranks):
            check_state(state, self._identity())
            progress, _ = parse_stream(state["stream"], rank)
            shards += [p.state if p.batches else None for p in progress]
        progress = self._reshard(shards, ("world_size", len(ranks), self.world_size))
        self._set_stream(ranks[0]["epoch"], 0, progress, 0)

    def _reshard(self, shards: list[Any], change: tuple[str, int, int]) -> list[Progress]:
        """This rank's workers' progress after the dataset re-shards ``shards`` (all old shards' states,
        rank-major; None where a worker had delivered nothing)."""
        reshard = getattr(self.dataset, "reshard_states", None)
        if not callable(reshard):
            field, saved, now = change
            raise StateError(field, saved, repr(now), _RESHARD_HINT)
        workers = max(self.num_workers, 1)
        rank, world = (self.rank, self.world_size) if change[0] == "world_size" else (0, 1)
        states = list(reshard(shards, world * workers))
        if len(states) != world * workers:
            raise ValueError(f"{type(self.dataset).__name__}.reshard_states returned {len(states)} states, "
                             f"expected {world * workers} (one per new worker of every rank)")
        logger.warning("re-sharded %s for %s %d -> %d: delivery continues exactly once as its reshard_states() "
                       "guarantees, but order and keyed values differ from an uninterrupted run",
                       type(self.dataset).__name__, *change)
        return [Progress(0, 0, s) for s in states[rank * workers : (rank + 1) * workers]]

    def _set_stream(self, epoch: int, position: int, progress: list[Progress], next_worker: int) -> None:
        if len(progress) != max(self.num_workers, 1):
            raise StateError("stream.workers", f"{len(progress)} workers",
                             repr(f"{max(self.num_workers, 1)} workers"), "The state was edited or corrupted.")
        stateful = is_stateful(self.dataset)
        for i, p in enumerate(progress):
            if (p.state is not None and not stateful) or (stateful and p.batches > 0 and p.state is None):
                expected = f"the state of {type(self.dataset).__name__}" if stateful else "None"
                raise StateError(f"stream.workers[{i}].state", p.state, expected)
        self._epoch, self._position, self._fresh = epoch, position, True
        self._stream_pass, self._stream_restore, self._stream_carry = None, (progress, next_worker), None

    def _stream_ended(self, pass_: StreamPass) -> None:
        """The pass is over. Where the dataset copies live on into the next epoch (``num_workers=0`` or
        persistent workers), each one's end-of-stream state is carried into the next pass's state: a dataset
        that counts its own epochs, or resets at its end, resumes as that copy would go on. A dataset that is
        its own iterator is re-initialised by ``iter()`` and carries nothing. Fresh workers start from the
        main process's copy, in the uninterrupted run as after a resume, so nothing is carried for them."""
        if pass_ is self._stream_pass and not pass_.done:
            pass_.done = True
            self._epoch, self._position, self._fresh = self._epoch + 1, 0, True
            if self.num_workers == 0 or self.persistent_workers:
                carry = [Progress(state=p.state, before_epoch=True)
                         if p.dry and p.state is not None and not p.self_iterator else Progress()
                         for p in pass_.progress]
                self._stream_carry = carry if any(p.before_epoch for p in carry) else None

    @staticmethod
    def _check_user_state(field: str, saved: Any, owner: Any) -> None:
        stateful = is_stateful(owner)
        if saved is not None and not stateful:
            raise StateError(field, "<a saved state>", repr("None"),
                             f"{type(owner).__name__} has no load_state_dict().")
        if saved is None and stateful:
            raise StateError(field, None, repr(f"the state of {type(owner).__name__}"), "Required state missing.")

    def _length(self) -> int | None:
        """The dataset's length: the one the pass in flight was planned with, else (between passes, as
        ``DataLoader``'s ``len()``) the dataset's length now, since a dataset may grow between epochs."""
        if self._position == 0 and (self._pass is None or self._pass.done or self._fresh):
            self._read_length()
        return self._n

    def _read_length(self) -> None:
        """As DataLoader: a sized dataset's length is read again at each epoch's start (it may grow)."""
        if self._n is not None:
            self._n = len(self.dataset)  # type: ignore[arg-type]

    def _current_sampler_state(self) -> Any:
        if not is_stateful(self._source):
            return None
        if self._sampler_state is None:
            self._sampler_state = self._source.state_dict()
        return self._sampler_state

    def _shard(self) -> Shard:
        rank, world = rank_and_world(self._rank, self._world)
        drop_last = self.drop_last if self._shard_drop_last is None else self._shard_drop_last
        return Shard(rank, world, self.batch_size or 1, drop_last)

    def _batches_per_epoch(self) -> int:
        if not self._map:
            raise TypeError("an IterableDataset's stream has no length for the loader to compute")
        if self._source is None:
            n = self._length()
            assert n is not None  # map-style permutation sources always have a length
            return steps_per_epoch(n, self._shard())
        return steps_per_epoch(len(self._source), self._shard())

    def _delivered(self, pass_: Pass) -> None:
        if pass_ is not self._pass:
            return
        end, last, sampler_state = pass_.pending.popleft()
        self._position, self._sampler_state = end, sampler_state
        if last:
            self._epoch, self._position, self._fresh, pass_.done = self._epoch + 1, 0, True, True

    def _pass_ended(self, pass_: Pass) -> None:
        if pass_ is self._pass and not pass_.done:
            self._epoch, self._position, self._fresh, pass_.done = self._epoch + 1, 0, True, True

    @property
    def _seeds_ahead(self) -> bool:
        """Whether workers seed each next batch ahead (``keyed_rng.SeedAhead``): per-batch keying in workers."""
        return bool(self.num_workers and self.keying == "batch" and self._mask)

    @property
    def _fetches_here(self) -> bool:
        """Whether keyed batches are fetched in this process (seeded here, caller's generators restored)."""
        return bool(self.num_workers == 0 and self.keying != "off" and self._mask)

    def _index_lists(self, *, plan_only: bool = False) -> Iterator[list[Any]]:
        if not self._map:
            return self._tickets()
        pass_ = self._pass if self._pass is not None else Pass(self._epoch, self._position)
        plan = Plan(
            source=self._source, n=self._n, shard=self._shard(), seed=self.seed, shuffle=self._shuffle,
            keying=self.keying, mask=self._mask,
            unit_is_batch=self.batch_sampler is not None and self._source is self.batch_sampler,
            workers=self.num_workers if self._seeds_ahead else 0,
            fetch_here=self._fetches_here and not plan_only,
        )
        return index_lists(plan, pass_)

    def _tickets(self) -> Iterator[Ticket]:
        """Endless tasks for an iterable dataset (torch's own sampler there is endless too)."""
        epoch = self._stream_pass.epoch if self._stream_pass is not None else self._epoch
        stream_key = derive_key(self.seed, epoch, "stream", self._shard().rank)
        mask = 0 if self.keying == "off" else self._mask
        spec = (epoch, stream_key, mask, self.batch_size or 1)
        side = self._side if self.num_workers == 0 else None
        return _endless(spec, side)


def _endless(spec: tuple[int, int, int, int], side: WorkerSide | None) -> Iterator[Ticket]:
    while True:
        yield Ticket(spec, side)


_RESHARD_HINT = (
    "An iterable dataset's position lives in each worker's (and rank's) own copy of the dataset, so it "
    "can only resume with the num_workers and world size it was saved with; or give the dataset a "
    "reshard_states(states, num_shards) method (see README: Iterable datasets) to allow a change "
    "(world size changes go through loader_resume.distributed.load_rank_state)."
)


_WARNED: set[tuple[str, type]] = set()  # (what, dataset class): the warnings given once per class


def _warn_once(what: str, dataset: Any, message: str, *args: Any) -> None:
    if (what, type(dataset)) not in _WARNED:
        _WARNED.add((what, type(dataset)))
        logger.warning(message, *args)


def _warn_at_construction(dataset: Any, *, batch_read: bool) -> None:
    """What this loader cannot do for ``dataset`` as its author may expect: said when the loader is built."""
    name = type(dataset).__name__
    if batch_read and hasattr(dataset, "__getitems__"):
        _warn_once("batch read", dataset,
                   "keying='sample': %s defines __getitems__, so it reads each batch's index list at once. Random "
                   "numbers it draws while iterating that list item by item are keyed per sample; any it draws after "
                   "(a batch transform, as HF datasets' set_transform runs) are keyed by the batch's key, so they "
                   "depend on the batch's composition (batch size, world size). Use keying='batch' to say so "
                   "explicitly, or read items one by one in __getitem__ for per-sample keys.", name)
    foreign = foreign_state_dict(dataset)
    if foreign is not None:
        _warn_once("foreign state", dataset,
                   "%s.%s takes required arguments: it is %s's own resume protocol, not the Stateful protocol "
                   "(state_dict() / load_state_dict(state)) this loader calls. Its position is tracked by the loader "
                   "and restored by replaying items (O(items delivered) per resume), and it is told the epoch through "
                   "set_epoch(). For O(1) resume use that library's own loader.", name, foreign,
                   _defining_library(dataset, "state_dict"))
    reason = unrestorable(dataset)
    if reason is not None:  # NOTE: per loader, not per class: whether it holds depends on the instance
        logger.warning("%s: %s; this loader resumes it by replaying the epoch's delivered items instead "
                       "(exact; costs reading them again at each resume)", name, reason)


def _defining_library(obj: Any, method: str) -> str:
    """The top-level package whose class defines ``obj.method`` (a user's subclass names the library it extends)."""
    owner = next((cls for cls in type(obj).__mro__ if method in vars(cls)), type(obj))
    return owner.__module__.split(".")[0]


def _warn_replay(dataset: Any, items: int) -> None:
    foreign = foreign_state_dict(dataset)
    why = f"has {foreign}, not the Stateful protocol" if foreign else "has no state_dict()"
    logger.warning("%s %s: replaying %d items to resume (they are read and dropped). The continuation is exact "
                   "only if its stream depends on nothing but the epoch it is told through set_epoch() and the "
                   "keyed generators; give it state_dict()/load_state_dict() to resume in O(1)",
                   type(dataset).__name__, why, items)


def _check_options(in_order: bool, snapshot_every_n_steps: int | None, keying: str) -> None:
    if not in_order:
        raise ValueError("in_order=False: batches would arrive out of order, so a saved position could not "
                         "name what was delivered; expected in_order=True")
    if snapshot_every_n_steps is not None and (type(snapshot_every_n_steps) is not int or snapshot_every_n_steps < 0):
        raise ValueError(f"snapshot_every_n_steps={snapshot_every_n_steps!r}: expected None or an int >= 0 "
                         "(as StatefulDataLoader; the state is exact at every step whatever the value)")
    if keying not in KEYING_MODES:
        raise ValueError(f"keying={keying!r}: expected one of {list(KEYING_MODES)}")


def _default_seed(generator: Any, sampler: Any) -> int:
    """``seed=None``: the seed of the generator (or DistributedSampler) that would have shuffled, else 0."""
    if type(sampler) is DistributedSampler:
        return int(sampler.seed)
    if generator is None and type(sampler) is RandomSampler:
        generator = sampler.generator
    return int(generator.initial_seed()) if generator is not None else 0


def _classify(loader: DataLoader[Any], sampler: Any, batch_sampler: Any, shuffle: bool | None) -> tuple[Any, str, bool]:
    """(user source or None for our permutation, its name for the state, shuffle)."""
    if loader._dataset_kind != _DatasetKind.Map:
        return None, "iterable", False
    if batch_sampler is not None:
        return batch_sampler, f"batch_sampler:{_qualname(batch_sampler)}", False
    if type(sampler) is ShardedSampler:
        return sampler.sampler, f"sampler:{_qualname(sampler.sampler)}", False
    if sampler is None:
        return None, "permutation", bool(shuffle)
    shuffle = torch_order(sampler, loader.dataset)
    if shuffle is not None:
        return None, "permutation", shuffle
    if type(sampler) is DistributedSampler:
        return None, "permutation", bool(sampler.shuffle)
    return sampler, f"sampler:{_qualname(sampler)}", False


def _qualname(obj: Iterable[Any]) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
