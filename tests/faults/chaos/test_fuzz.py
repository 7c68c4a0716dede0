"""Fuzzing: random dataset lengths, batch sizes, world sizes before and after, worker
counts and cut points — each epoch is delivered exactly once across a cut and an elastic resume.

Ranks are simulated in one process (explicit ``rank``/``world_size``), each a real
ResumableDataLoader. The default run tries 150 cases; ``pytest -m chaos`` tries 10,000.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from loader_resume import ResumableDataLoader


class Ids(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def ranks(n: int, world: int, case: dict[str, Any], workers: int) -> list[ResumableDataLoader[Any]]:
    return [
        ResumableDataLoader(
            Ids(n),
            batch_size=case["batch"],
            shuffle=case["shuffle"],
            drop_last=case["drop_last"],
            num_workers=workers,
            seed=case["seed"],
            rank=rank,
            world_size=world,
        )
        for rank in range(world)
    ]


_HELD: list[Any] = []
"""Iterators of passes cut short, held as a job killed there holds them (a dropped iterator's pass
is over)."""


def delivered(loader: ResumableDataLoader[Any], batches: int | None) -> list[int]:
    ids: list[int] = []
    iterator = iter(loader)
    for count, batch in enumerate(iterator):
        ids += torch.as_tensor(batch).tolist()
        if batches is not None and count + 1 == batches:
            _HELD.append(iterator)
            break
    return ids


def check(case: dict[str, Any]) -> None:
    _HELD.clear()
    n, before, after = case["n"], case["world_before"], case["world_after"]
    old = ranks(n, before, case, case["workers_before"])
    per_rank = len(old[0])
    cut = min(case["cut"], per_rank)
    for loader in old:  # a whole first epoch, when the cut falls in the second one
        if case["epoch"]:
            delivered(loader, None)
    seen = [i for loader in old for i in (delivered(loader, cut) if cut else [])]
    state = old[0].state_dict()
    assert all(loader.state_dict() == state for loader in old)  # a map-style position is global
    new = ranks(n, after, case, case["workers_after"])
    for loader in new:
        loader.load_state_dict(state)
    rest = [
        i
        for loader in new
        for i in (delivered(loader, None) if state["epoch"] == case["epoch"] else [])
    ]
    counts = Counter(seen + rest)
    widest = max(before, after)
    if case["drop_last"]:
        assert max(counts.values(), default=1) == 1, "a sample was delivered twice"
        assert n - len(counts) < widest * case["batch"], (
            "more was dropped than one partial global step"
        )
    else:
        assert set(counts) == set(range(n)), f"lost: {sorted(set(range(n)) - set(counts))}"
        assert sum(counts.values()) - n < widest, "more repeats than the padding of the last step"


CASES = st.fixed_dictionaries(
    {
        "n": st.integers(1, 300),
        "batch": st.integers(1, 17),
        "world_before": st.integers(1, 8),
        "world_after": st.integers(1, 8),
        "cut": st.integers(0, 40),
        "epoch": st.integers(0, 1),
        "shuffle": st.booleans(),
        "drop_last": st.booleans(),
        "seed": st.integers(0, 2**31),
        "workers_before": st.sampled_from([0] * 9 + [2]),
        "workers_after": st.sampled_from([0] * 9 + [1]),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_any_cut_and_any_rescale_deliver_each_epoch_exactly_once(case: dict[str, Any]) -> None:
    check(case)


@pytest.mark.chaos
@pytest.mark.timeout(7200)
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_ten_thousand_cases(case: dict[str, Any]) -> None:
    check(case)
