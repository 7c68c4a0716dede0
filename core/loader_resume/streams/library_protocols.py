"""Streams that keep their own position, restored through their library's own protocol (no
third-party import).

Two streaming libraries keep the epoch and the position inside the dataset and take them back only
through a ``state_dict`` of their own loader's, with required arguments (so
``loader_resume.thirdparty.is_stateful`` says no). The loader feeds that protocol with what it
counts itself — the epoch, and the items each worker (or the rank) delivered — so a resume is O(1),
never a replay:

- **litdata** (``StreamingDataset.state_dict(num_samples_yielded, num_workers, batch_size)`` /
  ``load_state_dict`` / ``reset_state_dict``): each worker resumes its own slice of chunks. litdata
  splits a count of yielded samples over workers in batches of its ``batch_size`` round-robin from
  worker 0; the loader knows each worker's own count, so each worker is given the count that litdata
  splits into exactly that. States are made in the main process (litdata refuses ``state_dict`` in a
  worker) and loaded in the worker.
- **Mosaic Streaming** (``StreamingDataset.state_dict(num_samples, from_beginning)`` /
  ``load_state_dict``, its ``next_epoch`` counter): one global position per epoch,
  ``sample_in_epoch`` — the samples the whole job consumed — kept in shared memory that every worker
  reads when it starts iterating. Mosaic re-partitions the rest of the epoch from worker 0, so a
  restored pass starts its round-robin at worker 0. The loader tells Mosaic its epoch at *every*
  pass (sample 0 when not resuming), so Mosaic's own counter, which a new process starts at 0, never
  decides the order.

Recognised by the names of ``state_dict``'s required parameters (the protocol, not the class): a
dataset that follows one of these protocols is restored through it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Protocol

__all__ = ["LibraryProtocol", "library_protocol", "required_parameters"]


class LibraryProtocol(Protocol):
    """How one library's own resume protocol is fed with the loader's counts."""

    per_worker: bool
    """Each worker resumes its own items (litdata); else the rank's items as one global count
    (Mosaic)."""

    def main_process(self, dataset: Any, *, epoch: int, items: int, worker: int, workers: int,
                     world: int, batch_size: int) -> Any:
        """In the main process, before the pass's workers start: what the copy that iterates is
        handed (``in_worker``). ``items``: this worker's delivered items in ``epoch``
        (``per_worker``), else the rank's."""

    def in_worker(self, dataset: Any, handed: Any, *, epoch: int) -> None:
        """In the copy that iterates, after ``set_epoch`` and before ``iter()``; ``handed`` is None
        on a pass that restores nothing (the dataset must forget any state loaded for an earlier
        pass)."""


class _Litdata:
    per_worker = True

    def main_process(self, dataset: Any, *, epoch: int, items: int, worker: int, workers: int,
                     world: int, batch_size: int) -> Any:
        if items == 0:
            return None
        size = int(getattr(dataset, "batch_size", 1) or 1)
        # litdata splits a count N of yielded samples in batches of `size`, round-robin from worker
        # 0 (_replay_sampling): the least N that gives worker `worker` exactly `items` (litdata
        # refuses an N above its length, so not a larger one).
        rounds, rest = divmod(items, size)
        yielded = rounds * size * workers + worker * size + rest if rest else \
            (rounds - 1) * size * workers + (worker + 1) * size
        state = copy.deepcopy(dataset.state_dict(yielded, workers, size))
        # what set_epoch(epoch) gives it; litdata ignores set_epoch once loaded
        state["current_epoch"] = epoch
        return state

    def in_worker(self, dataset: Any, handed: Any, *, epoch: int) -> None:
        if handed is None:
            # a state loaded for an earlier pass would resume again (litdata's own loader)
            dataset.reset_state_dict()
            dataset.set_epoch(epoch)
        else:
            dataset.load_state_dict(handed)


class _Mosaic:
    per_worker = False

    def main_process(self, dataset: Any, *, epoch: int, items: int, worker: int, workers: int,
                     world: int, batch_size: int) -> Any:
        if getattr(dataset, "batch_size", None) != batch_size:
            raise ValueError(
                f"{type(dataset).__name__}(batch_size={getattr(dataset, 'batch_size', None)!r}): "
                "Mosaic partitions each epoch over the workers in batches of its own batch_size, "
                "so the loader's batches follow its order only with the loader's "
                f"batch_size={batch_size}; pass the same batch_size to both"
            )
        # NOTE: Mosaic's state_dict resolves its defaults (num_canonical_nodes) as its own loader's
        # would; the epoch and the position are then the loader's. Every rank's count is the same
        # mid-epoch (Mosaic pads ranks to equal partitions), so the job's is this rank's times the
        # world size.
        state = dict(dataset.state_dict(items * world, True))
        state["epoch"], state["sample_in_epoch"] = epoch, items * world
        # a resume state older than Mosaic's counter would be taken as stale
        dataset.next_epoch = epoch
        dataset.load_state_dict(state)  # into shared memory, read by every worker's __iter__
        return state  # (for the record: the workers read it from shared memory)

    def in_worker(self, dataset: Any, handed: Any, *, epoch: int) -> None:
        return None


_PROTOCOLS: tuple[tuple[tuple[str, ...], tuple[str, ...], LibraryProtocol], ...] = (
    # (state_dict's required parameters, other members the protocol needs, the protocol)
    (
        ("num_samples_yielded", "num_workers", "batch_size"),
        ("reset_state_dict", "set_epoch"),
        _Litdata(),
    ),
    (("num_samples", "from_beginning"), ("next_epoch",), _Mosaic()),
)


def library_protocol(dataset: Any) -> LibraryProtocol | None:
    """The library protocol ``dataset`` follows (see the module doc), else None."""
    state_dict = getattr(dataset, "state_dict", None)
    if not (callable(state_dict) and callable(getattr(dataset, "load_state_dict", None))):
        return None
    required = required_parameters(state_dict)
    return next((protocol for names, members, protocol in _PROTOCOLS
                 if required == names and all(hasattr(type(dataset), m) for m in members)), None)


_REQUIRED: dict[Any, tuple[str, ...]] = {}


def required_parameters(method: Any) -> tuple[str, ...]:
    """The names of the parameters ``method`` requires, in order (cached per function); ``()`` for
    none, and for a builtin without a signature."""
    function = getattr(method, "__func__", method)
    try:
        return _REQUIRED[function]
    except (KeyError, TypeError):
        pass
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    required = tuple(p.name for p in parameters
                     if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    with contextlib.suppress(TypeError):
        _REQUIRED[function] = required
    return required
