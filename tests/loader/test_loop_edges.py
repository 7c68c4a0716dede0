"""The edges of real loops in the core: a pass left before its end on purpose (a loop's own epoch
limit, said with ``pass_ended=True``), a state taken between passes, and states from a hand-written
loop's loader whose last batch is out but whose pass has not ended. Each cut is compared with the
uninterrupted run's batches: ids and the values drawn from torch, numpy and random."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from loader_resume import ResumableDataLoader
from loader_resume.job.step_boundary import ReportingDataLoader, StepBoundaries
from loader_resume.testing import fingerprint
from support.data import Augmented, seed_all

N, BATCH, TAKEN, EPOCHS = 48, 4, 6, 3  # 12 batches an epoch; the loop leaves each pass after 6


def build(
    workers: int, cls: type[ResumableDataLoader[Any]] = ResumableDataLoader
) -> ResumableDataLoader[Any]:
    return cls(Augmented(N), batch_size=BATCH, shuffle=True, num_workers=workers, seed=11)


def record(batch: dict[str, Any]) -> tuple[list[int], str]:
    return batch["id"].tolist(), fingerprint([batch["torch"], batch["numpy"], batch["random"]])


class Cut(Exception):
    """The job is killed here: the state taken at this moment is what a checkpoint holds."""

    def __init__(self, state: dict[str, Any], epoch: int, taken: int) -> None:
        self.state, self.epoch, self.taken = state, epoch, taken


def partial_passes(loader: ResumableDataLoader[Any], *, start_epoch: int = 0, taken: int = 0,
                   cut_at: int | None = None) -> Iterator[tuple[list[int], str]]:
    """A loop with an epoch limit of its own: each epoch takes TAKEN batches, then leaves the pass
    (``break``). Moments are numbered 0, 1, ...: after each batch, and between two passes (after the
    ``break``, before the next ``iter()``); ``cut_at`` raises :class:`Cut` with the state at that
    moment."""
    moment = 0
    for epoch in range(start_epoch, EPOCHS):
        for batch in loader:
            taken += 1
            yield record(batch)
            # NOTE: at the pass's last batch the loop knows it leaves (as Lightning does at
            if moment == cut_at:
                if taken == TAKEN:  # a limit on an epoch's batches): the state it saves says so
                    raise Cut(loader.state_dict(pass_ended=True), epoch + 1, 0)
                raise Cut(loader.state_dict(), epoch, taken)
            moment += 1
            if taken == TAKEN:
                break
        taken = 0
        # NOTE: the loop left the pass on purpose, before the next iter(): it says so
        if moment == cut_at:
            raise Cut(loader.state_dict(pass_ended=True), epoch + 1, 0)
        moment += 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_at_any_moment_of_a_loop_that_leaves_its_passes_early_resumes_exactly(
    workers: int,
) -> None:
    seed_all(0)
    full = list(partial_passes(build(workers)))
    assert len(full) == EPOCHS * TAKEN
    moments = EPOCHS * (TAKEN + 1) - 1
    for cut_at in range(moments):
        seed_all(0)
        before: list[tuple[list[int], str]] = []
        try:
            for row in partial_passes(build(workers), cut_at=cut_at):
                before.append(row)
        except Cut as cut:
            resumed = build(workers)
            resumed.load_state_dict(cut.state)
            after = list(partial_passes(resumed, start_epoch=cut.epoch, taken=cut.taken))
        else:
            pytest.fail(f"moment {cut_at} never came")
        assert before + after == full, f"cut at moment {cut_at}"


def test_the_issue_numbers_a_break_continues_the_pass_and_pass_ended_starts_the_next_epoch() -> (
    None
):
    """48 items, batch 4, `break` after 6 batches: the state continues epoch 0 at batch 7 (a stopped
    job); said ended, it starts epoch 1 where the loop's next iter() does."""
    loader = build(0)
    for i, _ in enumerate(loader):
        if i == TAKEN - 1:
            break
    state, ended = loader.state_dict(), loader.state_dict(pass_ended=True)
    assert (state["epoch"], state["position"]) == (0, TAKEN * BATCH) and (
        ended["epoch"],
        ended["position"],
    ) == (1, 0)
    reference = build(0)
    epoch0 = [b["id"].tolist() for b in reference]
    resumed = build(0)
    resumed.load_state_dict(state)
    assert [b["id"].tolist() for b in resumed] == epoch0[TAKEN:]
    want = next(iter(loader))["id"].tolist()
    resumed = build(0)
    resumed.load_state_dict(ended)
    assert next(iter(resumed))["id"].tolist() == want


def test_pass_ended_gives_the_next_pass_and_a_dropped_iterator_changes_nothing() -> None:
    loader = build(2)
    iterator = iter(loader)
    for _ in range(TAKEN):
        next(iterator)
    mid, ended = loader.state_dict(), loader.state_dict(pass_ended=True)
    assert (mid["epoch"], mid["position"]) == (0, TAKEN * BATCH)
    del iterator
    assert loader.state_dict() == mid and (ended["epoch"], ended["position"]) == (1, 0)
    assert loader.state_dict(pass_ended=True) == ended


def test_a_held_iterator_is_still_mid_epoch_and_a_second_iter_starts_the_next_epoch() -> None:
    """Only a new iter() ends a pass in flight: a kept iterator may still go on."""
    loader = build(0)
    first = iter(loader)
    next(first)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (0, BATCH)
    second = iter(loader)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (1, 0)
    del first, second


# --- a hand-written loop's loaders (Accelerate, Fabric): the last batch is out, the pass has not
# ended --------
def hand_written(
    loader: ReportingDataLoader,
    other: ReportingDataLoader,
    *,
    start_epoch: int = 0,
    cut_at: int | None = None,
    rest: int | None = None,
) -> Iterator[tuple[str, list[int], str]]:
    """``zip(loader, other)`` each epoch, ``other`` the shorter; a checkpoint (``cut_at``) is taken
    in the loop's body after a pair, as a user's own save would be. ``rest``: resumed, the first
    epoch is the saved one."""
    moment = 0
    for epoch in range(start_epoch, 2):
        for a, b in zip(loader, other, strict=False):
            yield ("a", *record(a))
            yield ("b", *record(b))
            if moment == cut_at:
                raise Cut({"a": loader.resume_state(), "b": other.resume_state()}, epoch, 0)
            moment += 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_zip_of_unequal_loaders_resumes_exactly_from_its_last_pair(workers: int) -> None:
    """At the last pair the shorter loader's last batch is out and its pass not yet ended: after a
    load its rest is empty, so the resumed zip ends where the uninterrupted one does (the longer
    loader hands one batch more to it, as there) and the next epoch starts both loaders afresh."""

    def pair() -> tuple[ReportingDataLoader, ReportingDataLoader]:
        a = ReportingDataLoader(
            Augmented(N), batch_size=BATCH, shuffle=True, num_workers=workers, seed=1
        )
        b = ReportingDataLoader(
            Augmented(N // 2), batch_size=BATCH, shuffle=True, num_workers=workers, seed=2
        )
        return a, b

    seed_all(0)
    full = list(hand_written(*pair()))
    pairs = N // 2 // BATCH
    for cut_at in (pairs - 2, pairs - 1, pairs, 2 * pairs - 1):
        seed_all(0)
        before = []
        a, b = pair()
        try:
            before.extend(hand_written(a, b, cut_at=cut_at))
        except Cut as cut:
            resumed, saved = pair(), cut.state
            resumed[0].load_state_dict(saved["a"])
            resumed[1].load_state_dict(saved["b"])
            after = list(hand_written(*resumed, start_epoch=cut.epoch))
        assert before + after == full, f"cut after pair {cut_at}"
        assert ("ending" in saved["b"]) == (cut_at % pairs == pairs - 1) and "ending" not in saved[
            "a"
        ]


def test_a_loaded_ending_is_kept_until_its_empty_pass_and_that_pass_is_over() -> None:
    """A state with "ending", saved again before or after its empty pass, keeps meaning the same (a
    job resumed and checkpointed again in the same epoch)."""
    a = ReportingDataLoader(Augmented(8), batch_size=4, seed=1)
    iterator = iter(a)
    next(iterator)
    next(iterator)  # the last batch is out, the pass not yet ended
    saved = a.resume_state()
    assert saved["ending"] is True
    resumed = ReportingDataLoader(Augmented(8), batch_size=4, seed=1)
    resumed.load_state_dict(saved)
    # saved again before the empty pass
    assert resumed.state_dict() == saved and not resumed.pass_finished
    assert list(resumed) == [] and resumed.pass_finished  # the rest of that pass: nothing, and over
    again = ReportingDataLoader(Augmented(8), batch_size=4, seed=1)
    again.load_state_dict(resumed.state_dict())
    # both: the next epoch
    assert [b["id"].tolist() for b in again] == [b["id"].tolist() for b in resumed]


def test_two_plain_loaders_of_one_seed_iterated_together_are_warned_of_and_own_seeds_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Plain loaders take seed= (default 0): two of one seed draw the same values at the same
    positions. Iterated together (a zip), that is said; with their own seeds it is not, nor for one
    loader's successive passes."""
    caplog.set_level(logging.WARNING, logger="loader_resume")
    a, b = (
        ResumableDataLoader(Augmented(8), batch_size=2),
        ResumableDataLoader(Augmented(12), batch_size=2),
    )
    pairs = list(zip(a, b, strict=False))
    # what the warning is about
    assert all(x["torch"].tolist() == y["torch"].tolist() for x, y in pairs)
    assert "another loader with the same seed (0) is mid-pass" in caplog.text
    caplog.clear()
    a, b = (
        ResumableDataLoader(Augmented(8), batch_size=2, seed=1),
        ResumableDataLoader(Augmented(12), batch_size=2),
    )
    assert all(x["torch"].tolist() != y["torch"].tolist() for x, y in zip(a, b, strict=False))
    for _ in range(2):
        list(a)
    assert "same seed" not in caplog.text


# --- a hand-written loop under a front door (Accelerate, Fabric): StepBoundaries knows which passes
# the loop left --
class Reports:
    """What the Accelerate and Fabric front doors feed their StepBoundaries with (their
    BatchRequests)."""

    def __init__(self) -> None:
        self.boundaries = StepBoundaries()

    def before_batch(self, loader: ReportingDataLoader) -> None:
        self.boundaries.crossed(loader)

    def delivered(self, loader: ReportingDataLoader) -> None:
        self.boundaries.delivered(loader)

    def ran_out(self, loader: ReportingDataLoader) -> None:
        self.boundaries.ran_out(loader)


def front_door_loop(loaders: dict[str, ReportingDataLoader], order: str, *, start_epoch: int = 0,
                    save: str | None = None) -> Iterator[tuple[str, list[int], str]]:
    """``zip`` of the loaders in ``order`` ("ls": long, then short), an optimizer step per pair.
    ``save``: the loop saves, as the front doors take states (raising :class:`Cut`), after its first
    epoch (``"epoch"``) or after a stop flag's ``break`` at its third pair (``"break"``)."""
    reports = Reports()
    weight = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    reports.boundaries.hook(optimizer)
    for loader in loaders.values():
        loader.attach(reports, None)
    pairs = 0
    for epoch in range(start_epoch, 2):
        for batches in zip(*(loaders[name] for name in order), strict=False):
            for name, batch in zip(order, batches, strict=True):
                yield (name, *record(batch))
            (weight * 0).backward()
            optimizer.step()
            pairs += 1
            if save == "break" and pairs == 3:
                break
        if save is not None:
            states = {name: loader.resume_state(pass_ended=reports.boundaries.left(loader))
                      for name, loader in loaders.items()}
            raise Cut(states, epoch if save == "break" else epoch + 1, 0)


@pytest.mark.parametrize("order", ["ls", "sl"])
@pytest.mark.parametrize("save", ["epoch", "break"])
def test_a_front_doors_save_after_a_zip_ends_starts_the_next_epoch_and_after_a_break_continues(
    order: str, save: str
) -> None:
    """A zip over loaders of unequal length ends when the shorter runs out: the longer's pass is
    left with the epoch, whichever comes first in the zip. A stop flag's ``break`` runs nothing out:
    both passes continue."""

    def loaders() -> dict[str, ReportingDataLoader]:
        return {"l": ReportingDataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=1),
                "s": ReportingDataLoader(Augmented(N // 2), batch_size=BATCH, shuffle=True, seed=2)}

    full = list(front_door_loop(loaders(), order))
    before: list[tuple[str, list[int], str]] = []
    with pytest.raises(Cut) as cut:
        before.extend(front_door_loop(loaders(), order, save=save))
    resumed = loaders()
    for name, loader in resumed.items():
        loader.load_state_dict(cut.value.state[name])
    after = list(front_door_loop(resumed, order, start_epoch=cut.value.epoch))
    assert before + after == full
    assert any(row[0] == "l" for row in after[:2]) and len(before) in (2 * 3, 2 * N // 2 // BATCH)


class Saving(Reports):
    """Reports that also take every loader's state at each step boundary, as the front doors'
    checkpoints do."""

    def __init__(self, loaders: dict[str, ReportingDataLoader]) -> None:
        super().__init__()
        self.loaders, self.states = loaders, list[dict[str, Any]]()

    def before_batch(self, loader: ReportingDataLoader) -> None:
        if self.boundaries.crossed(loader):
            self.states.append({name: each.resume_state(pass_ended=self.boundaries.left(each))
                                for name, each in self.loaders.items()})


def cycling_loop(
    loaders: dict[str, ReportingDataLoader],
    steps: int,
    boundaries: list[dict[str, Any]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Each step: a batch of ``main`` (its passes in a ``for``, two epochs) and one of ``aux`` drawn
    by hand, with a new ``iter()`` at its end (the short loader cycles four times an epoch); an
    optimizer step. Stops after ``steps`` steps in all; ``boundaries``: the states taken at each
    step boundary go there."""
    reports = Saving(loaders)
    weight = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    reports.boundaries.hook(optimizer)
    for loader in loaders.values():
        loader.attach(reports, None)
    rows, aux = [], iter(loaders["aux"])
    while len(rows) < steps:
        for batch in loaders["main"]:
            try:
                extra = next(aux)
            except StopIteration:
                aux = iter(loaders["aux"])
                extra = next(aux)
            rows.append((batch["id"].tolist(), extra["id"].tolist()))
            (weight * 0).backward()
            optimizer.step()
            if len(rows) == steps:
                break
        reports.boundaries.epoch_ended()  # as the front doors' epochs() between two epochs
    if boundaries is not None:
        boundaries.extend(reports.states)
    return rows


def test_a_loader_cycled_by_hand_beside_the_main_one_leaves_no_pass_at_any_step_boundary() -> None:
    """A short auxiliary loader drawn with next() and given a new iter() at its end runs out four
    times an epoch; that ends no pass of the main loader: a checkpoint at every step boundary of two
    epochs resumes exactly."""

    def loaders() -> dict[str, ReportingDataLoader]:
        return {
            "main": ReportingDataLoader(Augmented(N), batch_size=BATCH, shuffle=True, seed=1),
            "aux": ReportingDataLoader(Augmented(N // 4), batch_size=BATCH, shuffle=True, seed=2),
        }

    steps = 2 * N // BATCH
    states: list[dict[str, Any]] = []
    full = cycling_loop(loaders(), steps, states)
    assert len(states) == steps - 1  # a boundary before every step but the first
    for done, saved in enumerate(states, start=1):
        resumed = loaders()
        for name, loader in resumed.items():
            loader.load_state_dict(saved[name])
        assert cycling_loop(resumed, steps - done) == full[done:], (
            f"resumed at the boundary after step {done}"
        )
