"""Where the loader relies on torch's DataLoader iterator beyond its public API, named and pinned by tests.

:func:`next_batch`: torch's ``_BaseDataLoaderIter.__next__`` opens a ``record_function`` profiler range
around every batch, whether or not a profiler is recording (~10 µs a batch measured on a 2-vCPU machine:
an operator dispatch to enter it, one to leave). While none records, the loader runs the same steps
without the range; while one does (``torch.profiler``, ``torch.autograd.profiler``, NVTX/ITT emission),
it calls torch's own ``__next__``, so traces show the DataLoader ranges as before.

:func:`next_numbered`: with ``in_order=False``, which index list of the pass a delivered batch was made from.

:func:`fetch_items`: a worker that must read a batch again (``worker_fetch.WorkerFetch``) reads its items
as torch's map-style fetcher does, which it cannot reach from the worker loop.
"""

from __future__ import annotations

from typing import Any, Final

from torch._C._autograd import _profiler_enabled
from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["fetch_items", "next_batch", "next_numbered"]

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
