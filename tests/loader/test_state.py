"""The state: tiny, plain and versioned; strict on bad input, naming the field; older versions still
load."""

from __future__ import annotations

import copy
import json
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset

from loader_resume import STATE_VERSION, ResumableDataLoader, StateError
from support.data import Augmented, StatefulShards, ids, make


class Huge(Dataset[int]):
    """A dataset of 10^9 samples that costs nothing: the item is its index."""

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("n", [10, 10**9])
def test_state_is_plain_json_under_one_kilobyte(n: int) -> None:
    loader = ResumableDataLoader(Augmented(10) if n == 10 else Huge(), batch_size=4, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    text = json.dumps(state)
    assert json.loads(text) == state and len(text.encode()) < 1024
    assert (
        state["version"] == STATE_VERSION and state["dataset_len"] == n and state["position"] == 4
    )


def test_billion_sample_shuffle_starts_without_materialising_a_permutation() -> None:
    tracemalloc.start()
    try:
        loader = ResumableDataLoader(Huge(), batch_size=64, shuffle=True)
        iterator = iter(loader)
        first = [next(iterator) for _ in range(3)]
        state = loader.state_dict()
        state["position"] = 9 * 10**8  # 90 % into the epoch: as cheap as the start
        deep = ResumableDataLoader(Huge(), batch_size=64, shuffle=True)
        deep.load_state_dict(state)
        deep_batch = next(iter(deep))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20  # a materialised permutation would be 8 GB
    assert len(set(torch.cat(first).tolist())) == 192 and deep_batch.shape == (64,)


# --- bad input ------------------------------------------------------------------------------------
def _saved() -> dict[str, Any]:
    loader = make(10, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (lambda s: s.update(dataset_len=11), "dataset_len", r"saved 11, expected 10"),
        (lambda s: s.update(seed=5), "seed", r"saved 5, expected 0"),
        (lambda s: s.update(keying="sample"), "keying", r"saved 'sample', expected 'batch'"),
        (lambda s: s.update(shuffle=False), "shuffle", r"saved False, expected True"),
        (
            lambda s: s.update(version=99),
            "version",
            r"saved 99, expected one of \[1, 2, 3\].*unknown loader-resume release",
        ),
        (lambda s: s.pop("position"), "position", r"saved '<missing>'"),
        (
            lambda s: s.update(positon=s.pop("position")),
            "positon",
            r"'positon': saved 3, expected no such key. Unknown key; did you mean 'position'\?",
        ),
        (lambda s: s.update(epoch="1"), "epoch", r"saved '1', expected an int >= 0"),
        (lambda s: s.update(position=11), "position", r"saved 11, expected at most dataset_len=10"),
        (
            lambda s: s.update(source="sampler:x.Y"),
            "source",
            r"saved 'sampler:x.Y', expected 'permutation'",
        ),
    ],
)
def test_bad_state_names_field_saved_and_expected(edit: Any, field: str, message: str) -> None:
    state = _saved()
    edit(state)
    loader = make(10, shuffle=True)
    with pytest.raises(StateError, match=message) as caught:
        loader.load_state_dict(state)
    assert caught.value.field == field
    assert ids(list(loader)) == ids(list(make(10, shuffle=True)))  # still usable, untouched


def _stream_state(delivered: int) -> dict[str, Any]:
    loader = ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2)
    iterator = iter(loader)
    for _ in range(delivered):
        next(iterator)
    return copy.deepcopy(loader.state_dict())


def test_position_counts_global_samples_and_a_stream_counts_its_batches_under_its_own_name() -> (
    None
):
    loader = make(10, batch_size=3, world_size=2, rank=1)
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["position"] == 6  # one global step of two ranks' batches of three
    state = _stream_state(3)
    assert state["position"] is None and state["stream"]["delivered"] == 3


def test_a_version_2_stream_state_whose_position_counted_batches_still_resumes() -> None:
    state = _stream_state(3)
    rest = ids(list(_resumed(state)))
    stream = {key: value for key, value in state["stream"].items() if key != "delivered"}
    old = {**state, "version": 2, "position": 3, "stream": stream}
    resumed = _resumed(old)
    assert resumed.state_dict()["stream"] == state["stream"]  # read back in this version's layout
    assert ids(list(resumed)) == rest and len(rest) > 0


def _resumed(state: dict[str, Any]) -> ResumableDataLoader[Any]:
    loader = ResumableDataLoader(StatefulShards(9), batch_size=2, num_workers=2)
    loader.load_state_dict(copy.deepcopy(state))
    return loader


def test_a_position_of_the_wrong_kind_is_refused() -> None:
    stream = _stream_state(1)
    with pytest.raises(StateError, match=r"'position': saved 2, expected None") as caught:
        _resumed({**stream, "position": 2})
    assert caught.value.field == "position"
    with pytest.raises(StateError, match=r"'position': saved None, expected an int >= 0"):
        make(10, shuffle=True).load_state_dict({**_saved(), "position": None})


def test_garbage_is_refused() -> None:
    with pytest.raises(StateError, match="'<state>': saved 'str', expected a dict"):
        make(10).load_state_dict("not a state")  # type: ignore[arg-type]


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 2**40)
    | st.text(max_size=8)
    | st.floats(allow_nan=True),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(junk=st.dictionaries(st.text(max_size=12), _values, max_size=8))
def test_random_dicts_are_refused_with_a_value_error(junk: dict[str, Any]) -> None:
    loader = make(10, shuffle=True)
    with pytest.raises(ValueError):
        loader.load_state_dict(junk)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(_saved())), value=_values)
def test_one_corrupted_field_is_refused_or_resumes_validly(field: str, value: Any) -> None:
    """A single field set to a random value either is refused, or is a legal state (e.g. an elastic
    change)."""
    state = copy.deepcopy(_saved())
    state[field] = value
    loader = make(10, shuffle=True)
    try:
        loader.load_state_dict(state)
    except ValueError:
        return
    delivered = sum(ids(list(loader)), [])
    assert len(set(delivered)) == len(delivered) and set(delivered) <= set(range(10))


def test_assert_delivers_rest_exactly_once_names_lost_and_repeated_samples() -> None:
    from loader_resume.testing import assert_delivers_rest_exactly_once

    assert_delivers_rest_exactly_once([3, 1], [0, 2, 4], 5)
    assert_delivers_rest_exactly_once([0, 1, 2], [3, 4, 0], 5, padding=1)
    with pytest.raises(AssertionError, match=r"1 sample\(s\) never delivered: \[4\]"):
        assert_delivers_rest_exactly_once([0, 1], [2, 3], 5)
    with pytest.raises(AssertionError, match=r"1 repeat\(s\), 0 allowed as padding: \[1\]"):
        assert_delivers_rest_exactly_once([0, 1], [1, 2, 3, 4], 5)


def _reads_everything(loader: ResumableDataLoader[Any]) -> None:
    for _ in range(3):
        loader.state_dict(), loader.epoch, loader.batches_delivered
        if not isinstance(loader.dataset, StatefulShards):
            len(loader), loader.planned_indices()


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_reading_a_loader_changes_nothing(kind: str) -> None:
    """Its getters, asked any number of times before, during and between passes (one left
    mid-epoch), leave the batches and states those of a loader never asked."""

    def run(ask: bool) -> list[Any]:
        loader = make(10, shuffle=True, batch_size=3) if kind == "map" else \
            ResumableDataLoader(StatefulShards(12), batch_size=2)
        seen: list[Any] = []
        for epoch in range(3):
            for i, batch in enumerate(loader):
                if ask:
                    _reads_everything(loader)
                seen += [batch["id"].tolist(), loader.state_dict()]
                if epoch == 1 and i == 1:
                    break  # left mid-epoch: the next iter() starts the next epoch
            if ask:
                _reads_everything(loader)
        return seen

    assert run(ask=True) == run(ask=False)


def test_planned_indices_name_the_next_pass_after_one_left_mid_epoch() -> None:
    loader = make(10, shuffle=True, batch_size=3)
    next(iter(loader))
    planned = loader.planned_indices()
    # epoch 1 came whole
    assert [batch["id"].tolist() for batch in loader] == planned and loader.epoch == 2


class _FailsToStartOnce:
    """A dataset whose ``set_epoch`` raises once (a transient error as an ``iter()`` begins)."""

    failed = False

    def set_epoch(self, epoch: int) -> None:
        if not type(self).failed:
            type(self).failed = True
            raise OSError("transient")


class _MapFailsOnce(_FailsToStartOnce, Augmented):
    failed = False


class _StreamFailsOnce(_FailsToStartOnce, StatefulShards):
    failed = False


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_an_iter_that_fails_as_it_begins_leaves_the_loaded_position(kind: str) -> None:
    """A failed ``iter()`` (the dataset raised in ``set_epoch``) leaves the state and the next
    ``iter()`` where the load put them: a save on that exception, or a retry, continues exactly."""
    def make(dataset: Any) -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            dataset, batch_size=2, **({"shuffle": True} if kind == "map" else {})
        )

    def data(fails: bool) -> Any:
        if kind == "map":
            return _MapFailsOnce(10) if fails else Augmented(10)
        return _StreamFailsOnce(12) if fails else StatefulShards(12)

    uninterrupted = [b["id"].tolist() for b in make(data(False))]
    first = make(data(False))
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    resumed = make(data(True))
    resumed.load_state_dict(state)
    with pytest.raises(OSError, match="transient"):
        iter(resumed)
    assert resumed.state_dict() == state
    assert [b["id"].tolist() for b in resumed] == uninterrupted[2:]
