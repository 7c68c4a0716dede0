"""Changed resources (batch size, workers), DDP sharding with real gloo processes, elastic
resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loader_resume import ResumableDataLoader
from loader_resume.testing import (
    assert_delivers_rest_exactly_once,
    assert_resumes_exactly,
    run_epochs,
)
from support.data import PlainSampler, StatefulShards, ids, make
from support.launch import CHILDREN, launch


@pytest.mark.parametrize("workers_after", [0, 1, 3])
def test_state_from_two_workers_resumes_with_another_worker_count(workers_after: int) -> None:
    assert_resumes_exactly(
        lambda: make(10, shuffle=True, num_workers=2),
        make_resumed=lambda: make(10, shuffle=True, num_workers=workers_after),
        epochs=2, cuts=[0, 1, 3, 4, 6],
    )


def test_num_workers_set_between_passes_takes_effect_as_with_dataloader() -> None:
    reference = run_epochs(make(10, batch_size=3, shuffle=True), 3)
    # from 0, torch itself lacks a prefetch_factor
    loader = make(10, batch_size=3, shuffle=True, num_workers=2)
    first = run_epochs(loader, 1)
    loader.num_workers = 0
    # keyed values do not depend on the worker count
    assert first + run_epochs(loader, 3, 1) == reference


def test_a_stream_told_another_num_workers_after_its_load_says_to_set_it_before() -> None:
    saved = ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2)
    iterator = iter(saved)
    next(iterator)
    resumed = ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2)
    resumed.load_state_dict(saved.state_dict())
    resumed.num_workers = 1
    with pytest.raises(
        ValueError, match=r"num_workers=1, but the state loaded holds 2 workers' positions"
    ):
        iter(resumed)


def test_changed_batch_size_resumes_at_the_same_sample_position() -> None:
    order = sum(ids(list(make(12, batch_size=3, shuffle=True))), [])
    loader = make(12, batch_size=3, shuffle=True)
    iterator = iter(loader)
    before = sum(ids([next(iterator), next(iterator)]), [])
    resumed = make(12, batch_size=5, shuffle=True)
    resumed.load_state_dict(loader.state_dict())
    after = ids(list(resumed))
    assert [len(b) for b in after] == [5, 1]
    assert before + sum(after, []) == order


_HELD: list[Any] = []
"""The iterators of the last `_lockstep` cut short: held, as a job killed there holds them (a
dropped iterator's pass is over, and a state taken then starts the next epoch)."""


def _lockstep(loaders: list[Any], steps: int | None) -> list[list[int]]:
    """Iterate ranks together for `steps` global steps (None: to the end); ids delivered per
    rank."""
    iterators = [iter(loader) for loader in loaders]
    _HELD[:] = iterators
    delivered: list[list[int]] = [[] for _ in loaders]
    step = 0
    while steps is None or step < steps:
        try:
            batches = [next(it) for it in iterators]
        except StopIteration:
            break
        for rank, batch in enumerate(batches):
            delivered[rank] += batch["id"].tolist()
        step += 1
    return delivered


def _values_by_id(loaders: list[Any]) -> dict[int, tuple[float, ...]]:
    return {i: tuple(row.tolist()) for loader in loaders for b in loader
            for i, row in zip(b["id"].tolist(), b["torch"], strict=True)}


@pytest.mark.parametrize("new_world", [1, 3, 8])
def test_elastic_resume_from_world_4_delivers_the_rest_exactly_once(new_world: int) -> None:
    def shard(rank: int, world: int) -> Any:
        return make(96, batch_size=2, shuffle=True, keying="sample", rank=rank, world_size=world)

    old = [shard(r, 4) for r in range(4)]
    before = sum(_lockstep(old, 3), [])
    states = [loader.state_dict() for loader in old]
    assert all(s == states[0] for s in states) and states[0]["position"] == 24
    new = [shard(r, new_world) for r in range(new_world)]
    for loader in new:
        loader.load_state_dict(states[0])
    after = sum(_lockstep(new, None), [])
    assert_delivers_rest_exactly_once(before, after, 96)
    expected_values = _values_by_id([shard(r, 4) for r in range(4)])
    resumed = [shard(r, new_world) for r in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert _values_by_id(resumed) == {i: expected_values[i] for i in after}


def test_ranks_are_disjoint_and_padded_evenly_like_distributed_sampler() -> None:
    per_rank = _lockstep(
        [make(10, batch_size=2, shuffle=True, rank=r, world_size=3) for r in range(3)], None
    )
    assert [len(x) for x in per_rank] == [4, 4, 4]
    everything = sum(per_rank, [])
    assert set(everything) == set(range(10)) and len(everything) == 12
    dropped = _lockstep([make(10, batch_size=2, shuffle=True, drop_last=True, rank=r, world_size=3)
                         for r in range(3)], None)
    assert [len(x) for x in dropped] == [2, 2, 2] and len(set(sum(dropped, []))) == 6
    assert len(make(10, batch_size=2, rank=0, world_size=3)) == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_two_gloo_processes_resume_each_rank_exactly(tmp_path: Path, workers: int) -> None:
    for mode in ("full", "save", "resume"):
        launch(CHILDREN / "ddp_child.py", mode, tmp_path, workers)
    full = [json.loads((tmp_path / f"full-{r}.json").read_text()) for r in range(2)]
    resumed = [json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in range(2)]
    per_epoch = len(full[0]) // 2
    for rank in range(2):
        assert resumed[rank] == full[rank][per_epoch + 3 :]
    for epoch in range(2):
        seen = [
            int(x)
            for r in range(2)
            for row in full[r][epoch * per_epoch : (epoch + 1) * per_epoch]
            for x in row[0]
        ]
        # one padded sample: 21 over 2 ranks x 2
        assert set(seen) == set(range(21)) and len(seen) == 22


def test_a_distributed_sampler_becomes_our_sharding_not_a_second_one() -> None:
    from torch.utils.data import DistributedSampler

    dataset = make(10).dataset
    shards = [
        make(10, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=r, seed=7))
        for r in range(2)
    ]
    assert [(s.rank, s.world_size, s.seed) for s in shards] == [(0, 2, 7), (1, 2, 7)]
    delivered = _lockstep(shards, None)
    assert [len(d) for d in delivered] == [5, 5] and sorted(sum(delivered, [])) == list(range(10))
    ours = _lockstep(
        [make(10, batch_size=2, shuffle=True, seed=7, rank=r, world_size=2) for r in range(2)], None
    )
    assert delivered == ours


def test_sharded_sampler_splits_a_custom_stream_by_global_steps_and_resumes() -> None:
    from loader_resume import ShardedSampler
    from loader_resume.testing import assert_resumes_exactly

    dataset = make(13).dataset

    def shard(rank: int) -> Any:
        return make(
            13,
            batch_size=2,
            sampler=ShardedSampler(PlainSampler(13), dataset, num_replicas=2, rank=rank),
        )

    delivered = _lockstep([shard(0), shard(1)], None)
    order = list(iter(PlainSampler(13)))
    # the last step is padded evenly
    assert sorted(sum(delivered, [])) == sorted([*order, order[-1]])
    assert delivered[0][:2] == order[:2] and delivered[1][:2] == order[2:4]
    assert_resumes_exactly(lambda: shard(1), epochs=2, cuts=[0, 1, 3, 4])


def test_a_dataset_split_per_rank_beforehand_is_refused_not_split_again(tmp_path: Path) -> None:
    """HF ``split_dataset_by_node`` on a map-style dataset leaves no marker; the ranks compare
    fingerprints."""
    for mode in ("whole", "split"):
        launch(CHILDREN / "ddp_split_child.py", mode, tmp_path)
    whole = [json.loads((tmp_path / f"whole-{r}.json").read_text()) for r in range(2)]
    split = [json.loads((tmp_path / f"split-{r}.json").read_text()) for r in range(2)]
    assert [w["error"] for w in whole] == ["", ""]
    assert sorted(whole[0]["ids"] + whole[1]["ids"]) == list(range(24))
    for rank, result in enumerate(split):
        assert (
            "the ranks' datasets differ" in result["error"]
            and "split_dataset_by_node" in result["error"]
        )
        assert "rank=0, world_size=1" in result["error"]
        # its whole split, not a quarter
        assert sorted(result["ids"]) == list(range(rank * 12, rank * 12 + 12))


def test_a_plain_loader_refuses_a_dataset_split_per_rank_without_hanging(tmp_path: Path) -> None:
    """No integration, no check called: a plain loop over a split is refused at the first ``iter()``
    of at least one rank (each rank publishes before it looks); the job stops there."""
    launch(CHILDREN / "ddp_split_child.py", "plain-split", tmp_path)
    results = [json.loads((tmp_path / f"plain-split-{r}.json").read_text()) for r in range(2)]
    refused = [r for r in results if r["error"]]
    assert refused and all(
        "the ranks' datasets differ" in r["error"]
        and "split_dataset_by_node" in r["error"]
        and "rank=0, world_size=1" in r["error"]
        for r in refused
    )
    first = [r for r in refused if r["epoch"] == 0]
    assert first and all(r["ids"] == [] for r in first)  # refused before a single batch


def test_a_loader_on_some_ranks_only_is_neither_refused_nor_a_hang(tmp_path: Path) -> None:
    """A validation loader on rank 0 alone: nobody waits for a rank that never builds it."""
    launch(CHILDREN / "ddp_split_child.py", "plain-partial", tmp_path)
    results = [json.loads((tmp_path / f"plain-partial-{r}.json").read_text()) for r in range(2)]
    assert [r["error"] for r in results] == ["", ""]
    # (under DDP every loader shards: rank 0's is its half of the 10 items; rank 1 never built one)
    assert len(results[0]["validation"]) == 5 and set(results[0]["validation"]) < set(range(10))
    assert results[1]["validation"] == []
    for epoch in range(2):
        both = (
            results[0]["ids"][epoch * 12 : (epoch + 1) * 12]
            + results[1]["ids"][epoch * 12 : (epoch + 1) * 12]
        )
        assert sorted(both) == list(range(24))
