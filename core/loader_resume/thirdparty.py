"""What we know of the user's objects, and of third-party datasets, that their own API does not say
(no third-party import here).

Questions asked of the user's dataset (or sampler):

- ``is_stateful``: does it implement the Stateful protocol the loader calls (``state_dict()`` and
  ``load_state_dict(state)``)? ``foreign_state_dict`` names another library's protocol instead;
- ``unrestorable``: its ``state_dict()`` exists but cannot restore it exactly, so the loader does
  not call it and resumes by replay instead (exact, at the cost of re-reading the epoch's delivered
  items).
- ``irreproducible``: it draws from a random generator no keying reaches, so a resumed continuation
  will *not* be bit-identical; the loader says so when a state is loaded.
- ``content_identity``: what identifies its content beyond its length, so ranks can compare theirs
  (``loader_resume.distributed.check_same_dataset``).

What the loader cannot do for a dataset as its author may expect is said when the loader is built
(``warn_at_construction``) and when a resume replays items (``warn_replay``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any

from loader_resume.streams.library_protocols import library_protocol, required_parameters

__all__ = [
    "accelerator_mode",
    "mark_accelerator",
    "refuse_stock_accelerate",
    "content_identity",
    "foreign_state_dict",
    "irreproducible",
    "is_stateful",
    "unrestorable",
    "warn_at_construction",
    "warn_replay",
    "warn_self_kept",
]

logger = logging.getLogger(__name__)


_ACCELERATORS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_accelerator(accelerator: Any, mode: str | None) -> None:
    """Record what ``enable_resume`` made of ``accelerator``: ``"resume"`` (its loaders are
    converted), ``"stock"`` (switched off on purpose: Accelerate's own loaders), or ``None``
    (undone)."""
    if mode is None:
        _ACCELERATORS.pop(accelerator, None)
    else:
        _ACCELERATORS[accelerator] = mode


def accelerator_mode(accelerator: Any) -> str | None:
    """What ``mark_accelerator`` recorded for ``accelerator`` (``None``: nothing, or not an
    Accelerator)."""
    try:
        return _ACCELERATORS.get(accelerator)
    except TypeError:  # not weakly referenceable or not hashable: no Accelerator
        return None


def refuse_stock_accelerate(reader: str | None, accelerator: Any) -> None:
    """Raise when ``reader`` (the module that asked a ``ResumableDataLoader`` whether it is
    prepared) is Accelerate's: its ``prepare_data_loader`` asks right before rebuilding a loader
    into its own. Not when ``accelerator`` (the Accelerator asking) was switched off on purpose
    (``enable_resume`` with ``enabled=False`` marks it ``"stock"``): the user asked for Accelerate's
    own loaders."""
    mode = accelerator_mode(accelerator)
    if reader is None or reader.split(".")[0] != "accelerate" or mode == "stock":
        return
    if mode == "resume":
        raise TypeError(
            "Accelerate's own prepare_data_loader() got a ResumableDataLoader: it would rebuild it "
            "into its own DataLoaderShard, dropping its order, keyed randomness and per-rank "
            "state. enable_resume(accelerator) converts loaders in accelerator.prepare(); pass the "
            "loader there"
        )
    raise TypeError(
        "accelerator.prepare() got a ResumableDataLoader, but enable_resume(accelerator) was not "
        "called first: Accelerate would rebuild it into its own DataLoaderShard over a plain "
        "DataLoader (or over a StatefulDataLoader with use_stateful_dataloader=True), and its "
        "order, keyed randomness and per-rank state would be gone without a word. Call "
        "accelerate_resume.enable_resume(accelerator) before accelerator.prepare() (it takes plain "
        "DataLoaders too), or pass a plain DataLoader to a stock Accelerator"
    )


def is_stateful(owner: Any) -> bool:
    """Whether ``owner`` implements the Stateful protocol: ``state_dict()`` and
    ``load_state_dict(state)``.

    A ``state_dict`` that requires arguments (litdata's
    ``StreamingDataset.state_dict(num_samples_yielded, num_workers, batch_size)``, Mosaic's
    ``state_dict(num_samples, from_beginning)``) is another library's protocol, not this one: such
    an object is treated as stateless (see ``foreign_state_dict``), and so is one whose state is
    known not to restore it exactly (``loader_resume.thirdparty.unrestorable``).
    """
    state_dict, load = getattr(owner, "state_dict", None), getattr(owner, "load_state_dict", None)
    if not (callable(state_dict) and callable(load)):
        return False
    return foreign_state_dict(owner) is None and unrestorable(owner) is None


def foreign_state_dict(owner: Any) -> str | None:
    """The signature of ``owner.state_dict`` when it requires arguments (another library's
    protocol), else None."""
    required = required_parameters(getattr(owner, "state_dict", None))
    return f"state_dict({', '.join(required)})" if required else None


def unrestorable(dataset: Any) -> str | None:
    """Why ``dataset.state_dict()`` cannot restore it exactly, or None."""
    if _hf_iterable(dataset) and any(type(e).__name__ == "BufferShuffledExamplesIterable"
                                     for e in _hf_chain(dataset._ex_iterable)):
        # NOTE: measured on datasets 5.2: its state omits the buffer's content (it warns), and with
        # num_workers=2 its load_state_dict raises IndexError (StatefulDataLoader fails
        # identically).
        return (
            "HF datasets' .shuffle(buffer_size=...) state omits the buffer's content, so its own "
            "load_state_dict cannot continue exactly"
        )
    return None


def irreproducible(dataset: Any) -> str | None:
    """Why a resumed continuation of ``dataset`` will differ from the uninterrupted run, or None."""
    stages = (getattr(dataset, "pipeline", None) or ()) if _webdataset(dataset) else ()
    for stage in stages:
        function = getattr(stage, "f", None)
        keywords = getattr(stage, "kw", {}) or {}
        if getattr(function, "__name__", "") == "_shuffle" and keywords.get("seed") is None \
                and keywords.get("rng") is None:
            return (
                "webdataset's .shuffle(n) without seed= seeds a private random.Random from the "
                "process id and the time, which no keying reaches; pass seed= (e.g. .shuffle(n, "
                "seed=0)) to make it reproducible"
            )
    return None


def content_identity(dataset: Any) -> str | None:
    """A string equal for equal content and different for a per-rank split, where the library keeps
    one, else None.

    HF ``datasets.Dataset``: its fingerprint, a hash of its origin and every transform applied,
    arguments included (deterministic across processes; ``split_dataset_by_node`` gives each rank a
    different one).
    """
    if type(dataset).__module__.startswith("datasets.") and isinstance(
        getattr(dataset, "_fingerprint", None), str
    ):
        return f"fingerprint {dataset._fingerprint}"
    return None


_WARNED: set[tuple[str, type]] = set()  # (what, dataset class): the warnings given once per class


def _warn_once(what: str, dataset: Any, message: str, *args: Any) -> None:
    if (what, type(dataset)) not in _WARNED:
        _WARNED.add((what, type(dataset)))
        logger.warning(message, *args)


def warn_at_construction(dataset: Any, *, batch_read: bool) -> None:
    """What this loader cannot do for ``dataset`` as its author may expect: said when the loader is
    built."""
    name = type(dataset).__name__
    if batch_read and hasattr(dataset, "__getitems__"):
        _warn_once(
            "batch read",
            dataset,
            "keying='sample': %s defines __getitems__, so it reads each batch's index list at "
            "once. Random numbers it draws while iterating that list item by item are keyed per "
            "sample; any it draws after (a batch transform, as HF datasets' set_transform runs) "
            "are keyed by the batch's key, so they depend on the batch's composition (batch size, "
            "world size). Use keying='batch' to say so explicitly, or read items one by one in "
            "__getitem__ for per-sample keys.",
            name,
        )
    foreign = foreign_state_dict(dataset)
    if foreign is not None and library_protocol(dataset) is None:
        _warn_once(
            "foreign state",
            dataset,
            "%s.%s takes required arguments: it is %s's own resume protocol, not the Stateful "
            "protocol (state_dict() / load_state_dict(state)) this loader calls. Its position is "
            "tracked by the loader and restored by replaying items (O(items delivered) per "
            "resume), and it is told the epoch through set_epoch(). For O(1) resume use that "
            "library's own loader.",
            name,
            foreign,
            _defining_library(dataset, "state_dict"),
        )
    reason = unrestorable(dataset)
    # NOTE: per loader, not per class: whether it holds depends on the instance
    if reason is not None:
        logger.warning(
            "%s: %s; this loader resumes it by replaying the epoch's delivered items instead "
            "(exact; costs reading them again at each resume)",
            name,
            reason,
        )


def _defining_library(obj: Any, method: str) -> str:
    """The top-level package whose class defines ``obj.method`` (a user's subclass names the library
    it extends)."""
    owner = next((cls for cls in type(obj).__mro__ if method in vars(cls)), type(obj))
    return owner.__module__.split(".")[0]


def warn_replay(dataset: Any, items: int) -> None:
    foreign = foreign_state_dict(dataset)
    why = f"has {foreign}, not the Stateful protocol" if foreign else "has no state_dict()"
    logger.warning(
        "%s %s: replaying %d items to resume (they are read and dropped). The continuation is "
        "exact "
        "only if its stream depends on nothing but the epoch it is told through set_epoch() and "
        "the "
        "keyed generators; give it state_dict()/load_state_dict() to resume in O(1)",
        type(dataset).__name__,
        why,
        items,
    )


def warn_self_kept(dataset: Any, names: list[str]) -> None:
    """At a resume: the dataset keeps its own epoch or position in ``names``, which nothing
    restores."""
    name = type(dataset).__name__
    logger.warning(
        "resuming %s: the continuation will NOT be bit-identical to the uninterrupted run: its own "
        "iter() changes %s (it keeps its own epoch or position), and its copy lived on across "
        "epochs in the saving run, while no state_dict() restores them here: a new copy starts "
        "them afresh. Give %s state_dict()/load_state_dict() (the Stateful protocol), or derive "
        "them from the epoch the loader tells it through set_epoch(epoch)",
        name,
        ", ".join(repr(n) for n in names),
        name,
    )


def _hf_iterable(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "_ex_iterable")


def _hf_chain(node: Any, depth: int = 0) -> Iterator[Any]:
    """An HF iterable's examples-iterable and the ones it wraps (``ex_iterable``,
    ``ex_iterables``)."""
    if node is None or depth > 64:
        return
    yield node
    yield from _hf_chain(getattr(node, "ex_iterable", None), depth + 1)
    for inner in getattr(node, "ex_iterables", None) or ():
        yield from _hf_chain(inner, depth + 1)


def _webdataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("webdataset.")
