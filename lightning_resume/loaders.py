"""The training loaders Lightning holds, made resumable wherever they sit in what the module returned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from loader_resume import ResumableDataLoader

__all__ = ["resumable_tree"]


def resumable_tree(
    obj: Any, convert: Callable[[DataLoader[Any]], ResumableDataLoader[Any]],
) -> tuple[Any, list[ResumableDataLoader[Any]]]:
    """``obj`` with every ``DataLoader`` in it made resumable by ``convert`` (one already resumable is kept),
    through ``CombinedLoader``s, dicts, lists and tuples; and those loaders, in the order found (the order
    their states are saved in)."""
    found: list[ResumableDataLoader[Any]] = []

    def walk(value: Any) -> Any:
        if isinstance(value, CombinedLoader):
            value.flattened = [walk(loader) for loader in value.flattened]
            return value
        if isinstance(value, DataLoader):
            loader = value if isinstance(value, ResumableDataLoader) else convert(value)
            found.append(loader)
            return loader
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return value

    return walk(obj), found
