"""Iterable datasets: worker state travels with batches; the round-robin resumes in place."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader, StateError
from loader_resume.testing import (
    assert_delivers_rest_exactly_once,
    assert_resumes_exactly,
    run_epochs,
)
from support.data import Shards, StatefulShards


# --- ported from torchdata's "Stateful DataLoader Tutorial" (iterable part) -----------------------
class MyIterableDataset(IterableDataset[torch.Tensor]):
    def __init__(self, high: int, seed: int) -> None:
        self.high, self.seed = high, seed
        self.g = torch.Generator()
        self.i = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        worker_info = get_worker_info()
        if worker_info is not None:
            worker_id = worker_info.id
            num_workers = worker_info.num_workers
        else:
            worker_id = 0
            num_workers = 1
        self.g.manual_seed(self.seed)
        arr = torch.randperm(self.high, generator=self.g)
        arr = arr[worker_id : self.high : num_workers]
        for idx in range(self.i, len(arr)):
            self.i += 1
            yield arr[idx]
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.i = state_dict["i"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchdata_tutorial_iterable(num_workers: int) -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            MyIterableDataset(12, 0), batch_size=2, drop_last=False, num_workers=num_workers
        )

    dl = build()
    batches = []
    for i, batch in enumerate(dl):
        batches.append(batch)
        if i == 2:
            sd = dl.state_dict()
    resumed = build()
    resumed.load_state_dict(sd)
    batches2 = list(resumed)
    assert len(batches) == 6 and len(batches2) == 3
    assert all(torch.equal(a, b) for a, b in zip(batches[3:], batches2, strict=True))
    assert sorted(torch.cat(batches).tolist()) == list(range(12))


MATRIX = [  # (num_workers, persistent_workers, batch_size, drop_last)
    (0, False, 3, False),
    (0, False, None, False),
    (2, False, 3, False),
    (2, True, 3, False),
    (3, False, 2, True),
    (3, True, None, False),
    (2, True, 4, True),
]


@pytest.mark.parametrize(("workers", "persistent", "batch_size", "drop_last"), MATRIX)
def test_stateful_stream_resumes_exactly_at_chosen_cuts(
    workers: int, persistent: bool, batch_size: int | None, drop_last: bool
) -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(StatefulShards(13), batch_size=batch_size, drop_last=drop_last,
                                   num_workers=workers, persistent_workers=persistent)

    per_epoch = len(run_epochs(build(), 1))
    cuts = (
        None
        if workers == 0
        else sorted({0, 1, 2, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1})
    )
    report = assert_resumes_exactly(build, epochs=2, cuts=cuts)
    assert report.batches == 2 * per_epoch


def test_batches_follow_workers_round_robin_and_run_dry_unevenly() -> None:
    loader = ResumableDataLoader(StatefulShards(7), batch_size=2, num_workers=3)
    ids = [b["id"].tolist() for b in loader]
    assert ids[:3] == [[0, 3], [1, 4], [2, 5]]
    assert sorted(sum(ids, [])) == list(range(12))


def test_stream_values_are_keyed_by_worker_and_ordinal_not_by_history() -> None:
    first = run_epochs(ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2), 2)
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert (
        run_epochs(ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2), 2) == first
    )
    other_seed = run_epochs(
        ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2, seed=5), 2
    )
    assert other_seed != first


def test_dataset_without_state_is_replayed_exactly_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(Shards(11), batch_size=2, num_workers=2)

    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        assert_resumes_exactly(build, epochs=2, cuts=[0, 1, 3, 5, 8])
    assert (
        "Shards has no state_dict(): replaying" in caplog.text and "items to resume" in caplog.text
    )


def test_dataset_without_state_replays_in_process_too() -> None:
    assert_resumes_exactly(lambda: ResumableDataLoader(Shards(7), batch_size=3), epochs=2)


def test_a_replayed_stream_resumed_twice_continues_exactly() -> None:
    """A stream with no state, resumed (6 items replayed), 1 more batch, resumed again: the second
    resume replays the 8 items delivered, not 14 (the replay was counted twice, and items 8 to 13
    were never delivered)."""
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(Shards(20), batch_size=2, seed=1)

    expected = [batch["id"].tolist() for batch in build()]
    first = build()
    batches = iter(first)
    seen = [next(batches)["id"].tolist() for _ in range(3)]
    second = build()
    second.load_state_dict(first.state_dict())
    batches = iter(second)
    seen.append(next(batches)["id"].tolist())
    third = build()
    third.load_state_dict(second.state_dict())
    assert seen + [batch["id"].tolist() for batch in third] == expected


class ResetByEpoch(IterableDataset[int]):
    """A stream with a state whose ``set_epoch`` starts it over (as most that are told their epoch
    do)."""

    def __init__(self) -> None:
        self.done, self.epoch = 0, 0

    def __iter__(self) -> Iterator[int]:
        while self.done < 10:
            self.done += 1
            yield 100 * self.epoch + self.done - 1

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]

    def set_epoch(self, epoch: int) -> None:
        self.done, self.epoch = 0, epoch


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (1, True)])
def test_a_state_taken_after_a_resume_between_epochs_resumes_exactly(
    workers: int, persistent: bool
) -> None:
    """Resumed from a state taken between epochs (its copy's state loaded before set_epoch), then
    cut again in the next epoch: that state is of the epoch, loaded after set_epoch (it said "before
    the epoch" and the second resume started the epoch over). ``assert_resumes_exactly`` resumes
    again from each resumed run's first state that is not the uninterrupted run's."""
    assert_resumes_exactly(
        lambda: ResumableDataLoader(
            ResetByEpoch(), batch_size=3, num_workers=workers, persistent_workers=persistent
        ),
        epochs=3,
    )


@pytest.mark.parametrize(("saved", "now", "field"), [(2, 3, "num_workers"), (2, 0, "num_workers")])
def test_other_worker_count_is_refused_clearly(saved: int, now: int, field: str) -> None:
    loader = ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=saved)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    fresh = ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=now)
    with pytest.raises(
        StateError, match=rf"'{field}': saved {saved}, expected {now}\. An iterable dataset's"
    ):
        fresh.load_state_dict(state)


def test_another_ranks_state_is_refused() -> None:
    loader = ResumableDataLoader(StatefulShards(9), batch_size=2, rank=1, world_size=2)
    state = loader.state_dict()
    with pytest.raises(
        StateError, match=r"'stream.rank': saved 1, expected 0\. This is another rank's state"
    ):
        ResumableDataLoader(StatefulShards(9), batch_size=2, rank=0, world_size=2).load_state_dict(
            state
        )


def test_map_state_is_refused_by_an_iterable_loader() -> None:
    map_state = ResumableDataLoader(list(range(9)), batch_size=2).state_dict()
    with pytest.raises(StateError, match="'kind': saved 'map', expected 'iterable'"):
        ResumableDataLoader(StatefulShards(9), batch_size=2).load_state_dict(map_state)


class Flaky(StatefulShards):
    fail_at: int | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for item in super().__iter__():
            if item["id"] == self.fail_at:
                raise RuntimeError(f"corrupt record {item['id']}")
            yield item


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_error_reaches_caller_and_last_good_state_resumes(workers: int) -> None:
    def build(fail_at: int | None) -> ResumableDataLoader[Any]:
        dataset = Flaky(10)
        dataset.fail_at = fail_at
        return ResumableDataLoader(dataset, batch_size=2, num_workers=workers)

    reference = run_epochs(build(None), 1)
    loader = build(fail_at=6)
    delivered = []
    with pytest.raises(RuntimeError, match="corrupt record 6") as caught:
        for batch in loader:
            delivered.append(batch)
    if workers:
        assert "Original Traceback" in str(caught.value) and "raise RuntimeError" in str(
            caught.value
        )
    state = loader.state_dict()
    assert state["stream"]["delivered"] == len(delivered) > 0
    resumed = build(None)
    resumed.load_state_dict(state)
    assert run_epochs(resumed, 1) == reference[len(delivered):]


def test_worker_renumbering_uses_torchs_worker_info() -> None:
    """Pins the private detail iterable.report_worker_id relies on: a frozen WorkerInfo's id can be
    reset."""
    from torch.utils.data._utils import worker as torch_worker

    from loader_resume.streams.stream_tasks import report_worker_id

    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=3, seed=1, dataset=None)
    try:
        report_worker_id(2)
        info = get_worker_info()
        assert info is not None and info.id == 2 and info.num_workers == 3
    finally:
        torch_worker._worker_info = None
    with pytest.raises(RuntimeError, match="must run inside a DataLoader worker"):
        report_worker_id(1)


class Pool(IterableDataset[int]):
    """Opts in to re-sharding: its state is the list of ids its shard has not served yet.
    Shard = (rank, worker), rank-major, as loader_resume hands states to reshard_states."""

    def __init__(self, n: int, rank: int = 0, world: int = 1) -> None:
        self.n, self.rank, self.world = n, rank, world
        self.remaining: list[int] | None = None

    def __iter__(self) -> Iterator[int]:
        if self.remaining is None:
            info = get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            self.remaining = list(range(self.rank * workers + worker, self.n, self.world * workers))
        while self.remaining:
            yield self.remaining.pop(0)
        self.remaining = None

    def state_dict(self) -> dict[str, Any]:
        return {"remaining": None if self.remaining is None else list(self.remaining)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.remaining = None if state["remaining"] is None else list(state["remaining"])

    def reshard_states(self, states: list[Any], num_shards: int) -> list[dict[str, Any]]:
        """None: that worker served nothing yet, i.e. its whole shard of len(states) remains."""
        left = []
        for worker, state in enumerate(states):
            untouched = state is None or state["remaining"] is None
            left += list(range(worker, self.n, len(states))) if untouched else state["remaining"]
        return [{"remaining": sorted(left)[shard::num_shards]} for shard in range(num_shards)]


def test_a_dataset_that_can_reshard_resumes_with_another_worker_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = ResumableDataLoader(Pool(23), batch_size=2, num_workers=2)
    before = []
    for batch in loader:
        before += batch.tolist()
        if len(before) == 6:
            state = loader.state_dict()  # inside the pass: after the `break` the pass is over
            break
    resumed = ResumableDataLoader(Pool(23), batch_size=2, num_workers=3)
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        resumed.load_state_dict(state)
    after = [i for batch in resumed for i in batch.tolist()]
    assert_delivers_rest_exactly_once(before, after, 23)
    assert "re-sharded Pool for num_workers 2 -> 3" in caplog.text
    with pytest.raises(StateError, match="'num_workers': saved 2, expected 3"):
        ResumableDataLoader(StatefulShards(23), batch_size=2, num_workers=3).load_state_dict(
            ResumableDataLoader(StatefulShards(23), batch_size=2, num_workers=2).state_dict())


def test_a_dataset_that_can_reshard_resumes_at_another_world_size() -> None:
    from loader_resume.distributed import load_rank_state

    old = [
        ResumableDataLoader(Pool(31, r, 2), batch_size=2, rank=r, world_size=2) for r in range(2)
    ]
    iterators = [iter(loader) for loader in old]
    before = [i for _ in range(3) for it in iterators for i in next(it).tolist()]
    gathered = {"world_size": 2, "ranks": [loader.state_dict() for loader in old]}
    new = [
        ResumableDataLoader(Pool(31, r, 3), batch_size=2, rank=r, world_size=3) for r in range(3)
    ]
    for loader in new:
        load_rank_state(loader, gathered)
    after = [i for loader in new for batch in loader for i in batch.tolist()]
    assert_delivers_rest_exactly_once(before, after, 31)
    with pytest.raises(StateError, match="'world_size': saved 2, expected 3"):
        load_rank_state(
            ResumableDataLoader(StatefulShards(31), batch_size=2, rank=0, world_size=3),
            {
                "world_size": 2,
                "ranks": [
                    ResumableDataLoader(
                        StatefulShards(31), batch_size=2, rank=r, world_size=2
                    ).state_dict()
                    for r in range(2)
                ],
            },
        )
