"""Custom samplers, batch samplers and stateful datasets, incl. torchdata's tutorial."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from loader_resume import ResumableDataLoader, StateError
from loader_resume.testing import assert_resumes_exactly
from support.data import Augmented, PlainSampler, ids


# --- ported from torchdata's "Stateful DataLoader Tutorial" (map-style part) ----------------------
class MySampler(torch.utils.data.Sampler[int]):
    def __init__(self, high: int, seed: int, limit: int) -> None:
        self.seed, self.high, self.limit = seed, high, limit
        self.g = torch.Generator()
        self.g.manual_seed(self.seed)
        self.i = 0

    def __iter__(self) -> Iterator[int]:
        while self.i < self.limit:
            val = int(torch.randint(high=self.high, size=(1,), generator=self.g))
            self.i += 1
            yield val

    def __len__(self) -> int:
        return self.limit

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.i = state_dict["i"]
        self.g.set_state(state_dict["rng"])

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "rng": self.g.get_state()}


class NoisyRange(torch.utils.data.Dataset[float]):
    def __init__(self, high: int, mean: float, std: float) -> None:
        self.high, self.mean, self.std = high, torch.tensor([float(mean)]), float(std)

    def __len__(self) -> int:
        return self.high

    def __getitem__(self, idx: int) -> float:
        if not (0 <= idx < self.high):
            raise IndexError()
        x = torch.normal(self.mean, self.std)
        noise = x.item()
        return idx + noise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["rng"])

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchdata_tutorial_map_style(num_workers: int) -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(NoisyRange(5, 1, 1), sampler=MySampler(5, 1, 10), batch_size=2,
                                   drop_last=False, num_workers=num_workers)

    dl = build()
    batches = []
    for i, batch in enumerate(dl):
        batches.append(batch)
        if i == 2:
            sd = dl.state_dict()
    resumed = build()  # the tutorial reloads into the same object; a fresh one is the harder case
    resumed.load_state_dict(sd)
    batches2 = list(resumed)
    assert len(batches) == 5 and len(batches2) == 2
    assert all(torch.equal(a, b) for a, b in zip(batches[3:], batches2, strict=True))
    dl.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(batches[3:], list(dl), strict=True))


class CountingSampler(torch.utils.data.Sampler[int]):
    """A stateful sampler that counts how far it has been drawn, to expose prefetch skew."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Iterator[int]:
        while self.i < self.n:
            self.i += 1
            yield (self.i * 7) % self.n
        self.i = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def test_stateful_sampler_state_is_taken_at_the_last_yielded_batch_not_the_prefetched_one() -> None:
    loader = ResumableDataLoader(
        Augmented(20), sampler=CountingSampler(20), batch_size=2, num_workers=2
    )
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    assert loader.sampler.i > 4  # workers prefetched ahead
    assert loader.state_dict()["sampler_state"] == {"i": 4}


def test_pass_ended_over_a_stateful_sampler_holds_its_own_state_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop that left a pass on purpose (``pass_ended=True``) over a user's sampler that keeps its
    own position: the state is the sampler's ``state_dict()`` as it is then — 4 indices delivered
    and the next batch's 2 already read from it (a mid-pass state would hold 4: where the pass
    continues) — and a warning says that what the next pass does with it is the sampler's."""
    loader = ResumableDataLoader(Augmented(20), sampler=CountingSampler(20), batch_size=2)
    for number, _ in enumerate(loader):
        if number == 1:
            break
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        state = loader.state_dict(pass_ended=True)
    assert state["sampler_state"] == loader.sampler.state_dict() == {"i": 6}
    assert loader.state_dict()["sampler_state"] == {"i": 4}
    assert (
        "a pass over CountingSampler was left before its end: the state holds that sampler's own"
        in caplog.text
    )


def test_stateful_sampler_resumes_at_every_cut() -> None:
    assert_resumes_exactly(
        lambda: ResumableDataLoader(Augmented(11), sampler=CountingSampler(11), batch_size=3),
        epochs=2,
    )


def test_stateless_sampler_is_replayed_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(Augmented(10), sampler=PlainSampler(10), batch_size=3)

    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        assert_resumes_exactly(build, epochs=2)
    assert "PlainSampler has no state_dict(): replaying" in caplog.text


def test_torch_random_sampler_with_replacement_is_replayed_exactly() -> None:
    """It draws its seed from the global RNG when iteration starts; we key that draw."""

    def build() -> ResumableDataLoader[Any]:
        dataset = Augmented(10)
        return ResumableDataLoader(
            dataset, sampler=torch.utils.data.RandomSampler(dataset, replacement=True), batch_size=3
        )

    assert_resumes_exactly(build, epochs=2)


def test_torch_random_sampler_is_treated_as_shuffle() -> None:
    dataset = Augmented(10)
    explicit = ResumableDataLoader(
        dataset, sampler=torch.utils.data.RandomSampler(dataset), batch_size=3
    )
    assert explicit.state_dict()["shuffle"] and explicit.state_dict()["source"] == "permutation"
    assert ids(list(explicit)) == ids(
        list(ResumableDataLoader(dataset, shuffle=True, batch_size=3))
    )


class Batches(torch.utils.data.Sampler[list[int]]):
    """A batch sampler of uneven batches, with state."""

    def __init__(self) -> None:
        self.plan = [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9]]
        self.i = 0

    def __iter__(self) -> Iterator[list[int]]:
        while self.i < len(self.plan):
            self.i += 1
            yield self.plan[self.i - 1]
        self.i = 0

    def __len__(self) -> int:
        return len(self.plan)

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_sampler_resumes_exactly(num_workers: int) -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(Augmented(10), batch_sampler=Batches(), num_workers=num_workers)

    assert ids(list(build())) == Batches().plan
    assert_resumes_exactly(build, epochs=2, cuts=None if num_workers == 0 else [0, 2, 4, 5])


def test_batch_sampler_is_sharded_by_batches_across_ranks() -> None:
    shards = [
        ResumableDataLoader(Augmented(10), batch_sampler=Batches(), rank=r, world_size=2)
        for r in (0, 1)
    ]
    assert [ids(list(s)) for s in shards] == [[[0, 1], [5]], [[2, 3, 4], [6, 7, 8, 9]]]


class StatefulDataset(Augmented):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.counter = 0

    def state_dict(self) -> dict[str, int]:
        return {"counter": self.counter}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.counter = state["counter"]


def test_map_style_dataset_state_is_saved_and_restored() -> None:
    loader = ResumableDataLoader(StatefulDataset(6), batch_size=2)
    loader.dataset.counter = 17
    state = loader.state_dict()
    assert state["dataset_state"] == {"counter": 17}
    fresh = ResumableDataLoader(StatefulDataset(6), batch_size=2)
    fresh.load_state_dict(state)
    assert fresh.dataset.counter == 17


def test_dataset_state_for_a_dataset_without_state_is_refused() -> None:
    state = ResumableDataLoader(StatefulDataset(6), batch_size=2).state_dict()
    with pytest.raises(StateError, match=r"'dataset_state'.*Augmented has no load_state_dict"):
        ResumableDataLoader(Augmented(6), batch_size=2).load_state_dict(state)


def test_dataset_state_reaches_persistent_workers_after_a_load() -> None:
    class Offset(StatefulDataset):
        def __getitem__(self, index: int) -> dict[str, Any]:
            return {**super().__getitem__(index), "counter": self.counter}

    loader = ResumableDataLoader(Offset(4), batch_size=2, num_workers=2, persistent_workers=True)
    assert [b["counter"].tolist() for b in loader] == [[0, 0], [0, 0]]
    state = loader.state_dict()
    state["dataset_state"] = {"counter": 5}
    loader.load_state_dict(state)
    assert [b["counter"].tolist() for b in loader] == [[5, 5], [5, 5]]
