"""Exact resume: every cut point, 3 epochs, the whole option matrix."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, run_epochs
from support.data import Augmented, StatefulShards, ids, make


def _pair_collate(items: list[dict[str, Any]]) -> tuple[list[int], torch.Tensor]:
    return [item["id"] for item in items], torch.stack([item["torch"] for item in items])


MATRIX = [
    # (num_workers, persistent_workers, shuffle, drop_last, batch_size, collate_fn)
    (0, False, True, False, 3, None),
    (0, False, False, False, 3, None),
    (0, False, True, True, 3, None),
    (0, False, True, False, 5, _pair_collate),
    (0, False, False, True, 4, _pair_collate),
    (2, False, True, False, 3, None),
    (2, True, True, False, 3, None),
    (2, True, False, True, 4, None),
    (2, False, True, True, 5, _pair_collate),
    (2, True, True, False, 4, _pair_collate),
]


@pytest.mark.parametrize(
    ("workers", "persistent", "shuffle", "drop_last", "batch_size", "collate"), MATRIX
)
def test_every_cut_point_resumes_exactly(
    workers: int, persistent: bool, shuffle: bool, drop_last: bool, batch_size: int, collate: Any
) -> None:
    def factory() -> ResumableDataLoader[Any]:
        return make(
            10,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            persistent_workers=persistent,
            collate_fn=collate,
        )

    per_epoch = 10 // batch_size if drop_last else -(-10 // batch_size)
    # With workers every resumed pass starts processes, so cut at the interesting points only:
    # before the first batch, after it, at an epoch's last batch, at the boundary, just after it,
    # and at the end.
    cuts = (
        None
        if workers == 0
        else sorted({0, 1, per_epoch - 1, per_epoch, per_epoch + 1, 3 * per_epoch})
    )
    report = assert_resumes_exactly(factory, epochs=3, cuts=cuts)
    assert report.batches == 3 * per_epoch


def test_epochs_differ_and_each_covers_the_dataset_once() -> None:
    loader = make(10, shuffle=True)
    epochs = [sum(ids(list(loader)), []) for _ in range(3)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_state_after_last_batch_resumes_at_next_epoch_without_an_empty_epoch() -> None:
    loader = make(9, shuffle=True)
    first = list(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed = make(9, shuffle=True)
    resumed.load_state_dict(state)
    assert ids(list(resumed)) == ids(list(loader)) != ids(first)


def test_new_iter_without_load_starts_a_new_epoch_like_dataloader() -> None:
    loader = make(10, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["epoch"] == 0
    assert len(list(loader)) == 4 and loader.epoch == 2


def test_dataloader_hands_over_the_users_dataset_and_length() -> None:
    dataset = Augmented(10)
    loader = ResumableDataLoader(dataset, batch_size=3, drop_last=True)
    assert loader.dataset is dataset and loader.batch_size == 3
    assert (
        len(loader) == len(torch.utils.data.DataLoader(dataset, batch_size=3, drop_last=True)) == 3
    )


def test_batch_size_none_yields_single_items_and_resumes() -> None:
    assert_resumes_exactly(lambda: make(5, batch_size=None, shuffle=True, num_workers=2), epochs=2)
    item = next(iter(make(5, batch_size=None)))
    assert item["id"] == 0 and item["torch"].shape == (2,)


def _shuffled_in_workers() -> ResumableDataLoader[Any]:
    return make(10, batch_size=3, shuffle=True, num_workers=2)


def _stateful_stream(workers: int = 2) -> ResumableDataLoader[Any]:
    return ResumableDataLoader(StatefulShards(11), batch_size=2, num_workers=workers)


@pytest.mark.parametrize("round_trip", ["json", "torch", "dcp"])
def test_map_style_states_resume_exactly_after_each_round_trip(round_trip: str) -> None:
    """Through JSON, a weights_only torch.load, or torch.distributed.checkpoint into the fresh
    loader (a Stateful)."""
    assert_resumes_exactly(_shuffled_in_workers, round_trip=round_trip)


@pytest.mark.parametrize("round_trip", ["json", "torch"])
@pytest.mark.parametrize("workers", [0, 2])
def test_stream_states_resume_exactly_after_each_round_trip(round_trip: str, workers: int) -> None:
    assert_resumes_exactly(functools.partial(_stateful_stream, workers), round_trip=round_trip)


@pytest.mark.parametrize("build", [_shuffled_in_workers, _stateful_stream])
def test_states_resume_exactly_in_a_fresh_process(build: Any) -> None:
    """The state crosses a process boundary as torch.save bytes; a spawned process builds the loader
    and resumes."""
    report = assert_resumes_exactly(build, round_trip="process", cuts=[0, 5])
    assert report.cuts == (0, 5) and report.batches > 5


class _SetState(StatefulShards):
    """A stream whose state holds a set: JSON cannot carry it."""

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "tags": {"a"}}


def test_a_round_trip_the_state_cannot_make_is_reported() -> None:
    make_loader = lambda: ResumableDataLoader(_SetState(7), batch_size=2)  # noqa: E731
    assert_resumes_exactly(make_loader, cuts=[2])  # a deep copy carries a set
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        assert_resumes_exactly(make_loader, cuts=[2], round_trip="json")
    with pytest.raises(ValueError, match=r"round_trip='yaml': expected one of \['copy', 'json'"):
        assert_resumes_exactly(make_loader, round_trip="yaml")


def test_run_epochs_helper_labels_epochs() -> None:
    records = run_epochs(make(4, batch_size=2), 2)
    assert [epoch for epoch, _ in records] == [0, 0, 1, 1]


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_and_its_workers_are_freed_without_the_cycle_collector(persistent: bool) -> None:
    """A reference cycle through the persistent iterator makes every shutdown wait 5 s per
    worker."""
    import gc
    import weakref

    loader = make(10, num_workers=2, persistent_workers=persistent)
    iterator = iter(loader)
    next(iterator)
    list(loader)
    ref = weakref.ref(loader)
    gc.disable()
    try:
        del loader, iterator
        assert ref() is None
    finally:
        gc.enable()


def test_a_state_that_would_be_ignored_is_named_in_a_warning_once_per_case(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Loaded twice with no iter() between (the first is never used), or while an iterator is
    mid-epoch (it goes on, ignoring the state): each warned once per loader; the state then takes
    effect at the next iter()."""
    loader = make(10, shuffle=True)
    reference = ids(list(loader))
    middle = make(10, shuffle=True)
    iterator = iter(middle)
    next(iterator)
    state = middle.state_dict()
    with caplog.at_level("WARNING", logger="loader_resume"):
        loader.load_state_dict(state)
        loader.load_state_dict(state)
        loader.load_state_dict(state)
        running = iter(loader)
        next(running)
        loader.load_state_dict(state)
        loader.load_state_dict(state)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("called twice with no iter() in between" in m for m in messages) == 1
    assert sum("still mid-epoch: that iterator goes on" in m for m in messages) == 1
    assert all(m.startswith("ResumableDataLoader over ") for m in messages)
    assert ids(list(loader)) == reference[1:]  # the state loaded last, from its next batch
