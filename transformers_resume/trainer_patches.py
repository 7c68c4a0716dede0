"""Where ``ResumableTrainer`` stands in for a step of Trainer's own: its loader handed to
``accelerator.prepare`` comes back as it is, and its ``skip_first_batches`` leaves our loader alone
(it stands at the next batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import transformers.trainer as trainer_module
from torch.utils.data import DataLoader

from accelerate_resume import AcceleratedResumableDataLoader

__all__ = ["no_skipping", "unprepared"]


def unprepared(accelerator: Any, build: Callable[[], DataLoader[Any]]) -> DataLoader[Any]:
    """What ``build()`` returns, with ``accelerator.prepare`` answering a lone DataLoader with
    itself (Trainer builds its loader and hands it straight to ``prepare``)."""
    had = "prepare" in vars(accelerator)
    prepare = accelerator.prepare

    def keep_loader(*objects: Any, **kwargs: Any) -> Any:
        if len(objects) == 1 and isinstance(objects[0], DataLoader):
            return objects[0]
        return prepare(*objects, **kwargs)

    accelerator.prepare = keep_loader
    try:
        return build()
    finally:
        if had:
            accelerator.prepare = prepare
        else:
            del accelerator.prepare


@contextmanager
def no_skipping() -> Iterator[None]:
    """While Trainer trains: its ``skip_first_batches`` hands our loader back as it is (it stands at
    the next batch already); any other loader is skipped as Trainer does."""
    skip = trainer_module.skip_first_batches

    def skip_unless_ours(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, AcceleratedResumableDataLoader):
            return dataloader
        return skip(dataloader, num_batches)

    trainer_module.skip_first_batches = skip_unless_ours
    try:
        yield
    finally:
        trainer_module.skip_first_batches = skip
