"""Only the generators a dataset draws from are seeded (in the main process and in workers), and its
values are still the keyed ones.

The reference for "the keyed values" is a 2-worker loader whose workers seed every keyed generator
before every batch (``WorkerFetch.seeds_for`` made to answer "all of them"): equal values mean lazy
keying changed nothing a batch sees.
"""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from loader_resume import ResumableDataLoader
from loader_resume.keyed.rng_memory import GeneratorStates, generator_states
from loader_resume.keyed.worker_fetch import WorkerFetch
from loader_resume.testing import assert_resumes_exactly, run_epochs
from support.data import caller_draws, seed_all


class Draws(Dataset[dict[str, Any]]):
    """Draws from the generators ``which(index, epoch)`` names; counts its reads."""

    def __init__(self, n: int, which: Any, shared_reads: Any = None) -> None:
        self.n, self.which, self.reads, self.epoch = n, which, 0, 0
        self.shared_reads = shared_reads  # a multiprocessing.Value: reads in forked workers

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.reads += 1
        if self.shared_reads is not None:
            with self.shared_reads.get_lock():
                self.shared_reads.value += 1
        names = self.which(index, self.epoch)
        return {
            "id": index,
            "torch": torch.rand(()).item() if "torch" in names else -1.0,
            "numpy": float(np.random.normal()) if "numpy" in names else -1.0,
            "random": random.gauss(0, 1) if "random" in names else -1.0,
            "refill": sum(random.getrandbits(32) for _ in range(624)) if "refill" in names else -1,
        }


def _nothing(index: int, epoch: int) -> set[str]:
    return set()


def _everything(index: int, epoch: int) -> set[str]:
    return {"torch", "numpy", "random"}


def _later(index: int, epoch: int) -> set[str]:
    """Nothing in epoch 0; torch in epoch 1; torch and random from epoch 2."""
    return {"torch", "random"} if epoch >= 2 else {"torch"} if epoch == 1 else set()


def _one_numpy_item(index: int, epoch: int) -> set[str]:
    """One item of the whole dataset draws one normal from numpy (the cached spare is the only move
    after)."""
    return {"numpy"} if index == 7 else set()


def _one_whole_refill(index: int, epoch: int) -> set[str]:
    """From epoch 1, item 5 draws exactly 624 words from ``random`` (its position counter ends where
    it began)."""
    return {"refill"} if index == 5 and epoch >= 1 else set()


PATTERNS = [_nothing, _everything, _later, _one_numpy_item, _one_whole_refill]


def _loader(which: Any, workers: int, seed: int = 3, **options: Any) -> ResumableDataLoader[Any]:
    return ResumableDataLoader(
        Draws(30, which, options.pop("shared_reads", None)),
        batch_size=4,
        shuffle=True,
        seed=seed,
        num_workers=workers,
        **options,
    )


@contextmanager
def _eager_workers() -> Iterator[None]:
    """Workers (forked: they inherit the patch) seed every keyed generator before every batch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WorkerFetch, "seeds_for", lambda self, mask: mask)
        yield


def _eager(which: Any, epochs: int = 3) -> list[Any]:
    with _eager_workers():
        return run_epochs(_loader(which, 2, multiprocessing_context="fork"), epochs)


@pytest.mark.parametrize("which", PATTERNS, ids=lambda f: f.__name__)
def test_values_equal_those_of_workers_that_seed_every_batch(which: Any) -> None:
    lazy = run_epochs(_loader(which, 0), 3)
    assert lazy == _eager(which)
    if which is not _nothing:
        assert lazy != run_epochs(_loader(which, 0, seed=4), 3)  # keyed: another seed, other values


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
@pytest.mark.parametrize("which", PATTERNS, ids=lambda f: f.__name__)
def test_lazy_workers_give_the_values_of_workers_that_seed_every_batch(
    which: Any, persistent: bool
) -> None:
    assert run_epochs(_loader(which, 2, persistent_workers=persistent), 3) == _eager(which)


def test_a_worker_reads_a_batch_again_only_when_it_first_sees_a_generator_drawn() -> None:
    """_one_numpy_item: item 7 draws numpy. Workers start fresh each epoch (the dataset has
    set_epoch); a worker's first batch seeds every generator, so the batch holding item 7 is read
    twice only when it is not its worker's first batch (torch hands batches to the 2 workers in
    turn: batches 0 and 1 are firsts)."""
    reads = multiprocessing.get_context("fork").Value("i", 0)
    loader = _loader(_one_numpy_item, 2, shared_reads=reads, multiprocessing_context="fork")
    run_epochs(loader, 3)
    again = sum(
        len(batch)
        for epoch in range(3)
        for b, batch in enumerate(loader.planned_indices(epoch=epoch))
        if 7 in batch and b >= 2
    )
    assert reads.value == 3 * 30 + again


@pytest.mark.parametrize("which", PATTERNS, ids=lambda f: f.__name__)
def test_the_callers_generators_and_cached_normals_are_left_alone(which: Any) -> None:
    """The caller draws between batches (as a model's dropout does), cached normals included."""

    def caller_step() -> tuple[float, ...]:
        return (
            *caller_draws(),
            torch.randn(1).item(),
            float(np.random.normal()),
            random.gauss(0, 1),
        )

    seed_all(11)
    expected = [caller_step() for _ in range(3 * 8)]
    seed_all(11)
    seen = []
    loader = _loader(which, 0)
    for _ in range(3):
        for _ in loader:
            seen.append(caller_step())
    assert seen == expected


@pytest.mark.parametrize(
    "which", [_later, _one_numpy_item, _one_whole_refill], ids=lambda f: f.__name__
)
def test_a_dataset_that_starts_drawing_later_resumes_exactly(which: Any) -> None:
    assert_resumes_exactly(lambda: _loader(which, 0), epochs=3)
    assert_resumes_exactly(
        lambda: _loader(which, 0),
        make_resumed=lambda: _loader(which, 2),
        epochs=3,
        cuts=[0, 3, 8, 9, 17],
    )
    assert_resumes_exactly(
        lambda: _loader(which, 2, persistent_workers=True), epochs=3, cuts=[0, 5, 9, 13, 20]
    )


def test_a_batch_is_read_again_only_when_a_generator_is_first_seen_drawn() -> None:
    """_later draws nothing in epoch 0 (learned at the first batch: no generator), torch from epoch
    1 and random from epoch 2. torch's generator is seeded for every batch regardless
    (torch.initial_seed() must report the batch's key), so only the first batch of epoch 2 is read
    twice."""
    loader = _loader(_later, 0)
    run_epochs(loader, 3)
    assert loader.dataset.reads == 3 * 30 + 4
    everything = _loader(_everything, 0)
    run_epochs(everything, 3)
    # learned at the first batch, which seeds every generator
    assert everything.dataset.reads == 3 * 30


class _ReadsSeed(Dataset[int]):
    """Draws nothing; reports ``torch.initial_seed()`` while an item is read."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return torch.initial_seed()


def test_torch_reports_the_batch_key_while_reading_and_the_callers_seed_and_state_after() -> None:
    """A dataset that only reads torch.initial_seed(): the batch's key inside the fetch (as in a
    worker); the caller's seed and state are what they were, before each batch and after the
    last."""
    torch.manual_seed(5)
    torch.rand(3)
    seed, state = torch.initial_seed(), torch.get_rng_state()
    in_process, in_workers = (
        [
            key
            for batch in ResumableDataLoader(
                _ReadsSeed(), batch_size=3, shuffle=True, seed=7, num_workers=workers
            )
            for key in batch.tolist()
        ]
        for workers in (0, 2)
    )
    assert in_process == in_workers and len(set(in_process)) == 4  # one key a batch of 3
    assert torch.initial_seed() == seed and torch.equal(torch.get_rng_state(), state)
    for _ in ResumableDataLoader(_ReadsSeed(), batch_size=3, shuffle=True, seed=7):
        assert torch.initial_seed() == seed and torch.equal(torch.get_rng_state(), state)


class _ForkedDraws(Dataset[float]):
    """Draws from torch inside torch.random.fork_rng(), which puts torch's state back as it found
    it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> float:
        with torch.random.fork_rng():
            return torch.rand(()).item()


@pytest.mark.parametrize("workers", [0, 2])
def test_draws_inside_fork_rng_are_keyed(workers: int) -> None:
    """fork_rng leaves torch's generator as it found it, so such a dataset looks as if it drew
    nothing: its values are keyed all the same (torch's generator is seeded for every batch), equal
    at 0 and 2 workers, another seed gives others, and a resume reproduces them."""
    def make(seed: int = 7, nw: int = workers) -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            _ForkedDraws(), batch_size=3, shuffle=True, seed=seed, num_workers=nw
        )

    values = run_epochs(make(), 2)
    assert values == run_epochs(make(nw=2 - workers), 2)
    assert values != run_epochs(make(seed=8), 2)
    assert_resumes_exactly(make, epochs=2, cuts=[1, 2, 5])


def test_generator_states_round_trip_with_cached_normals() -> None:
    states = generator_states()
    torch.randn(1), np.random.normal(), random.gauss(0, 1)  # a cached normal in each
    taken = states.take()
    expected = (
        torch.randn(3).tolist(),
        np.random.normal(size=3).tolist(),
        [random.gauss(0, 1) for _ in range(3)],
    )
    assert states.changed(taken, 7) == 7
    states.put(taken, 7)
    assert states.changed(taken, 7) == 0
    assert (
        torch.randn(3).tolist(),
        np.random.normal(size=3).tolist(),
        [random.gauss(0, 1) for _ in range(3)],
    ) == expected


@pytest.mark.parametrize(
    "bit,draw",
    [(1, lambda: torch.randn(1)), (2, np.random.normal), (4, lambda: random.gauss(0, 1))],
    ids=["torch", "numpy", "random"],
)
def test_using_a_cached_normal_is_a_change(bit: int, draw: Any) -> None:
    """The draw after a normal draw takes the cached spare and leaves MT19937 as it was: still seen
    as a move, by the whole states and by the marks a fetch compares first."""
    seed_all(2)
    draw()
    states = generator_states()
    taken, marks = states.take(), states.marks(7)
    draw()
    assert states.changed(taken, 7) == bit
    assert states.marks(7) != marks


@pytest.mark.parametrize("bit,words", [(2, lambda: np.random.bytes(4 * 624)),
                                       (4, lambda: [random.getrandbits(32) for _ in range(624)])],
                         ids=["numpy", "random"])
def test_a_whole_refill_of_the_state_is_a_change(bit: int, words: Any) -> None:
    """Exactly 624 words drawn: the position counter ends where it began; the state words beside it
    do not."""
    seed_all(4)
    np.random.bytes(40), random.getrandbits(32)  # mid-state, not at a refill
    states = generator_states()
    taken, marks = states.take(), states.marks(bit)
    words()
    assert states.changed(taken, 7) == bit
    assert states.marks(bit) != marks


def test_the_public_api_fallback_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the memory layout is not the probed one (another torch, numpy or Python), the public
    APIs serve."""
    import loader_resume.keyed.rng_memory as rng_memory

    def reported_seeds() -> list[int]:
        return [
            key
            for batch in ResumableDataLoader(_ReadsSeed(), batch_size=3, seed=7)
            for key in batch.tolist()
        ]

    expected, seeds = run_epochs(_loader(_later, 0), 3), reported_seeds()
    for probe in ("_torch_block", "_numpy_block", "_random_block"):
        monkeypatch.setattr(rng_memory, probe, lambda: None)
    monkeypatch.setattr(rng_memory, "_STATES", GeneratorStates())
    assert run_epochs(_loader(_later, 0), 3) == expected
    assert reported_seeds() == seeds  # torch seeded where its seed alone cannot be written
    seed_all(5)
    before = caller_draws()
    seed_all(5)
    run_epochs(_loader(_one_numpy_item, 0), 2)
    assert caller_draws() == before


def test_a_replaced_numpy_bit_generator_is_followed() -> None:
    """np.random.set_bit_generator swaps the legacy global state's generator: states follow the new
    one."""
    original = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.PCG64(1))
        taken = generator_states().take()
        first = np.random.rand(3).tolist()
        generator_states().put(taken, 2)
        assert np.random.rand(3).tolist() == first
    finally:
        np.random.set_bit_generator(original)
    seed_all(5)
    before = caller_draws()
    seed_all(5)
    run_epochs(_loader(_one_numpy_item, 0), 2)
    assert caller_draws() == before


class Picky(Dataset[dict[str, Any]]):
    """From epoch 1 draws from numpy, then raises unless numpy's generator had just been seeded (as
    it is for every batch when every generator is seeded): a dataset that fails on what an unkeyed
    generator gave it."""

    def __init__(self, n: int = 30) -> None:
        self.n, self.epoch = n, 0

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        if self.epoch >= 1:
            fresh = np.random.get_state()[2] == 624
            items = [{"id": i, "numpy": float(np.random.rand())} for i in indices]
            if not fresh:
                raise ValueError("numpy's generator was not seeded for this batch")
            return items
        return [{"id": i, "numpy": -1.0} for i in indices]


def test_an_exception_from_an_unkeyed_draw_is_a_read_again_keyed() -> None:
    """Main process: the batch that raised after drawing from a generator not seeded is read again
    with it seeded, as a loader seeding every generator reads it; the caller's generators are left
    alone."""
    with _eager_workers():
        eager = run_epochs(
            ResumableDataLoader(
                Picky(),
                batch_size=4,
                shuffle=True,
                seed=3,
                num_workers=2,
                multiprocessing_context="fork",
            ),
            3,
        )
    seed_all(5)
    np.random.rand()  # the caller's numpy generator is not freshly seeded
    caller = generator_states().take()
    assert run_epochs(ResumableDataLoader(Picky(), batch_size=4, shuffle=True, seed=3), 3) == eager
    assert generator_states().changed(caller, 0b111) == 0


class Keeps(Dataset[dict[str, Any]]):
    """After its first batch (4 reads of this copy) each item draws one numpy number the first time
    it is read, and keeps it."""

    def __init__(self, n: int = 30) -> None:
        self.n, self.reads, self.kept = n, 0, {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.reads += 1
        if self.reads > 4 and index not in self.kept:
            self.kept[index] = float(np.random.rand())
        return {"id": index, "numpy": self.kept.get(index, -1.0)}


def test_a_dataset_that_keeps_an_unkeyed_draw_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="loader_resume"):
        run_epochs(ResumableDataLoader(Keeps(), batch_size=4, shuffle=True, seed=3), 2)
    assert any(
        'keying="sample"' in r.getMessage() and "resume may NOT" in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="loader_resume"):
        run_epochs(ResumableDataLoader(Draws(30, _later), batch_size=4, shuffle=True, seed=3), 3)
    assert not caplog.records  # a dataset that draws again when read again: no warning


def test_a_worker_names_a_dataset_that_keeps_an_unkeyed_draw(tmp_path: Any) -> None:
    """The warning comes from the worker process (forked: it inherits this handler)."""
    import logging

    handler = logging.FileHandler(tmp_path / "log")
    logger = logging.getLogger("loader_resume.keyed.worker_fetch")
    logger.addHandler(handler)
    try:
        run_epochs(ResumableDataLoader(Keeps(), batch_size=4, shuffle=True, seed=3, num_workers=2,
                                       persistent_workers=True, multiprocessing_context="fork"), 2)
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert "resume may NOT" in (tmp_path / "log").read_text()
