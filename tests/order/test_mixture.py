"""``Mixture``: exact proportions per block, each source walking its own keyed permutation, weight
changes at a defined position, and a resume — at any cut, with another ``num_workers``, world size
or batch size — that continues the uninterrupted run's global sequence, ids and augmentation
values."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from loader_resume import Mixture, ResumableDataLoader, StateError
from loader_resume.testing import assert_resumes_exactly
from loader_resume.workers.torch_internals import caps_worker_tasks

LENGTHS = {"a": 50, "b": 20, "c": 7}
BASES = {"a": 0, "b": 1000, "c": 5000}
# step -> weights, set after that step's batch
CHANGES = {3: {"a": 1, "b": 1, "c": 1}, 9: {"a": 0, "b": 1, "c": 3}}


class Noisy(Dataset[torch.Tensor]):
    """Item ``i`` is ``[base + i, torch noise, numpy noise, random noise]``: an id and three
    augmentations."""

    def __init__(self, base: int, length: int) -> None:
        self.base, self.length = base, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(
            [self.base + index, float(torch.rand(())), np.random.rand(), random.random()],
            dtype=torch.float64,
        )


def mixture(lengths: dict[str, int] = LENGTHS, block_size: int = 10) -> Mixture:
    return Mixture(
        {name: Noisy(BASES[name], n) for name, n in lengths.items()},
        {"a": 5, "b": 3, "c": 2},
        block_size=block_size,
    )


def run(
    *,
    steps: int = 40,
    workers: int = 0,
    batch: int = 4,
    world: int = 1,
    stop: int | None = None,
    state: dict[str, Any] | None = None,
    start: int = 0,
    keying: str = "batch",
    in_order: bool = True,
    changes: dict[int, dict[str, float]] = CHANGES,
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """``steps`` global steps on ``world`` ranks (one loader and one mixture each, as on separate
    processes), calling ``changes`` on every rank; each step's batches concatenated rank after rank.
    Stops after step ``stop`` and returns each rank's state; resumes from ``state`` (saved after
    step ``start``)."""
    mixtures = [mixture() for _ in range(world)]
    loaders = [
        ResumableDataLoader(
            m,
            batch_size=batch,
            seed=1,
            num_workers=workers,
            rank=r,
            world_size=world,
            keying=keying,
            in_order=in_order,
        )
        for r, m in enumerate(mixtures)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(state)))  # a JSON round trip
    out: list[torch.Tensor] = []
    step = start
    while step < steps:
        for batches in zip(*map(iter, loaders), strict=True):
            for m in mixtures:
                if step in changes:
                    m.set_weights(changes[step])
            out.append(torch.cat(batches))
            step += 1
            if step in (stop, steps):
                return out, [loader.state_dict() for loader in loaders]
    return out, [loader.state_dict() for loader in loaders]


def test_each_block_holds_the_exact_proportions_and_each_source_walks_its_own_permutation() -> None:
    m = mixture(block_size=10)
    m.requested(0, 30)
    m.set_weights({"a": 1, "b": 1, "c": 1})
    # not a block boundary of the segment that starts at 30: its third block is cut short
    m.requested(0, 55)
    m.set_weights({"a": 0, "b": 1, "c": 3})
    keys = m.resolve(0, list(range(77))) + m.resolve(1, list(range(77)))
    # largest remainders of 10 slots: 3.33 each -> the tie to the first source; 2.5 and 7.5 -> the
    # tie to b
    segments = [(0, 30, [5, 3, 2]), (30, 55, [4, 3, 3]), (55, 154, [0, 3, 7])]
    full_blocks = 0
    for start, end, counts in segments:
        for first in range(start, end - 9, 10):
            found = Counter(source for source, _ in keys[first:first + 10])
            assert [found[s] for s in range(3)] == counts, first
            full_blocks += 1
    assert full_blocks == 3 + 2 + 9
    for source, length in enumerate(LENGTHS.values()):
        draws = [item for s, item in keys if s == source]
        # b and c cycle through their own epochs
        assert len(draws) > (20 if source == 0 else 2 * length)
        # no item lost or repeated within a source's epoch
        for first in range(0, len(draws), length):
            chunk = draws[first:first + length]
            assert len(set(chunk)) == len(chunk) and (
                len(chunk) < length or sorted(chunk) == list(range(length))
            )


def test_the_order_is_a_function_of_the_state_alone() -> None:
    """A mixture that loads another's state resolves every position as that one does; the state is
    JSON and grows by one entry per change."""
    m = mixture()
    m.requested(0, 30)
    m.set_weights({"a": 1, "b": 1, "c": 1})
    m.requested(1, 12)
    m.set_weights({"a": 0, "b": 1, "c": 3})
    state = json.loads(json.dumps(m.state_dict()))
    assert len(state["changes"]) == 3 and len(json.dumps(state)) < 400
    other = mixture()
    other.load_state_dict(state)
    assert other.resolve(1, list(range(77))) == m.resolve(1, list(range(77)))
    assert other.resolve(3, [5, 70]) == m.resolve(3, [5, 70])
    whole = m.resolve(2, list(range(77)))
    # any order
    assert m.resolve(2, [70, 5, 6, 7, 76]) == [whole[70], whole[5], whole[6], whole[7], whole[76]]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [1, 4, 8, 12, 19, 25])
def test_a_resume_continues_with_the_uninterrupted_runs_batches(workers: int, stop: int) -> None:
    """Cuts before, between and after the two weight changes and across the epoch end (19.25 steps);
    the rerun makes the same calls. Ids and the three augmentations are compared."""
    full, _ = run(workers=workers)
    first, (state,) = run(workers=workers, stop=stop)
    rest, _ = run(workers=workers, state=state, start=stop)
    assert len(first) + len(rest) == len(full)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, full, strict=True))


@pytest.mark.parametrize("stop", [4, 12])
def test_two_ranks_resume_on_two_ranks_with_the_uninterrupted_runs_batches(stop: int) -> None:
    """Two ranks (num_workers 2) making the same changes on each, cut before and after the second
    change."""
    full, _ = run(workers=2, world=2, steps=20)
    first, states = run(workers=2, world=2, steps=20, stop=stop)
    assert states[0] == states[1]  # the position is global
    rest, _ = run(workers=2, world=2, steps=20, state=states[0], start=stop)
    assert all(torch.equal(a, b) for a, b in zip(first + rest, full, strict=True))


@pytest.mark.skipif(
    not caps_worker_tasks(), reason=f"in_order=False needs torch >= 2.7 (torch {torch.__version__})"
)
def test_out_of_order_delivery_resumes_a_mixture_each_batch_once() -> None:
    """in_order=False (num_workers 2): batches arrive in any order, each the same as in order (keyed
    by its step); cut after 5 deliveries, a resume delivers the rest of the epoch (20 batches)
    exactly once, values included."""
    in_order, _ = run(workers=2, steps=20, changes={})
    first, (state,) = run(workers=2, steps=20, stop=5, in_order=False, changes={})
    rest, _ = run(workers=2, steps=20, state=state, start=5, in_order=False, changes={})
    key = [tuple(batch[:, 0].tolist()) for batch in in_order]
    assert sorted(tuple(batch[:, 0].tolist()) for batch in first + rest) == sorted(key)
    by_ids = {tuple(batch[:, 0].tolist()): batch for batch in in_order}
    assert all(torch.equal(batch, by_ids[tuple(batch[:, 0].tolist())]) for batch in first + rest)


@pytest.mark.parametrize("keying", ["batch", "sample"])
def test_the_global_sequence_continues_on_another_world_size_batch_size_and_worker_count(
    keying: str,
) -> None:
    """Saved after step 6 on one process (batch 4, num_workers 2: the change of step 3 applies after
    the prefetched batches), resumed on two ranks of batch 2 with num_workers 0: each step holds the
    same 4 samples as the uninterrupted run's until the epoch's last, uneven, step — and, keyed per
    sample, the same values (keyed per batch, a value depends on its batch, which another batch size
    changes). A change made after the resume would apply from another position: prefetching differs
    (see the next test)."""
    first_change = {3: CHANGES[3]}
    full, _ = run(workers=2, steps=19, keying=keying, changes=first_change)
    _, (state,) = run(workers=2, stop=6, keying=keying, changes=first_change)
    # requested: 4 delivered + 2 workers x prefetch 2, x 4
    assert state["dataset_state"]["changes"][1][0] == 32
    rest, _ = run(
        world=2, batch=2, state=state, start=6, steps=19, keying=keying, changes=first_change
    )
    columns = slice(None) if keying == "sample" else slice(0, 1)
    for got, want in zip(rest, full[6:], strict=True):
        assert torch.equal(
            got[torch.argsort(got[:, 0])][:, columns], want[torch.argsort(want[:, 0])][:, columns]
        )


@pytest.mark.parametrize("reused", [False, True])
def test_a_change_made_after_a_load_before_the_first_batch_applies_from_the_loaded_position(
    reused: bool,
) -> None:
    """The change due after step 3 made on a loader just resumed from a state taken after step 3's
    batch, before that change (as a schedule applied at the top of the loop, or in a restore hook):
    nothing past the loaded position has been requested, so it applies there, as in the
    uninterrupted run (num_workers=0). A reused mixture, which had run further, makes no
    difference."""
    full, _ = run()
    _, (state,) = run(stop=4, changes={})
    m = mixture()
    if reused:
        next(iter(ResumableDataLoader(m, batch_size=4, seed=1)))
        m.requested(1, 40)
    loader = ResumableDataLoader(m, batch_size=4, seed=1)
    loader.load_state_dict(state)
    m.set_weights(CHANGES[3])
    rest, step = [], 4
    while len(rest) < len(full) - 4:
        for batch in loader:
            rest.append(batch)
            if step in CHANGES:
                m.set_weights(CHANGES[step])
            step += 1
    assert all(torch.equal(a, b) for a, b in zip(rest, full[4:], strict=False))


def test_a_second_loader_built_over_a_used_mixture_leaves_its_request_position() -> None:
    """Building a loader (a framework rebuilding one, a validation loader) requests nothing: a
    change made after applies where the running loader's requests have gone, never over samples
    already delivered."""
    m = mixture()
    it = iter(ResumableDataLoader(m, batch_size=4, seed=1))
    next(it), next(it)
    ResumableDataLoader(m, batch_size=4, seed=1)
    m.set_weights({"a": 0, "b": 0, "c": 1})
    assert m.state_dict()["changes"][1][0] == 8


def test_a_weight_change_applies_from_the_first_position_not_requested() -> None:
    m = mixture()
    loader = ResumableDataLoader(m, batch_size=4, seed=1)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    m.set_weights({"a": 0, "b": 0, "c": 1})
    assert [int(row[0]) // 1000 for row in next(iterator)] == [5, 5, 5, 5]
    assert m.state_dict()["changes"][1] == [8, [0.0, 0.0, 1.0]]
    m.set_weights({"a": 0, "b": 0, "c": 1})  # the weights in force: nothing changes
    assert len(m.state_dict()["changes"]) == 2


def test_a_later_call_replaces_a_change_not_yet_requested() -> None:
    m = mixture()
    m.set_weights({"a": 1, "b": 0, "c": 0})
    m.set_weights({"a": 0, "b": 1, "c": 0})
    assert m.state_dict()["changes"] == [[0, [0.0, 1.0, 0.0]]]
    assert {source for source, _ in m.resolve(0, list(range(20)))} == {1}


def test_a_source_whose_length_changed_is_refused_naming_it() -> None:
    state = mixture().state_dict()
    grown = mixture(lengths={"a": 50, "b": 21, "c": 7})
    with pytest.raises(
        StateError,
        match=r"'dataset_state.sources.b': saved 20, expected 21. Source 'b' has 21 "
        r"items; the state was saved with 20",
    ):
        grown.load_state_dict(state)
    loader = ResumableDataLoader(mixture(lengths={"a": 50, "b": 21, "c": 7}), batch_size=4, seed=1)
    saved = ResumableDataLoader(mixture(), batch_size=4, seed=1).state_dict()
    # the mixture's epoch is the sources' total
    assert saved["dataset_len"] == 77 and len(loader.dataset) == 78
    # named before the loader's own dataset_len
    with pytest.raises(StateError, match="Source 'b' has 21 items"):
        loader.load_state_dict(saved)
    with pytest.raises(StateError, match=r"'dataset_state.block_size': saved 10, expected 20"):
        mixture(block_size=20).load_state_dict(state)


def test_bad_use_is_refused_with_what_was_expected() -> None:
    with pytest.raises(ValueError, match="expected shuffle=False and no sampler"):
        ResumableDataLoader(mixture(), batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['d'\], missing \['c'\]"):
        mixture().set_weights({"a": 1, "b": 1, "d": 1})
    with pytest.raises(ValueError, match="expected finite numbers >= 0, not all 0"):
        mixture().set_weights({"a": 0, "b": 0, "c": 0})
    with pytest.raises(
        TypeError, match=r"Mixture source 'x'.*expected a map-style dataset with __len__"
    ):
        Mixture({"x": iter([])}, {"x": 1})


def change_weights(loader: ResumableDataLoader, delivered: int) -> None:
    if delivered in (4, 10, 30):
        loader.dataset.set_weights(CHANGES[3] if delivered != 10 else CHANGES[9])


@pytest.mark.parametrize("workers", [0, 2])
def test_assert_resumes_exactly_covers_a_mixture_with_weight_changes(workers: int) -> None:
    """Every cut of two epochs (40 batches), the weights changed after batches 4, 10 and 30; each
    state through JSON. Without the calls in the resumed runs the check fails: the helper runs them
    too."""
    report = assert_resumes_exactly(
        lambda: ResumableDataLoader(mixture(), batch_size=4, seed=1, num_workers=workers),
        epochs=2,
        round_trip="json",
        after_batch=change_weights,
    )
    assert report.batches == 40 and len(report.cuts) == 41
    built: list[ResumableDataLoader] = []

    def build() -> ResumableDataLoader:
        built.append(ResumableDataLoader(mixture(), batch_size=4, seed=1))
        return built[-1]

    def in_the_reference_only(loader: ResumableDataLoader, delivered: int) -> None:
        if loader is built[0]:
            change_weights(loader, delivered)

    with pytest.raises(AssertionError, match=r"cut 2: batch 4 \(epoch 0\) differs after resume"):
        assert_resumes_exactly(build, epochs=1, cuts=[2], after_batch=in_the_reference_only)


class Leveled(Noisy):
    """A source with a state of its own (a curriculum level set during training)."""

    def __init__(self, base: int, length: int) -> None:
        super().__init__(base, length)
        self.level = 0

    def state_dict(self) -> dict[str, int]:
        return {"level": self.level}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.level = state["level"]


def test_a_sources_own_state_is_saved_and_a_mismatch_refused_naming_it() -> None:
    """Each source's own state goes into the mixture's (as a loader saves a dataset's); a reused
    mixture loads another's state with that one's weights, whatever it resolved before."""
    saving = Mixture({"a": Leveled(0, 50), "b": Noisy(1000, 20)}, {"a": 1, "b": 1}, block_size=10)
    saving.sources["a"].level = 3
    saving.requested(0, 30)
    saving.set_weights({"a": 1, "b": 3})
    state = json.loads(json.dumps(saving.state_dict()))
    reused = Mixture({"a": Leveled(0, 50), "b": Noisy(1000, 20)}, {"a": 3, "b": 1}, block_size=10)
    reused.resolve(0, list(range(77)))  # its own weights' blocks resolved and kept
    reused.load_state_dict(state)
    assert reused.sources["a"].level == 3
    assert reused.resolve(0, list(range(77))) == saving.resolve(0, list(range(77)))
    plain = Mixture({"a": Noisy(0, 50), "b": Noisy(1000, 20)}, {"a": 1, "b": 1}, block_size=10)
    with pytest.raises(
        StateError, match=r"'dataset_state.source_states.a': saved \{'level': 3\}, expected none"
    ):
        plain.load_state_dict(state)


def test_a_resume_costs_the_same_at_any_position_and_the_state_keeps_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sources of 10^9 and 10^6 items: a resume at 10 %, 50 % or 90 % of a 10^9-sample epoch
    evaluates the same number of permutation values for its first batch (one block, one chunk per
    source), and the state is the same size wherever it was taken."""
    from loader_resume.order import permutation

    evaluated: list[int] = []
    original = permutation.KeyedPermutation.__getitem__

    def counting(self: Any, positions: Any) -> Any:
        evaluated.append(int(np.size(positions)))
        return original(self, positions)

    monkeypatch.setattr(permutation.KeyedPermutation, "__getitem__", counting)

    def resumed_at(fraction: float) -> tuple[int, int]:
        saving = ResumableDataLoader(
            Mixture({"a": range(10**9), "b": range(10**6)}, {"a": 3, "b": 1}), batch_size=64, seed=1
        )
        state = saving.state_dict()
        state["position"] = int(fraction * len(saving.dataset)) // 64 * 64
        loader = ResumableDataLoader(
            Mixture({"a": range(10**9), "b": range(10**6)}, {"a": 3, "b": 1}), batch_size=64, seed=1
        )
        loader.load_state_dict(json.loads(json.dumps(state)))
        evaluated.clear()
        first = next(iter(loader))
        assert len(first) == 64
        return sum(evaluated), len(json.dumps(loader.state_dict()))

    costs = {fraction: resumed_at(fraction) for fraction in (0.1, 0.5, 0.9)}
    assert len(set(costs.values())) == 1, costs
    values, _ = costs[0.9]
    # one block, and one chunk of each source's permutation
    assert values <= 1024 + 2 * 4096, values
