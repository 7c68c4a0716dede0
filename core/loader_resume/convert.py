"""Turn a plain ``torch.utils.data.DataLoader`` into an equivalent ``ResumableDataLoader``.

Used by the framework integrations (which receive the user's plain loaders) and by ``loader-resume
check``. Every DataLoader setting is kept, and so is the sampler's shuffle choice; a custom sampler
or batch sampler is kept as it is. Under DDP the sampler is expressed as a ``DistributedSampler``
(DataLoader's own samplers) or a ``ShardedSampler`` (custom ones), which the loader turns into its
own sharding — and which tells frameworks that inject samplers that the loader is already sharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
)

from loader_resume.distributed import check_same_dataset
from loader_resume.job.preemption import IgnoreSignalsInWorker
from loader_resume.keyed.keyed_rng import GENERATORS
from loader_resume.loader import ResumableDataLoader
from loader_resume.order.sampler import ShardedSampler, torch_order
from loader_resume.workers.worker_transport import BY_VALUE_BYTES

__all__ = ["resumable", "sharded_resumable"]

L = TypeVar("L", bound=ResumableDataLoader[Any])


def resumable(
    loader: DataLoader[Any],
    *,
    seed: int = 0,
    keying: str = "batch",
    keyed_generators: Sequence[str] = GENERATORS,
    num_workers: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    ignore_signals: Sequence[int] = (),
    loader_class: type[L] = ResumableDataLoader,  # type: ignore[assignment]
    distributed: bool = False,
    audit: str | None = None,
) -> L:
    """``loader`` as a ResumableDataLoader (one of ``loader_class`` is returned as it is, unless
    another ``num_workers``, rank or world size is asked for: then it is rebuilt with them).

    Args:
        num_workers: override the loader's worker count (``loader-resume check`` varies it).
        rank, world_size: shard for this rank (``world_size > 1``); default: no sharding of our own.
        ignore_signals: signals its DataLoader workers ignore (the main process alone decides when
            to stop; the integrations' preemption signals), set before the loader's own
            ``worker_init_fn`` runs.
        loader_class: build this ``ResumableDataLoader`` subclass; a ResumableDataLoader of another
            class is rebuilt as one, keeping its seed, keying, keyed generators and
            ``by_value_bytes``.
        distributed: express the sharding as a ``DistributedSampler`` for one rank too (a framework
            that puts one on any loader without it, as Lightning does under a parallel strategy of
            one process).
        audit: the ``audit=`` of the loader built (given, a ResumableDataLoader is rebuilt with it).
    """
    same_build = (num_workers is None or num_workers == loader.num_workers) and world_size is None
    if isinstance(loader, loader_class) and same_build and audit is None:
        return loader
    by_value_bytes = BY_VALUE_BYTES
    if isinstance(loader, ResumableDataLoader):
        seed, keying, keyed_generators = loader.seed, loader.keying, loader.keyed_generators
        by_value_bytes = loader.by_value_bytes
    custom_batches = (
        loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler
    )
    sampler = (
        None if custom_batches or isinstance(loader.dataset, IterableDataset) else loader.sampler
    )
    if sampler is not None and world_size is not None and (world_size > 1 or distributed):
        sampler = _sharded(loader, sampler, seed, rank or 0, world_size)
    workers = loader.num_workers if num_workers is None else num_workers
    init = (
        IgnoreSignalsInWorker(ignore_signals, loader.worker_init_fn)
        if ignore_signals
        else loader.worker_init_fn
    )
    return loader_class(
        loader.dataset,
        batch_size=None if custom_batches else loader.batch_size,
        sampler=sampler,
        batch_sampler=loader.batch_sampler if custom_batches else None,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=False if custom_batches else loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=init if workers else None,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers and workers > 0,
        pin_memory_device=loader.pin_memory_device,
        in_order=getattr(loader, "in_order", True),
        seed=seed,
        keying=keying,
        keyed_generators=keyed_generators,
        rank=None if world_size is None else rank,
        world_size=world_size,
        by_value_bytes=by_value_bytes,
        audit=audit,
    )


def _sharded(loader: DataLoader[Any], sampler: Any, seed: int, rank: int, world_size: int) -> Any:
    shuffle = torch_order(sampler, loader.dataset)
    if shuffle is None:
        return ShardedSampler(sampler, loader.dataset, num_replicas=world_size, rank=rank)
    return DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                              shuffle=shuffle, seed=seed, drop_last=loader.drop_last)


def sharded_resumable(
    loader: DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    loader_class: type[L],
    seed: int,
    keying: str,
    keyed_generators: Sequence[str],
    ignore_signals: Sequence[int],
    audit: str | None = None,
) -> L:
    """``resumable`` for a framework's process ``rank`` of ``world_size``, the ranks' datasets
    compared (``distributed.check_same_dataset``: a collective, every rank calls it)."""
    ours = resumable(loader, seed=seed, keying=keying, keyed_generators=keyed_generators,
                     rank=rank, world_size=world_size, ignore_signals=ignore_signals,
                     loader_class=loader_class, audit=audit)
    check_same_dataset(ours)
    return ours
