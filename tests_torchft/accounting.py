"""A TorchFT test job's data and the accounting of its rows (``children/group.py`` writes them; the
Ray suite's TorchFT job writes the same): which batches went into a committed step, every sample
exactly once per epoch, the weights equal on every group. Shared by ``tests_torchft`` and
``tests_ray``."""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import torch
from torch.utils.data import Dataset

N, BATCH, EPOCHS = 96, 4, 2


class Noisy(Dataset[dict[str, torch.Tensor]]):
    """Item ``i``: its id, features from the id, and augmentation noise drawn from torch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"id": torch.tensor(index), "x": torch.full((4,), float(index % 7)) + torch.randn(4)}


def digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()[:16]


def trained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches whose gradients went into a committed step: those of a step (a quorum's) that
    committed on any group. A group whose commit failed while others committed contributed its
    gradients all the same, and heals from a peer that stepped; a group that died before its step
    ended counts when the others committed that quorum's step."""
    outcome: dict[int, bool | None] = {}
    last_take: dict[int, int] = {}
    for index, row in enumerate(rows):  # each process's rows in their order
        if row["t"] == "take":
            outcome[index], last_take[row["pid"]] = None, index
        elif row["t"] == "end":
            outcome[last_take[row["pid"]]] = row["committed"]
    committed = {(row["step"], row["quorum"]) for index, row in enumerate(rows)
                 if row["t"] == "take" and outcome[index]}
    return [row for row in rows if row["t"] == "take" and (row["step"], row["quorum"]) in committed]


def assert_exactly_once(rows: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """Every sample once per epoch but the padding of an epoch's last step (the step's leftover
    samples spread evenly, the short participants padded from the epoch's start, as
    ``DistributedSampler``); returns each (epoch, id)'s noise digest."""
    noise: dict[tuple[int, int], str] = {}
    for epoch in range(EPOCHS):
        batches = [row for row in trained(rows) if row["epoch"] == epoch]
        last_step = max(row["step"] for row in batches)
        last = [row for row in batches if row["step"] == last_step]
        before = collections.Counter(i for row in batches if row["step"] != last_step
                                     for i in row["ids"])
        assert max(before.values()) == 1, f"epoch {epoch}: a sample trained twice"
        world, share = last[0]["participant"][1], len(last[0]["ids"])
        assert len(last) == world, f"epoch {epoch}: the last step lost a participant's batch"
        left = N - sum(before.values())
        assert share == -(-left // world), f"epoch {epoch}: the tail is not spread evenly"
        ending = collections.Counter(i for row in last for i in row["ids"])
        assert set(before) | set(ending) == set(range(N)), f"epoch {epoch}: samples never trained"
        assert len(set(ending) - set(before)) == left, f"epoch {epoch}: the tail repeats a sample"
        for row in batches:
            assert len(row["ids"]) == (share if row["step"] == last_step else BATCH)
            for i, digest in zip(row["ids"], row["noise"], strict=True):
                assert noise.setdefault((epoch, i), digest) == digest, (epoch, i)
    return noise


def assert_weights_agree(rows: list[dict[str, Any]]) -> None:
    by_step = collections.defaultdict(set)
    for row in rows:
        if row["t"] == "end" and row["committed"]:
            by_step[row["step"]].add(row["weights"])
    assert by_step
    assert all(len(weights) == 1 for weights in by_step.values()), by_step
