"""Loaders of tests/loader/test_break_then_save.py and its child script: one config, built alike in
both processes."""

from __future__ import annotations

from typing import Any

from loader_resume import ResumableDataLoader
from loader_resume.testing import fingerprint

from .data import Augmented, StatefulShards

N, BATCH, EPOCHS = 40, 4, 2  # map-style: 10 batches an epoch


def build(config: dict[str, Any]) -> ResumableDataLoader[Any]:
    """``config``: ``kind`` ("map": shuffled, augmented items; "stream": a stateful stream whose
    workers run dry at different times), ``workers``, ``persistent``."""
    dataset = Augmented(N) if config["kind"] == "map" else StatefulShards(N)
    return ResumableDataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=config["kind"] == "map",
        seed=7,
        num_workers=config["workers"],
        persistent_workers=config["persistent"],
    )


def record(batch: dict[str, Any]) -> list[Any]:
    """A batch's ids and a digest of the values its items drew from torch, numpy and random."""
    return [batch["id"].tolist(), fingerprint([batch["torch"], batch["numpy"], batch["random"]])]


def rest(loader: ResumableDataLoader[Any]) -> list[list[Any]]:
    """What a resumed loop gets: the loaded epoch's rest, then whole epochs until ``EPOCHS`` are
    done."""
    rows = []
    while loader.epoch < EPOCHS:
        rows += [record(batch) for batch in loader]
    return rows
