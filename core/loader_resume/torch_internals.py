"""Every place where the package relies on torch's private names, each behind a name here and pinned by a
test (``tests/test_torch_internals.py``); ``tests/test_architecture.py`` keeps every other module off them.
The one other reliance on torch beyond its public API names nothing private: :mod:`loader_resume.rng_memory`
copies the CPU generator's state as memory where a probe at import finds the layout it expects (and falls
back to ``get_state``/``set_state`` where it does not: ``tests/test_lazy_keying.py`` pins both).

:class:`IndexHooks`: torch's DataLoader asks the loader object for ``_index_sampler`` (what its iterators draw
index lists from) and ``_auto_collation`` (whether items are fetched as lists and collated); a subclass of it
answers through :meth:`IndexHooks._index_lists` and :meth:`IndexHooks._fetches_lists`.

:func:`is_map_style`, :func:`forget_persistent_iterator` (the next ``iter()`` starts workers afresh),
:func:`wrap_fetcher` (a single-process iterator's map-style fetcher, wrapped), :func:`set_past_guard` (a write
DataLoader refuses after construction — ``dataset`` — or into the frozen ``WorkerInfo``).

:func:`next_batch`: torch's ``_BaseDataLoaderIter.__next__`` opens a ``record_function`` profiler range
around every batch, whether or not a profiler is recording (~10 µs a batch on 2 vCPUs:
an operator dispatch to enter it, one to leave). While none records, the loader runs the same steps
without the range; while one does (``torch.profiler``, ``torch.autograd.profiler``, NVTX/ITT emission),
it calls torch's own ``__next__``, so traces show the DataLoader ranges as before.

:func:`next_numbered`: with ``in_order=False``, which index list of the pass a delivered batch was made from.

:func:`fetch_items`: a worker that must read a batch again (``worker_fetch.WorkerFetch``) reads its items
as torch's map-style fetcher does, which it cannot reach from the worker loop.

:func:`random_sampler_num_samples` (whether a ``RandomSampler`` was given ``num_samples``) and
:func:`default_store` (the default process group's key-value store, which has no public accessor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

from torch._C._autograd import _profiler_enabled
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

__all__ = ["IndexHooks", "default_store", "fetch_items", "forget_persistent_iterator", "is_map_style", "next_batch",
           "next_numbered", "random_sampler_num_samples", "set_past_guard", "wrap_fetcher"]

T = TypeVar("T")


class IndexHooks(DataLoader[T]):
    """A ``DataLoader`` whose iterators take their index lists, and whether to fetch lists, from the subclass."""

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
    """Drop the iterator ``persistent_workers`` keeps: the next ``iter()`` starts its workers afresh."""
    loader._iterator = None


def wrap_fetcher(iterator: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace a single-process iterator's map-style fetcher (``_dataset_fetcher``) with ``wrap(fetcher)``."""
    iterator._dataset_fetcher = wrap(iterator._dataset_fetcher)


def set_past_guard(target: Any, name: str, value: Any) -> None:
    """Set an attribute torch guards: a ``DataLoader``'s ``dataset`` after construction, or a field of the
    frozen ``WorkerInfo`` (a frozen dataclass in torch 2.13, a class guarding ``__setattr__`` before)."""
    object.__setattr__(target, name, value)

_TORCH_NEXT: Final = _BaseDataLoaderIter.__next__
_STEPS: Final = {"record_function", "_sampler_iter", "_reset", "_next_data", "_num_yielded",
                 "_IterableDataset_len_called"}
_SAME_STEPS: Final = _STEPS <= set(_TORCH_NEXT.__code__.co_names)
"""torch's ``__next__`` is still made of the steps below (else :func:`next_batch` always calls it)."""


def next_batch(iterator: Any) -> Any:
    """``next(iterator)`` for one of torch's DataLoader iterators, without the profiler range while no
    profiler records (the steps of torch's ``_BaseDataLoaderIter.__next__``: reset if needed, next data,
    count; an iterable dataset whose ``len()`` was asked keeps torch's own path for its length warning)."""
    if (not _SAME_STEPS or _profiler_enabled() or type(iterator).__next__ is not _TORCH_NEXT
            or iterator._IterableDataset_len_called is not None):
        return next(iterator)
    if iterator._sampler_iter is None:
        iterator._reset()
    data = iterator._next_data()
    iterator._num_yielded += 1
    return data


def next_numbered(iterator: Any) -> tuple[int, Any]:
    """``(number, batch)``: the next batch of a multi-process iterator built with ``in_order=False`` and the number
    of the index list it was made from (torch numbers the lists it takes from the sampler 0, 1, ... per pass, and
    keeps the numbers of those in flight as ``_task_info``'s keys: the one that leaves is the batch's)."""
    before = set(iterator._task_info)
    batch = next_batch(iterator)
    (number,) = before - iterator._task_info.keys()
    return number, batch


def fetch_items(dataset: Any, indices: Any) -> Any:
    """The items torch's map-style fetcher reads for a batch's index list (auto-collation, before the collate):
    ``dataset.__getitems__(indices)`` where the dataset defines it, else ``[dataset[i] for i in indices]``."""
    if hasattr(dataset, "__getitems__") and dataset.__getitems__:
        return dataset.__getitems__(indices)
    return [dataset[index] for index in indices]


def random_sampler_num_samples(sampler: Any) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was built with (``None``: its data source's length, the
    default); its public ``num_samples`` answers the length either way."""
    return sampler._num_samples  # type: ignore[no-any-return]


def default_store() -> Any:
    """The default process group's key-value store (torch's ``distributed_c10d._get_default_store``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
