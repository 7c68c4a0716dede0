"""What we know of third-party datasets that their own API does not say (no third-party import here).

Questions asked of the user's dataset:

- :func:`unrestorable`: its ``state_dict()`` exists but cannot restore it exactly, so the loader does
  not call it and resumes by replay instead (exact, at the cost of re-reading the epoch's delivered items).
- :func:`irreproducible`: it draws from a random generator no keying reaches, so a resumed continuation
  will *not* be bit-identical; the loader says so when a state is loaded.
- :func:`content_identity`: what identifies its content beyond its length, so ranks can compare theirs
  (:func:`loader_resume.distributed.check_same_dataset`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["content_identity", "irreproducible", "unrestorable"]


def unrestorable(dataset: Any) -> str | None:
    """Why ``dataset.state_dict()`` cannot restore it exactly, or None."""
    if _hf_iterable(dataset) and any(type(e).__name__ == "BufferShuffledExamplesIterable"
                                     for e in _hf_chain(dataset._ex_iterable)):
        # NOTE: measured on datasets 5.2: its state omits the buffer's content (it warns), and with
        # num_workers=2 its load_state_dict raises IndexError (StatefulDataLoader fails identically).
        return ("HF datasets' .shuffle(buffer_size=...) state omits the buffer's content, so its own "
                "load_state_dict cannot continue exactly")
    return None


def irreproducible(dataset: Any) -> str | None:
    """Why a resumed continuation of ``dataset`` will differ from the uninterrupted run, or None."""
    stages = (getattr(dataset, "pipeline", None) or ()) if _webdataset(dataset) else ()
    for stage in stages:
        function = getattr(stage, "f", None)
        keywords = getattr(stage, "kw", {}) or {}
        if getattr(function, "__name__", "") == "_shuffle" and keywords.get("seed") is None \
                and keywords.get("rng") is None:
            return ("webdataset's .shuffle(n) without seed= seeds a private random.Random from the process id "
                    "and the time, which no keying reaches; pass seed= (e.g. .shuffle(n, seed=0)) to make it "
                    "reproducible")
    return None


def content_identity(dataset: Any) -> str | None:
    """A string equal for equal content and different for a per-rank split, where the library keeps one, else None.

    HF ``datasets.Dataset``: its fingerprint, a hash of its origin and every transform applied, arguments
    included (deterministic across processes; ``split_dataset_by_node`` gives each rank a different one).
    """
    if type(dataset).__module__.startswith("datasets.") and isinstance(getattr(dataset, "_fingerprint", None), str):
        return f"fingerprint {dataset._fingerprint}"
    return None


def _hf_iterable(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "_ex_iterable")


def _hf_chain(node: Any, depth: int = 0) -> Iterator[Any]:
    """An HF iterable's examples-iterable and the ones it wraps (``ex_iterable``, ``ex_iterables``)."""
    if node is None or depth > 64:
        return
    yield node
    yield from _hf_chain(getattr(node, "ex_iterable", None), depth + 1)
    for inner in getattr(node, "ex_iterables", None) or ():
        yield from _hf_chain(inner, depth + 1)


def _webdataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("webdataset.")
