"""What torchdata's StatefulDataLoader suite checks by reading its own state layout, checked on
ours.

torchdata's ``test_state_dict.py`` (run against our class by ``benchmarks/torchdata_suites.py``)
asserts some behaviours through ``_snapshot``/``_worker_snapshots``/``fetcher_state``, which our
smaller state does not have. Each behaviour is asserted here on our layout, with datasets of our own
written the way theirs are.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, run_epochs


def _share(n: int) -> list[int]:
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return list(range(worker, n, workers))


def _identity(items: list[Any]) -> list[Any]:
    return items


class CountsItsEpochs(IterableDataset[tuple[int, int]]):
    """Yields ``(item, its own epoch counter)``; the counter moves when the stream ends
    (TestMultiEpochState)."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.epoch, self.resume = n, 0, 0, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        mine, self.i, self.resume = _share(self.n), self.resume, 0
        while self.i < len(mine):
            self.i += 1
            yield mine[self.i - 1], self.epoch
        self.i, self.epoch = 0, self.epoch + 1  # ready for its next epoch

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume, self.epoch = state["i"], state["epoch"]


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True), (2, False)])
def test_a_stream_counting_its_own_epochs_resumes_exactly_across_epochs(
    workers: int, persistent: bool
) -> None:
    """Where its copies live on (in process, persistent workers) the counter advances, and a state
    taken at an epoch's end carries it; fresh workers start each epoch from the main process's copy,
    resumed or not."""

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(CountsItsEpochs(10), batch_size=2, num_workers=workers,
                                   persistent_workers=persistent, collate_fn=_identity)

    loader = make()
    seen = [sorted({epoch for batch in loader for _, epoch in batch}) for _ in range(3)]
    assert seen == ([[0], [1], [2]] if workers == 0 or persistent else [[0], [0], [0]])
    assert_resumes_exactly(make, epochs=3)


class BuildsPositionInIter(IterableDataset[int]):
    """Its own iterator; its position exists only once ``__iter__`` ran
    (TestStateInitializationDataset)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> BuildsPositionInIter:
        self.mine, self.at = _share(self.n), 0
        return self

    def __next__(self) -> int:
        if self.at >= len(self.mine):
            raise StopIteration
        self.at += 1
        return self.mine[self.at - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"mine": self.mine, "at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # fails on a fresh copy only if called before iter()
        self.mine, self.at = state["mine"], state["at"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_is_its_own_iterator_gets_its_state_after_iter_only(workers: int) -> None:
    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(BuildsPositionInIter(12), batch_size=2, num_workers=workers)

    assert_resumes_exactly(make)
    loader = make()
    iterator = iter(loader)  # held: a dropped iterator's pass is over
    next(iterator)
    entry = loader.state_dict()["stream"]["workers"][0]
    # stored once (TestDatasetIteratorStateDuplication): as the dataset's state, marked as its own
    # iterator
    assert entry["state"] == {"mine": _share_of(0, workers, 12), "at": 2}
    assert entry["iterator"] is None and entry["self_iterator"] is True


def _share_of(worker: int, workers: int, n: int) -> list[int]:
    return list(range(worker, n, max(workers, 1)))


class CountsIterCalls(IterableDataset[int]):
    """Counts ``__iter__`` calls in its state (TestSingleIterCalled)."""

    def __init__(self, n: int) -> None:
        self.n, self.opened, self.resume = n, 0, 0

    def __iter__(self) -> Iterator[int]:
        self.opened += 1
        mine, self.at, self.resume = _share(self.n), self.resume, 0
        while self.at < len(mine):
            self.at += 1
            yield mine[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"opened": self.opened, "at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.opened, self.resume = state["opened"], state["at"]


@pytest.mark.parametrize("workers", [0, 2])
def test_iter_is_called_once_per_worker_per_pass_also_after_a_resume(workers: int) -> None:
    def opened(loader: ResumableDataLoader[Any]) -> list[int]:
        return [w["state"]["opened"] for w in loader.state_dict()["stream"]["workers"]]

    loader = ResumableDataLoader(CountsIterCalls(20), batch_size=2, num_workers=workers)
    iterator = iter(loader)
    for _ in range(max(workers, 1)):
        next(iterator)
    state = loader.state_dict()
    assert opened(loader) == [1] * max(workers, 1)
    resumed = ResumableDataLoader(CountsIterCalls(20), batch_size=2, num_workers=workers)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    for _ in range(max(workers, 1)):
        next(iterator)
    assert opened(resumed) == [2] * max(workers, 1)  # the loaded count, plus this pass's one iter()


class GrowingState(IterableDataset[int]):
    """``state_dict()`` returns the live list it keeps appending to
    (TestDynamicStateIterableDataset)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.resume = n, list[int](), list[int]()

    def __iter__(self) -> Iterator[int]:
        mine, self.seen, self.resume = _share(self.n), self.resume, []
        for item in mine[len(self.seen):]:
            self.seen.append(item)
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume = list(state["seen"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_taken_state_is_a_snapshot_not_the_live_object(workers: int) -> None:
    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            GrowingState(16), batch_size=2, num_workers=workers, collate_fn=_identity
        )

    loader = make()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    kept = copy.deepcopy(state)
    rest = list(iterator)
    assert state == kept and loader.state_dict() != kept
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == rest


class _Items(Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_taken_before_iterating_restarts_the_epoch(persistent: bool) -> None:
    """TestInitialState: a state_dict() from before the first batch, loaded mid-pass, replays the
    whole epoch."""

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            _Items(),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            persistent_workers=persistent,
            collate_fn=_identity,
        )

    expected = run_epochs(make(), 2)
    loader = make()
    initial = loader.state_dict()
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    loader.load_state_dict(initial)
    assert loader.state_dict() == initial
    assert run_epochs(loader, 2) == expected


class _Toggles(IterableDataset[int]):
    """A state that is a mutable dict toggled per item, like torchdata's
    PeriodicStateIterableDataset."""

    def __init__(self) -> None:
        self.flags, self.step = {0: 0, 1: 0, 2: 0}, 0

    def __iter__(self) -> Iterator[int]:
        while self.step < 30:
            self.step += 1
            self.flags[self.step % 3] ^= 1
            yield self.flags[self.step % 3]

    def state_dict(self) -> dict[str, Any]:
        return {"flags": self.flags, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flags, self.step = dict(state["flags"]), state["step"]


def test_a_state_requested_right_after_a_load_resumes_exactly_and_counts_from_there() -> None:
    """TestFastStateDictRequestRoundRobin: persistent workers, a state asked for before every worker
    delivered again since the load."""

    def make() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(_Toggles(), batch_size=1, num_workers=2, persistent_workers=True,
                                   collate_fn=_identity, snapshot_every_n_steps=0)

    loader = make()
    iterator = iter(loader)
    for _ in range(7):
        next(iterator)
    state = loader.state_dict()
    next(iterator)
    after_one = loader.state_dict()
    rest = list(iterator)
    loader.load_state_dict(state)
    iterator = iter(loader)
    next(iterator)
    again = loader.state_dict()
    assert (
        again == after_one and again["stream"]["delivered"] == state["stream"]["delivered"] + 1 == 8
    )
    resumed = make()
    resumed.load_state_dict(again)
    assert list(resumed) == rest


class _Seeds(Dataset[tuple[int, int, int]]):
    """Reports what torch says the seed is: at worker start, in the worker, and while reading an
    item."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        info = get_worker_info()
        at_start = getattr(self, "at_start", -1)
        return at_start, info.seed if info is not None else -1, torch.initial_seed()


def _remember_seed(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.at_start = torch.initial_seed()  # type: ignore[attr-defined]


def test_initial_seed_is_torchs_in_worker_init_fn_and_the_batch_key_while_reading() -> None:
    """The decision (docs: Compared with the built-ins): worker_init_fn sees torch's distinct
    per-worker seed, to seed other libraries from; inside a keyed fetch torch.initial_seed() is the
    seed of the stream the item draws from, the batch's key: the same at any num_workers, an int64,
    distinct per batch."""

    def seeds(workers: int) -> list[tuple[int, int, int]]:
        loader = ResumableDataLoader(
            _Seeds(),
            batch_size=2,
            shuffle=True,
            num_workers=workers,
            worker_init_fn=_remember_seed if workers else None,
            collate_fn=_identity,
        )
        return [item for batch in loader for item in batch]

    in_workers, in_process = seeds(2), seeds(0)
    starts = {(at_start, worker_seed) for at_start, worker_seed, _ in in_workers}
    assert len(starts) == 2 and all(at_start == worker_seed for at_start, worker_seed in starts)
    keys = [key for *_, key in in_workers]
    assert keys == [key for *_, key in in_process]
    assert len(set(keys)) == 4 and all(0 <= key < 2**63 for key in keys)  # one key per batch of 2
    assert torch.tensor(keys).dtype == torch.int64


@pytest.mark.parametrize("field", ["self_iterator", "before_epoch"])
def test_a_corrupted_flag_is_refused_naming_the_field(field: str) -> None:
    from loader_resume import StateError

    loader = ResumableDataLoader(BuildsPositionInIter(12), batch_size=2)
    next(iter(loader))
    state = loader.state_dict()
    state["stream"]["workers"][0][field] = "yes"
    with pytest.raises(
        StateError, match=rf"'stream.workers\[0\].{field}': saved 'yes', expected a bool"
    ):
        ResumableDataLoader(BuildsPositionInIter(12), batch_size=2).load_state_dict(state)


class _NowAGenerator(BuildsPositionInIter):
    def __iter__(self) -> Iterator[int]:  # type: ignore[override]
        yield from _share(self.n)


def test_a_state_of_a_self_iterating_dataset_is_refused_when_iter_no_longer_returns_it() -> None:
    from loader_resume import StateError

    loader = ResumableDataLoader(BuildsPositionInIter(12), batch_size=2)
    iterator = iter(loader)  # held: a dropped iterator's pass is over
    next(iterator)
    resumed = ResumableDataLoader(_NowAGenerator(12), batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    with pytest.raises(
        StateError, match=r"'stream.workers\[0\].self_iterator': saved True, expected False"
    ):
        next(iter(resumed))
