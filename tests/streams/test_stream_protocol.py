"""Streams written for torchdata's StatefulDataLoader, set_epoch, dry workers, foreign
state_dicts."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, run_epochs
from support.data import StatefulShards


def _my_share(n: int) -> list[int]:
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return list(range(worker, n, workers))


class ResetsInIter(IterableDataset[dict[str, Any]]):
    """Written for StatefulDataLoader: ``__iter__`` (re)initialises the position and returns
    ``self``.

    StatefulDataLoader loads the state after ``iter()``; a loader that loads it only before would
    replay the worker's share from its start after every resume.
    """

    def __init__(self, n: int) -> None:
        self.n, self.i, self.mine = n, 0, list[int]()

    def __iter__(self) -> ResetsInIter:
        self.mine, self.i = _my_share(self.n), 0
        return self

    def __next__(self) -> dict[str, Any]:
        if self.i >= len(self.mine):
            raise StopIteration
        self.i += 1
        return {"id": self.mine[self.i - 1], "noise": torch.rand(())}

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class _Cursor:
    """A stateful iterator object, separate from its dataset (its state is reachable only through
    it)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.i = ids, 0

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.i >= len(self.ids):
            raise StopIteration
        self.i += 1
        return {"id": self.ids[self.i - 1], "noise": torch.rand(())}

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["cursor"]


class ReturnsCursor(IterableDataset[dict[str, Any]]):
    """Written for StatefulDataLoader: the dataset has no state; the iterator ``__iter__`` returns
    has."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return _Cursor(_my_share(self.n))


class StatefulShardsResetAtEnd(IterableDataset[dict[str, Any]]):
    """Uneven shards; the position resets when the iterator finishes, so the next epoch can run."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        mine = _my_share(self.n) + (
            list(range(100, 105)) if (get_worker_info() or _Zero).id == 0 else []
        )
        while self.i < len(mine):
            self.i += 1
            yield {"id": mine[self.i - 1], "noise": torch.rand(())}
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class _Zero:
    id = 0


STREAMS = [(ResetsInIter, 0), (ResetsInIter, 2), (ReturnsCursor, 0), (ReturnsCursor, 2)]


@pytest.mark.parametrize(("cls", "workers"), STREAMS)
def test_datasets_written_for_stateful_dataloader_resume_exactly(
    cls: type[IterableDataset[Any]], workers: int
) -> None:
    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(cls(11), batch_size=2, num_workers=workers)

    assert_resumes_exactly(make)


def test_a_cursor_state_is_saved_with_the_stream() -> None:
    loader = ResumableDataLoader(ReturnsCursor(11), batch_size=2)
    iterator = iter(loader)
    next(iterator), next(iterator)
    (worker,) = loader.state_dict()["stream"]["workers"]
    assert worker["iterator"] == {"cursor": 4} and worker["state"] is None


@pytest.mark.parametrize(("workers", "persistent"), [(2, False), (3, False), (2, True), (3, True)])
def test_a_worker_that_ran_dry_stays_dry_after_resume(workers: int, persistent: bool) -> None:
    """The saved state of a dry worker is its dataset's state *after* its reset; it must not replay
    its shard."""

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(StatefulShardsResetAtEnd(21), batch_size=4, num_workers=workers,
                                   persistent_workers=persistent)

    assert_resumes_exactly(make, epochs=2)
    loader = make()
    seen = [int(i) for batch in loader for i in batch["id"]]
    assert sorted(seen) == sorted([*range(21), *range(100, 105)])  # each id once per epoch


# --- set_epoch ------------------------------------------------------------------------------------
class EpochShuffledStream(IterableDataset[dict[str, Any]]):
    """Shuffles its shard by the epoch it is told (as HF streams and Mosaic do), and reports that
    epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.i = n, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        mine = _my_share(self.n)
        order = torch.randperm(
            len(mine), generator=torch.Generator().manual_seed(self.epoch)
        ).tolist()
        while self.i < len(mine):
            self.i += 1
            yield {"id": mine[order[self.i - 1]], "told": self.epoch}
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class EpochMap(Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "told": self.epoch}


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_every_copy_of_a_stream_is_told_the_loaders_epoch_and_resumes_exactly(
    workers: int, persistent: bool
) -> None:
    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(EpochShuffledStream(12), batch_size=3, num_workers=workers,
                                   persistent_workers=persistent)

    loader = make()
    passes = [[b for b in loader] for _ in range(3)]
    for epoch, batches in enumerate(passes):
        assert {int(t) for b in batches for t in b["told"]} == {epoch}
    orders = [[int(i) for b in batches for i in b["id"]] for batches in passes]
    # reshuffled, same items
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])
    assert_resumes_exactly(make, epochs=3)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_every_copy_of_a_map_dataset_is_told_the_loaders_epoch(
    workers: int, persistent: bool
) -> None:
    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(EpochMap(), batch_size=3, shuffle=True, num_workers=workers,
                                   persistent_workers=persistent)

    loader = make()
    for epoch in range(3):
        assert {int(t) for b in loader for t in b["told"]} == {epoch}
    iterator = iter(loader)
    next(iterator)
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert {int(t) for b in resumed for t in b["told"]} == {3}


# --- a state_dict that is another library's protocol ----------------------------------------------
class ForeignStateStream(IterableDataset[dict[str, Any]]):
    """Like litdata's and Mosaic's datasets: ``state_dict`` takes required arguments."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in _my_share(self.n):
            yield {"id": i, "noise": torch.rand(())}

    def state_dict(self, num_samples_yielded: int, num_workers: int) -> dict[str, Any]:
        raise AssertionError("the loader must not call a state_dict that needs arguments")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("the loader must not load a state it did not save")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_foreign_state_dict_never_breaks_iteration_and_resumes_by_replay(
        workers: int, caplog: pytest.LogCaptureFixture) -> None:
    class Foreign(ForeignStateStream):
        pass

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(Foreign(9), batch_size=2, num_workers=workers)

    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        make()
    assert (
        "Foreign.state_dict(num_samples_yielded, num_workers) takes required arguments"
        in caplog.text
    )
    assert "For O(1) resume use that library's own loader" in caplog.text
    assert len(run_epochs(make(), 2)) == 2 * 5  # 9 items, batches of 2, whatever the worker count
    assert_resumes_exactly(make)


def test_a_version_1_stream_state_still_loads() -> None:
    loader = ResumableDataLoader(StatefulShardsResetAtEnd(9), batch_size=2, num_workers=2)
    iterator = iter(loader)
    expected = [next(iterator) for _ in range(3)]
    state = copy.deepcopy(loader.state_dict())
    rest = [b["id"].tolist() for b in iterator]
    # version 1: the stream's delivered count was the state's position; workers had three keys
    stream = {k: v for k, v in state["stream"].items() if k != "delivered"}
    old = {
        **state,
        "version": 1,
        "position": state["stream"]["delivered"],
        "stream": {
            **stream,
            "workers": [
                {k: w[k] for k in ("batches", "items", "state")} for w in state["stream"]["workers"]
            ],
        },
    }
    resumed = ResumableDataLoader(StatefulShardsResetAtEnd(9), batch_size=2, num_workers=2)
    resumed.load_state_dict(old)
    assert [b["id"].tolist() for b in resumed] == rest and len(expected) == 3


# --- keyed randomness in a stream's collate -------------------------------------------------------
def _mixing_collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor([x["id"] for x in items]), "mix": torch.rand(len(items))}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streams_collate_randomness_is_keyed_and_the_callers_untouched(workers: int) -> None:
    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            ResetsInIter(11), batch_size=2, num_workers=workers, collate_fn=_mixing_collate
        )

    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = run_epochs(make(), 2)
    assert torch.equal(torch.rand(3), expected)
    assert run_epochs(make(), 2) == first
    assert_resumes_exactly(make)


# --- bad input in the new state fields ------------------------------------------------------------
def _stream_state(cls: type[IterableDataset[Any]]) -> dict[str, Any]:
    loader = ResumableDataLoader(cls(9), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    return copy.deepcopy(loader.state_dict())


def test_a_corrupted_dry_flag_is_refused_naming_the_field() -> None:
    from loader_resume import StateError

    state = _stream_state(StatefulShardsResetAtEnd)
    state["stream"]["workers"][0]["dry"] = "yes"
    with pytest.raises(
        StateError, match=r"'stream.workers\[0\].dry': saved 'yes', expected a bool"
    ):
        ResumableDataLoader(StatefulShardsResetAtEnd(9), batch_size=2).load_state_dict(state)
    state["stream"]["workers"][0] = {"batches": 1, "items": 2, "state": {"i": 2}, "dri": False}
    with pytest.raises(
        StateError,
        match=r"'stream.workers\[0\]'.*expected a dict with keys batches, items, state "
        r"and optionally before_epoch, dry, iterator, own, self_iterator",
    ):
        ResumableDataLoader(StatefulShardsResetAtEnd(9), batch_size=2).load_state_dict(state)


def test_an_iterator_state_for_an_iterator_without_state_is_refused_naming_the_field() -> None:
    """A cursor state loaded where iter(dataset) returns a plain generator: never silently
    ignored."""
    from loader_resume import StateError

    class SameNameNoCursor(IterableDataset[dict[str, Any]]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return iter([{"id": i, "noise": torch.rand(())} for i in range(self.n)])

    state = _stream_state(ReturnsCursor)
    resumed = ResumableDataLoader(SameNameNoCursor(9), batch_size=2)
    resumed.load_state_dict(state)
    with pytest.raises(
        StateError,
        match=r"'stream.workers\[0\].iterator': saved \{'cursor': 2\}, expected None. "
        r"iter\(SameNameNoCursor\) returned a list_iterator, which has no state_dict",
    ):
        next(iter(resumed))


class ArrayStream(IterableDataset[Any]):
    """Yields numpy arrays (whose == is elementwise): the stream must never compare items."""

    def __iter__(self) -> Iterator[Any]:
        return iter([np.full(3, i) for i in _my_share(8)])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_of_numpy_arrays_is_delivered_untouched(workers: int) -> None:
    loader = ResumableDataLoader(ArrayStream(), batch_size=2, num_workers=workers)
    assert sorted(int(row[0]) for batch in loader for row in batch) == list(range(8))
    assert_resumes_exactly(
        lambda: ResumableDataLoader(ArrayStream(), batch_size=2, num_workers=workers)
    )


class ShufflesInIter(IterableDataset[dict[str, Any]]):
    """Draws from torch's global generator in __iter__ (shuffles its share) and keeps a position on
    itself."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        mine = _my_share(self.n)
        # drawn when iter() is called
        return self._items([mine[j] for j in torch.randperm(len(mine)).tolist()])

    def _items(self, order: list[int]) -> Iterator[dict[str, Any]]:
        while self.i < len(order):
            self.i += 1
            yield {"id": order[self.i - 1], "noise": torch.rand(())}
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class RestoresGlobalRng(IterableDataset[dict[str, Any]]):
    """Like torchdata's test iterator: its state carries torch.get_rng_state(), set back on load."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        mine = _my_share(self.n)
        while self.i < len(mine):
            self.i += 1
            yield {"id": mine[self.i - 1], "noise": torch.rand(())}
        self.i = 0

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "g": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["g"])


@pytest.mark.parametrize("cls", [ShufflesInIter, RestoresGlobalRng])
@pytest.mark.parametrize("workers", [0, 2])
def test_what_opening_a_stream_draws_or_restores_does_not_shift_the_keyed_values(
        cls: type[IterableDataset[Any]], workers: int) -> None:
    """__iter__'s draws are keyed by (seed, epoch, rank, worker), not by the batch that opens the
    stream, and a load_state_dict that sets the global generator back does not displace the batch's
    key."""
    assert_resumes_exactly(lambda: ResumableDataLoader(cls(13), batch_size=2, num_workers=workers))


def test_a_worker_stream_is_one_per_loader_and_process_wherever_it_travels() -> None:
    """Pickled (a task sent to a worker, a dataset to a spawned worker) a loader's WorkerStream
    resolves to the one copy of this process, never another loader's: two stream loaders iterated in
    turn at num_workers=0 each give the batches they give alone, and their states resume each
    exactly."""
    import pickle

    from loader_resume.streams.stream_worker import WorkerStream

    first, second = WorkerStream(), WorkerStream()
    assert (
        pickle.loads(pickle.dumps(first)) is first and pickle.loads(pickle.dumps(second)) is second
    )

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(StatefulShards(12), batch_size=2)

    alone = [b["id"].tolist() for b in make()]
    a, b = make(), make()
    ia, ib = iter(a), iter(b)
    together = [[next(ia)["id"].tolist(), next(ib)["id"].tolist()] for _ in range(3)]
    assert [pair[0] for pair in together] == [pair[1] for pair in together] == alone[:3]
    state = a.state_dict()
    assert [x["id"].tolist() for x in ib] == alone[3:]
    resumed = make()
    resumed.load_state_dict(state)
    assert [x["id"].tolist() for x in resumed] == alone[3:]


def test_a_copied_loader_has_a_worker_stream_of_its_own() -> None:
    """``copy.deepcopy`` of a stream loader (num_workers=0) is another loader: iterated in turn,
    each gives the batches it gives alone."""

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(StatefulShards(12), batch_size=2)

    alone = [b["id"].tolist() for b in make()]
    single = make()
    it = iter(single)
    next(it), next(it), next(it)
    original = make()
    copied = copy.deepcopy(original)
    ia, ib = iter(original), iter(copied)
    assert [[next(ia)["id"].tolist(), next(ib)["id"].tolist()] for _ in range(3)] == [
        [i, i] for i in alone[:3]
    ]
    # each counted its own batches
    assert original.state_dict() == copied.state_dict() == single.state_dict()
