"""Every place where the package relies on torch's private names, each behind a name here and pinned
by a test (``tests/workers/test_torch_internals.py``); ``tests/test_architecture.py`` keeps every
other module off them. The one other reliance on torch beyond its public API names nothing private:
``loader_resume.keyed.rng_memory`` copies the CPU generator's state as memory where a probe at
import finds the layout it expects (and falls back to ``get_state``/``set_state`` where it does not:
``tests/keyed/test_lazy_keying.py`` pins both).

``IndexHooks``: torch's DataLoader asks the loader object for ``_index_sampler`` (what its iterators
draw index lists from) and ``_auto_collation`` (whether items are fetched as lists and collated); a
subclass of it answers through ``IndexHooks._index_lists`` and ``IndexHooks._fetches_lists``.

``is_map_style``, ``forget_persistent_iterator`` (the next ``iter()`` starts workers afresh),
``wrap_fetcher`` (a single-process iterator's map-style fetcher, wrapped), ``set_past_guard`` (a
write DataLoader refuses after construction — ``dataset`` — or into the frozen ``WorkerInfo``).

``next_batch``: torch's ``_BaseDataLoaderIter.__next__`` opens a ``record_function`` profiler range
around every batch, whether or not a profiler is recording (~10 µs a batch on 2 vCPUs: an operator
dispatch to enter it, one to leave). While none records, the loader runs the same steps without the
range; while one does (``torch.profiler``, ``torch.autograd.profiler``, NVTX/ITT emission), it calls
torch's own ``__next__``, so traces show the DataLoader ranges as before.

``next_numbered``: with ``in_order=False``, which index list of the pass a delivered batch was made
from. ``caps_worker_tasks``: whether torch's multi-process iterator caps each worker's index lists
in flight (the cap ``in_order=False`` needs: torch >= 2.7).

``fetch_items``: a worker that must read a batch again (``worker_fetch.WorkerFetch``) reads its
items as torch's map-style fetcher does, which it cannot reach from the worker loop.

``starts_workers`` (whether an ``iter()`` starts workers), ``forks_workers`` (whether by ``fork``),
``worker_processes`` (a multi-process iterator's worker processes), ``kill_workers`` (some of them,
then the iterator shut down) and ``closing_feeder_threads`` (the feeder threads of
``multiprocessing`` queues that were closed and are stopping: the standard library's own private
names, for ``worker_start``).

``random_sampler_num_samples`` (whether a ``RandomSampler`` was given ``num_samples``) and
``default_store`` (the default process group's key-value store, which has no public accessor).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing import queues
from typing import Any, Final, TypeVar

from torch._C._autograd import _profiler_enabled
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
    _DatasetKind,
    _MultiProcessingDataLoaderIter,
)

__all__ = [
    "IndexHooks",
    "caps_worker_tasks",
    "closing_feeder_threads",
    "default_store",
    "fetch_items",
    "forget_persistent_iterator",
    "forks_workers",
    "is_map_style",
    "kill_workers",
    "next_batch",
    "next_numbered",
    "random_sampler_num_samples",
    "shut_down_workers",
    "set_past_guard",
    "starts_workers",
    "worker_processes",
    "wrap_fetcher",
]

T = TypeVar("T")


class IndexHooks(DataLoader[T]):
    """A ``DataLoader`` whose iterators take their index lists, and whether to fetch lists, from the
    subclass."""

    def _index_lists(self) -> Any:
        """What torch's iterators draw index lists (or single indices) from."""
        return DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]

    def _fetches_lists(self) -> bool:
        """Whether torch's iterators fetch items through lists of indices and collate them."""
        return bool(DataLoader._auto_collation.fget(self))  # type: ignore[attr-defined]

    @property
    def _index_sampler(self) -> Any:
        return self._index_lists()

    @property
    def _auto_collation(self) -> bool:
        return self._fetches_lists()


def is_map_style(loader: DataLoader[Any]) -> bool:
    """Whether torch reads ``loader``'s dataset by index (else it iterates it)."""
    return bool(loader._dataset_kind == _DatasetKind.Map)


def forget_persistent_iterator(loader: DataLoader[Any]) -> None:
    """Drop the iterator ``persistent_workers`` keeps: the next ``iter()`` starts its workers
    afresh."""
    loader._iterator = None


def wrap_fetcher(iterator: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace a single-process iterator's map-style fetcher (``_dataset_fetcher``) with
    ``wrap(fetcher)``."""
    iterator._dataset_fetcher = wrap(iterator._dataset_fetcher)


def set_past_guard(target: Any, name: str, value: Any) -> None:
    """Set an attribute torch guards: a ``DataLoader``'s ``dataset`` after construction, or a field
    of the frozen ``WorkerInfo`` (a frozen dataclass in torch 2.13, a class guarding ``__setattr__``
    before)."""
    object.__setattr__(target, name, value)

_TORCH_NEXT: Final = _BaseDataLoaderIter.__next__
_STEPS: Final = {"record_function", "_sampler_iter", "_reset", "_next_data", "_num_yielded",
                 "_IterableDataset_len_called"}
_SAME_STEPS: Final = _STEPS <= set(_TORCH_NEXT.__code__.co_names)
"""torch's ``__next__`` is still made of the steps below (else ``next_batch`` always calls it)."""


def next_batch(iterator: Any) -> Any:
    """``next(iterator)`` for one of torch's DataLoader iterators, without the profiler range while
    no profiler records (the steps of torch's ``_BaseDataLoaderIter.__next__``: reset if needed,
    next data, count; an iterable dataset whose ``len()`` was asked keeps torch's own path for its
    length warning)."""
    if (not _SAME_STEPS or _profiler_enabled() or type(iterator).__next__ is not _TORCH_NEXT
            or iterator._IterableDataset_len_called is not None):
        return next(iterator)
    if iterator._sampler_iter is None:
        iterator._reset()
    data = iterator._next_data()
    iterator._num_yielded += 1
    return data


def next_numbered(iterator: Any) -> tuple[int, Any]:
    """``(number, batch)``: the next batch of a multi-process iterator built with ``in_order=False``
    and the number of the index list it was made from (torch numbers the lists it takes from the
    sampler 0, 1, ... per pass, and keeps the numbers of those in flight as ``_task_info``'s keys:
    the one that leaves is the batch's)."""
    before = set(iterator._task_info)
    batch = next_batch(iterator)
    (number,) = before - iterator._task_info.keys()
    return number, batch


def caps_worker_tasks() -> bool:
    """Whether torch's multi-process iterator, with ``in_order=False``, gives a worker a new index
    list only while it holds fewer than its share of those in flight (``_workers_num_tasks``, torch
    >= 2.7). torch 2.6 hands the lists to the workers in turn however many each holds: a worker held
    up by a slow batch collects every list in flight (``prefetch_factor * num_workers``), and the
    other batches wait for it as they would in order."""
    return "_workers_num_tasks" in _MultiProcessingDataLoaderIter._try_put_index.__code__.co_names


def fetch_items(dataset: Any, indices: Any) -> Any:
    """The items torch's map-style fetcher reads for a batch's index list (auto-collation, before
    the collate): ``dataset.__getitems__(indices)`` where the dataset defines it, else ``[dataset[i]
    for i in indices]``."""
    if hasattr(dataset, "__getitems__") and dataset.__getitems__:
        return dataset.__getitems__(indices)
    return [dataset[index] for index in indices]


def starts_workers(loader: DataLoader[Any]) -> bool:
    """Whether ``iter(loader)`` starts worker processes (not when ``persistent_workers`` keeps a
    pool)."""
    return loader.num_workers > 0 and (not loader.persistent_workers or loader._iterator is None)


def forks_workers(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s workers start by ``fork`` (its ``multiprocessing_context``, else the
    default one)."""
    context = loader.multiprocessing_context
    method = (
        context.get_start_method() if context is not None else multiprocessing.get_start_method()
    )
    return method == "fork"


def worker_processes(iterator: Any) -> list[Any]:
    """The worker processes of one of torch's DataLoader iterators (none for a single-process
    one)."""
    return list(getattr(iterator, "_workers", ()))


def shut_down_workers(iterator: Any) -> None:
    """Stop the worker processes of one of torch's DataLoader iterators (or of a ``PassIterator``,
    which passes the call on) now, not whenever the iterator is collected; a single-process
    iterator has none."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def kill_workers(iterator: Any, pids: list[int]) -> None:
    """Kill these workers of a multi-process iterator (SIGKILL) and shut the iterator down, without
    torch's SIGCHLD handler reporting them as failed (it would raise its own error in their
    place)."""
    if iterator._worker_pids_set:
        signal_handling._remove_worker_pids(id(iterator))  # type: ignore[attr-defined]
        iterator._worker_pids_set = False
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    iterator._shutdown_workers()


def closing_feeder_threads() -> list[threading.Thread]:
    """The feeder threads of ``multiprocessing`` queues that were closed (the sentinel ``close()``
    puts in their buffer is there, or they have closed their reader on their way out) and are still
    alive."""
    found = []
    for thread in threading.enumerate():
        if thread.name != "QueueFeederThread" or not thread.is_alive():
            continue
        arguments: tuple[Any, ...] | None = getattr(thread, "_args", None)
        # NOTE: Thread.run deletes its arguments as it returns: this one is on its way out
        if arguments is None:
            found.append(thread)
            continue
        if len(arguments) < 5:
            continue
        buffer, reader_close = arguments[0], arguments[4]
        closing = getattr(getattr(reader_close, "__self__", None), "closed", False)
        sentinel = queues._sentinel  # type: ignore[attr-defined]
        if closing or any(item is sentinel for item in tuple(buffer)):
            found.append(thread)
    return found


def random_sampler_num_samples(sampler: Any) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was built with (``None``: its data source's length,
    the default); its public ``num_samples`` answers the length either way."""
    return sampler._num_samples  # type: ignore[no-any-return]


def default_store() -> Any:
    """The default process group's key-value store (torch's
    ``distributed_c10d._get_default_store``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
