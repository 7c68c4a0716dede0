"""How batches travel from DataLoader workers to the main process: small tensors by value.

With torch's default sharing strategy (``file_descriptor``), DataLoader hands every tensor a worker
produces to the main process through shared memory: the worker's collate allocates the batch's
tensors in shared memory, and the main process, for each tensor of each batch, connects to the
worker's resource sharer, authenticates, receives the file descriptor and maps it. For a small
tensor that round trip costs far more than its bytes (``benchmarks/bench_core.py``: several hundred
µs of CPU a batch on tiny items, most of what a 2-worker pipeline spends). In the loader's workers,
a tensor of at most ``by_value_bytes`` bytes is therefore pickled with its bytes instead (the
worker's collate still allocates it as before), and rebuilt in the main process as an ordinary CPU
tensor of the same dtype, shape, strides and bytes (``send_small_tensors_by_value``, installed by
``ByValueInit`` once the worker's own ``worker_init_fn`` has run). Larger tensors, and any tensor
that is not a plain, contiguous CPU tensor owning its whole storage, travel as DataLoader sends
them.

What differs from DataLoader's own transport: a tensor that came by value is not in shared memory
(``is_shared()`` is False), so it shares memory with nothing in the worker (two tensors of one batch
that shared a storage there arrive as separate tensors, as ``pin_memory=True`` also copies each
tensor). The reducer is registered for the worker process as a whole: a queue of the dataset's own
to another process sends small tensors by value too, and it replaces a reducer for ``torch.Tensor``
that a ``worker_init_fn`` registered.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any, Final

import torch
from torch.multiprocessing.reductions import reduce_tensor

logger = logging.getLogger(__name__)

__all__ = [
    "BY_VALUE_BYTES", "MAX_BY_VALUE_BYTES", "ByValueInit", "by_value_init", "rebuild_by_value",
    "send_small_tensors_by_value",
]

_SHARED: Callable[[torch.Tensor], Any] = reduce_tensor  # torch's own: through shared memory
BY_VALUE_BYTES: Final = 65_536
"""The default ``by_value_bytes``: past ~256 KiB a tensor costs more by value than through shared
memory."""
MAX_BY_VALUE_BYTES: Final = 1 << 30
"""The largest ``by_value_bytes`` accepted (far past where shared memory is cheaper)."""


def rebuild_by_value(
    data: bytes, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    """The tensor pickled by value: an ordinary (resizable, unshared) CPU tensor of that shape and
    strides holding ``data`` (whatever default device the receiving thread has set)."""
    tensor = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
    if len(data) != tensor.nbytes:
        raise ValueError(f"a tensor sent by value: {len(data)} bytes for {tensor.nbytes}")
    if data:  # NOTE: copied as memory (a numpy view would leave the storage unable to resize)
        ctypes.memmove(tensor.data_ptr(), data, len(data))
    return tensor


def send_small_tensors_by_value(limit: int) -> None:
    """In this (worker) process, pickle tensors of at most ``limit`` bytes by value for the rest of
    its life."""

    def reduce(tensor: torch.Tensor) -> Any:
        # NOTE: runs in the worker's queue feeder thread, where an exception would lose the batch
        # and leave the main process waiting for it: anything unexpected goes the shared-memory way,
        # as DataLoader sends it
        try:
            if (
                tensor.layout is torch.strided
                and tensor.device.type == "cpu"
                and tensor.nbytes <= limit
                and not tensor.requires_grad
                and tensor.is_contiguous()
                and tensor.storage_offset() == 0
                and tensor.untyped_storage().nbytes() == tensor.nbytes
                and not (
                    tensor.is_nested or tensor.is_quantized or tensor.is_conj() or tensor.is_neg()
                )
            ):
                # contiguous, the whole storage
                data = ctypes.string_at(tensor.data_ptr(), tensor.nbytes)
                return rebuild_by_value, (data, tensor.dtype, tuple(tensor.shape), tensor.stride())
        except Exception:
            logger.debug("a tensor goes through shared memory after all", exc_info=True)
        return _SHARED(tensor)

    # NOTE: exactly torch.Tensor: the pickler dispatches by exact type
    ForkingPickler.register(torch.Tensor, reduce)


def by_value_init(
    attributes: dict[str, Any],
    worker_init_fn: Callable[[int], None] | None,
    num_workers: int,
    limit: int,
) -> None:
    """With workers and a ``limit``, the ``worker_init_fn`` torch's iterator is built with (in
    ``attributes``, the loader's attributes for it; else the loader's own) becomes a ``ByValueInit``
    around it."""
    if num_workers and limit:
        attributes["worker_init_fn"] = ByValueInit(
            attributes.get("worker_init_fn", worker_init_fn), limit
        )


class ByValueInit:
    """A worker's ``worker_init_fn``: the one it had (if any), then
    ``send_small_tensors_by_value``."""

    def __init__(self, inner: Callable[[int], None] | None, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def __call__(self, worker_id: int) -> None:
        if self.inner is not None:
            self.inner(worker_id)
        send_small_tensors_by_value(self.limit)
