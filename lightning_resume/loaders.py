"""The training loaders Lightning holds, made resumable wherever they sit in what the module
returned."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from loader_resume import ResumableDataLoader
from loader_resume.distributed import check_same_dataset, load_rank_state
from loader_resume.job.preemption import workers_ignore_signals

__all__ = [
    "TrainingLoaders",
    "drop_lightning_loader_states",
    "evaluation_workers_ignore",
    "intercept",
    "resumable_tree",
]


class TrainingLoaders:
    """One fit's training loaders: made resumable where Lightning holds them (or once the module
    returns them), sharded for the trainer's rank, and given a checkpoint's states as soon as they
    exist.

    ``make_resumable(loader, rank, world_size, distributed, index)`` converts one loader, the
    ``index``-th found (``distributed``: under a parallel strategy, where Lightning would put a
    ``DistributedSampler`` on it).
    """

    def __init__(
        self,
        make_resumable: Callable[[DataLoader[Any], int, int, bool, int], ResumableDataLoader[Any]],
    ) -> None:
        self.loaders: list[ResumableDataLoader[Any]] = []
        """The converted loaders of this fit, in the order their states are saved (empty until
        converted)."""
        self._to_load: list[Any] | None = None
        self._make = make_resumable
        self._shard = (0, 1, False)

    def load(self, saved: list[Any]) -> None:
        """Each loader's gathered states from a checkpoint (``gather_states``): loaded now if the
        loaders exist, else as they are converted.

        NOTE: Lightning restores callbacks' checkpoint state after ``setup``. Loaders handed to
        ``fit()`` directly are converted at ``setup``, so they exist by then; a module's or
        datamodule's ``train_dataloader()`` is called later, and its loaders are converted then.
        """
        self._to_load = saved
        if self.loaders:
            self._apply()

    def state_at_trainer_step(
        self, trainer: Trainer, loader: ResumableDataLoader[Any]
    ) -> dict[str, Any]:
        """The loader's state at the batch the trainer has taken, not the one it prefetched.

        NOTE: Lightning fetches one batch ahead from a training loader without ``__len__`` (to know
        when the epoch ends), so such a loader has delivered one more batch than the trainer used.
        At the epoch's last batch every training loader's pass ends, even one left mid-way
        (``limit_train_batches``, ``CombinedLoader`` ``min_size``, or ``max_size_cycle``'s restarted
        shorter loader): a resumed fit starts the next epoch with one ``iter()`` each, so the state
        is where that pass starts.
        """
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        if trainer.state.fn == "fit" and (
            trainer.is_last_batch or progress.ready == trainer.num_training_batches
        ):
            return loader.state_dict(pass_ended=True)
        # NOTE: done before the epoch (CombinedLoader max_size): empty for the epoch's rest
        if loader.pass_finished:
            return loader.state_dict(pass_ended=False, ending=True)
        # NOTE: mid-epoch (a periodic checkpoint, validation, max_steps, a signal): the pass
        # continues
        if len(self.loaders) != 1 or not isinstance(
            loader.dataset, torch.utils.data.IterableDataset
        ):
            return loader.state_dict(pass_ended=False)
        taken = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return loader.state_dict(
            batches_ago=max(0, loader.batches_delivered - taken), pass_ended=False
        )

    def intercept(self, trainer: Trainer) -> None:
        """Convert the trainer's training loaders now, or wrap the hook that will return them.

        NOTE: sharded as Lightning shards (``distributed_sampler_kwargs``): under a parallel
        strategy every loader gets a ``DistributedSampler``, for one process too (FSDP on one GPU),
        or Lightning would rebuild it with one of its own and iterate a copy whose state we never
        see.
        """
        kwargs = trainer.distributed_sampler_kwargs
        if kwargs is None:
            self._shard = (trainer.global_rank, trainer.world_size, False)
        elif kwargs["num_replicas"] != trainer.world_size:
            raise ValueError(
                f"ResumeCallback under {type(trainer.strategy).__name__}: the data is sharded over "
                f"{kwargs['num_replicas']} data-parallel ranks of {trainer.world_size} processes "
                "(tensor "
                "or model parallelism); expected every process its own shard (data parallel only)"
            )
        else:
            self._shard = (kwargs["rank"], kwargs["num_replicas"], True)
        self.loaders = []
        intercept(trainer.fit_loop._data_source, self.convert)

    def check_iterated(self, trainer: Trainer) -> None:
        """Raise unless the loaders the fit iterates are the ones whose states are saved (a loader
        that Lightning, or another callback, replaced after we converted it would be resumed from a
        state nobody advanced)."""
        combined = trainer.fit_loop._combined_loader
        iterated = [] if combined is None else combined.flattened
        strays = [
            loader for loader in self.loaders if not any(loader is other for other in iterated)
        ]
        if strays:
            raise RuntimeError(
                f"ResumeCallback: the fit iterates {[type(x).__name__ for x in iterated]}, not the "
                f"{len(strays)} resumable training loader(s) it made "
                f"({type(trainer.strategy).__name__}); expected Lightning to keep them, so that "
                "their states are the ones saved"
            )

    def convert(self, loaders: Any) -> Any:
        """``loaders`` (what a module's ``train_dataloader()`` returns) with every DataLoader made
        resumable; a checkpoint's states waiting in ``load`` go into them."""
        converted, self.loaders = resumable_tree(
            loaders, lambda loader, index: self._make(loader, *self._shard, index)
        )
        # Lightning asks for the training loaders on every rank: a collective is safe
        for loader in self.loaders:
            check_same_dataset(loader)
        self._apply()
        return converted

    def _apply(self) -> None:
        if self._to_load is None:
            return
        saved, self._to_load = self._to_load, None
        if len(saved) != len(self.loaders):
            raise ValueError(
                f"the checkpoint holds {len(saved)} training loader states; the module now "
                f"returns {len(self.loaders)} training loaders (expected the same loaders)"
            )
        for loader, gathered in zip(self.loaders, saved, strict=True):
            load_rank_state(loader, gathered)


def intercept(source: Any, transform: Callable[[Any], Any]) -> None:
    """What Lightning's data ``source`` (a loop's ``_DataConnectorSource``) hands its loop, through
    ``transform``: now if it holds the loaders, else each time its hook (``train_dataloader()``...)
    is called."""
    instance = source.instance
    if isinstance(instance, (DataLoader, CombinedLoader, list, tuple, dict)):
        source.instance = transform(instance)
        return
    hook = getattr(instance, source.name, None)
    if hook is None or getattr(hook, "_loader_resume", False) or not source.is_defined():
        # NOTE: a hook the module does not define stays undefined (Lightning then skips that loop)
        return

    @functools.wraps(hook)  # NOTE: Lightning's is_overridden follows __wrapped__
    def transformed() -> Any:
        return transform(hook())

    transformed._loader_resume = True  # type: ignore[attr-defined]
    setattr(instance, source.name, transformed)


def evaluation_workers_ignore(trainer: Trainer, signals: tuple[int, ...]) -> None:
    """The validation loaders of ``fit`` (its sanity check, mid-epoch and end-of-epoch validations):
    their workers ignore ``signals``, as the training loaders' do (``workers_ignore_signals``); the
    loaders stay Lightning's."""
    def guard(loaders: Any) -> Any:
        return resumable_tree(
            loaders, lambda loader, _: workers_ignore_signals(loader, signals), every=True
        )[0]

    intercept(trainer.fit_loop.epoch_loop.val_loop._data_source, guard)


def resumable_tree(
    obj: Any, convert: Callable[[DataLoader[Any], int], Any], every: bool = False,
) -> tuple[Any, list[ResumableDataLoader[Any]]]:
    """``obj`` with every ``DataLoader`` in it made resumable by ``convert(loader, index)``
    (``index``: how many were found before it; one already resumable is kept unless ``every``),
    through ``CombinedLoader``s, dicts, lists and tuples; and those loaders, in the order found (the
    order their states are saved in)."""
    found: list[ResumableDataLoader[Any]] = []

    def walk(value: Any) -> Any:
        if isinstance(value, CombinedLoader):
            value.flattened = [walk(loader) for loader in value.flattened]
            return value
        if isinstance(value, DataLoader):
            loader = (
                value
                if isinstance(value, ResumableDataLoader) and not every
                else convert(value, len(found))
            )
            found.append(loader)
            return loader
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return value

    return walk(obj), found


def drop_lightning_loader_states(checkpoint: dict[str, Any]) -> None:
    """Lightning also saves stateful loaders' states, from rank 0 only; ours (every rank's) replaces
    it."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    if isinstance(fit_loop.get("state_dict"), dict):
        fit_loop["state_dict"]["combined_loader"] = []
