"""Keyed randomness: values are a function of (seed, epoch, position), never of workers or
history."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data._utils.fetch import _MapDatasetFetcher

from loader_resume.keyed.keyed_rng import GENERATORS, CallerRng, derive_key, generator_mask
from loader_resume.keyed.worker_fetch import (
    SEED_AHEAD,
    KeyedIndices,
    KeySpec,
    SeedAheadCollate,
    WorkerFetch,
)
from loader_resume.testing import run_epochs
from support.data import make


def _values(batches: list[dict[str, Any]]) -> dict[int, tuple[Any, ...]]:
    """id -> the values its sample drew."""
    out = {}
    for batch in batches:
        for i, index in enumerate(batch["id"].tolist()):
            out[index] = (
                tuple(batch["torch"][i].tolist()),
                float(batch["numpy"][i]),
                float(batch["random"][i]),
            )
    return out


@pytest.mark.parametrize("keying", ["batch", "sample"])
def test_values_do_not_depend_on_num_workers(keying: str) -> None:
    runs = [run_epochs(make(12, num_workers=w, shuffle=True, keying=keying), 2) for w in (0, 2, 3)]
    assert runs[0] == runs[1] == runs[2]


def test_batch_mode_values_do_not_depend_on_caller_rng() -> None:
    first = run_epochs(make(9, shuffle=True), 1)
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert run_epochs(make(9, shuffle=True), 1) == first


def test_sample_mode_values_do_not_depend_on_batch_size_or_world_size() -> None:
    one = _values(list(make(12, batch_size=3, shuffle=True, keying="sample")))
    other = _values(list(make(12, batch_size=5, shuffle=True, keying="sample")))
    shards = [
        make(12, batch_size=2, shuffle=True, keying="sample", rank=r, world_size=3)
        for r in range(3)
    ]
    sharded = {k: v for loader in shards for k, v in _values(list(loader)).items()}
    assert one == other == sharded and len(one) == 12


def test_batch_mode_samples_of_one_batch_draw_different_values() -> None:
    batch = next(iter(make(6, batch_size=6)))
    assert len({tuple(row.tolist()) for row in batch["torch"]}) == 6


def test_seed_changes_values_and_order() -> None:
    assert run_epochs(make(10, shuffle=True, seed=1), 1) != run_epochs(
        make(10, shuffle=True, seed=2), 1
    )


def test_keying_off_leaves_generators_alone() -> None:
    torch.manual_seed(7)
    plain = torch.utils.data.DataLoader(make(6).dataset, batch_size=3)
    expected = [b["torch"] for b in plain]
    torch.manual_seed(7)
    got = [b["torch"] for b in make(6, keying="off")]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_only_the_chosen_generators_are_keyed() -> None:
    def run() -> list[dict[str, Any]]:
        return list(make(6, keyed_generators=("torch",)))

    np.random.seed(1)
    first = run()
    np.random.seed(2)
    second = run()
    assert all(torch.equal(a["torch"], b["torch"]) for a, b in zip(first, second, strict=True))
    assert not all(torch.equal(a["numpy"], b["numpy"]) for a, b in zip(first, second, strict=True))


def test_unknown_generator_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keyed_generators: unknown generator\(s\) \['jax'\]"):
        make(6, keyed_generators=("torch", "jax"))


@pytest.mark.parametrize("keying", ["batch", "sample"])
def test_main_process_iteration_does_not_disturb_the_callers_stream(keying: str) -> None:
    """With num_workers=0 the fetch runs in the caller's process: its own draws (dropout) must not
    move."""

    def draws(loader: Any) -> list[tuple[float, float, float]]:
        torch.manual_seed(5)
        np.random.seed(5)
        random.seed(5)
        out = []
        for _ in loader:
            out.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
        return out

    assert draws(make(10, shuffle=True, keying=keying)) == draws(range(4))


def test_caller_rng_restores_numpy_state_exactly() -> None:
    np.random.seed(3)
    np.random.rand(5)
    saved = CallerRng(generator_mask(["numpy"])).save()
    expected = np.random.get_state()
    np.random.seed(42)
    np.random.rand(100)
    saved.restore()
    after = np.random.get_state()
    assert np.array_equal(after[1], expected[1]) and after[2] == expected[2]


class _Draws(torch.utils.data.Dataset[tuple[float, float, float]]):
    """Every item draws from the three keyed generators."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        return torch.rand(()).item(), float(np.random.rand()), random.random()


def _fetch_in_a_worker(
    batches: list[KeyedIndices], between: Any = None
) -> tuple[list[Any], list[int]]:
    """Fetch ``batches`` as a DataLoader worker does: indices unpickled, fetched, collated (our
    wrapper).

    Returns the values drawn and ``torch.initial_seed()`` as each next batch's indices arrive.
    """
    fetcher = _MapDatasetFetcher(_Draws(), True, SeedAheadCollate(lambda items: items), False)
    worker = torch.utils.data._utils.worker
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=2, seed=0, dataset=None)
    try:
        values, seeds_on_arrival = [], []
        for batch in batches:
            arrived = pickle.loads(pickle.dumps(batch))  # waits for the helper thread (`_arrived`)
            seeds_on_arrival.append(torch.initial_seed())
            values.append(fetcher.fetch(arrived))
            if between is not None:
                between()
        return values, seeds_on_arrival
    finally:
        worker._worker_info = None


def test_seeding_ahead_gives_each_batch_its_own_keys_values() -> None:
    """A worker seeds for its next batch in the background; right or wrong, the values are the
    batch's own."""
    mask = generator_mask(GENERATORS)
    keys = [derive_key(11, i) for i in range(4)]
    plain = [KeyedIndices([0, 1, 2], KeySpec(key, None, mask)) for key in keys]
    expected, _ = _fetch_in_a_worker(
        plain, between=lambda: (torch.rand(3), np.random.rand(3), random.random())
    )
    pairs = zip(keys, [*keys[1:], None], strict=True)
    guessed = [
        KeyedIndices([0, 1, 2], KeySpec(key, None, mask), ahead=after) for key, after in pairs
    ]
    values, seeds = _fetch_in_a_worker(guessed)
    assert values == expected
    # seeded (63 bits) before the indices arrived
    assert seeds[1:] == [key & ((1 << 63) - 1) for key in keys[1:]]
    wrong = [
        KeyedIndices([0, 1, 2], KeySpec(key, None, mask), ahead=derive_key(99, i))
        for i, key in enumerate(keys)
    ]
    assert _fetch_in_a_worker(wrong)[0] == expected
    # the keys differ
    assert len({v for batch in expected for item in batch for v in item}) == 4 * 3 * 3


def test_seeding_ahead_survives_a_fork() -> None:
    """A process forked after the helper thread started (a worker's own subprocess) starts its own
    helper."""
    SEED_AHEAD.plan(derive_key(1, 2), generator_mask(["torch"]))
    SEED_AHEAD.start()
    assert SEED_AHEAD.take() == (derive_key(1, 2), generator_mask(["torch"]))
    child = multiprocessing.get_context("fork").Process(target=_seed_ahead_in_child)
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0


def _seed_ahead_in_child() -> None:
    key = derive_key(3, 4)
    SEED_AHEAD.plan(key, generator_mask(["torch"]))
    SEED_AHEAD.start()
    ok = SEED_AHEAD.take() == (key, generator_mask(["torch"])) and torch.initial_seed() == key & (
        (1 << 63) - 1
    )
    os._exit(0 if ok else 1)


def test_a_worker_fetch_left_unchecked_makes_the_worker_seed_every_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch whose fetch ends before our collate check (the dataset raised) leaves its worker
    seeding every keyed generator for every later batch: a generator first drawn then is keyed as in
    a worker that seeds all."""
    mask = generator_mask(GENERATORS)
    keys = [derive_key(21, i) for i in range(3)]
    fetcher = _MapDatasetFetcher(
        list(range(10)), True, SeedAheadCollate(lambda items: items), False
    )
    worker = torch.utils.data._utils.worker

    def arrive_third(eager: bool) -> list[float]:
        worker._worker_info = worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
        try:
            with monkeypatch.context() as patch:
                if eager:
                    patch.setattr(WorkerFetch, "seeds_for", lambda self, mask: mask)
                fetcher.fetch(
                    pickle.loads(pickle.dumps(KeyedIndices([0, 1], KeySpec(keys[0], None, mask))))
                )
                # its fetch raised
                pickle.loads(pickle.dumps(KeyedIndices([2, 3], KeySpec(keys[1], None, mask))))
                pickle.loads(pickle.dumps(KeyedIndices([4, 5], KeySpec(keys[2], None, mask))))
                return [float(np.random.rand()), random.random()]  # the third batch's first draws
        finally:
            worker._worker_info = None

    assert arrive_third(eager=False) == arrive_third(eager=True)
