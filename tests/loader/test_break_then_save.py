"""The commonest way a plain job stops: a loop that ``break``s (a stop flag, a time limit,
``max_steps``) or fails, then saves. The state continues the pass in flight with its very next
batch, whether or not the loop's iterator still exists; a loop that leaves passes on purpose says
``pass_ended=True``. Each cut is resumed in a fresh process and compared with the uninterrupted run:
ids, and the values the items drew from torch, numpy and random."""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loader_resume import ResumableDataLoader
from support import forked
from support.launch import CHILDREN
from support.passes import BATCH, EPOCHS, N, build, record, rest

CONFIGS = [
    {"kind": kind, "workers": workers, "persistent": persistent}
    for kind in ("map", "stream")
    for workers, persistent in ((0, False), (2, False), (2, True))
]
STEPS = N // BATCH  # map-style batches an epoch


class Stop(Exception):
    """The loop fails here (a crash handler saves in ``except``)."""


def uninterrupted(config: dict[str, Any]) -> list[list[Any]]:
    return rest(build(config))


def cut(config: dict[str, Any], at: int, how: str) -> tuple[list[list[Any]], dict[str, Any]]:
    """Batches 0..``at`` (counted over the whole run), then the loop leaves its pass by ``break`` or
    an exception and saves; the rows it trained on and the state it saved."""
    loader, rows = build(config), []
    while True:
        try:
            for batch in loader:
                rows.append(record(batch))
                if len(rows) == at + 1:
                    if how == "raise":
                        raise Stop
                    break
            else:
                continue
        except Stop:
            # NOTE: inside `except`: the traceback still holds the iterator
            return rows, loader.state_dict()
        return rows, loader.state_dict()


def resumed_in_a_fresh_process(
    cases: list[tuple[dict[str, Any], dict[str, Any]]], tmp_path: Path
) -> list[Any]:
    saved, out = tmp_path / "cases.pt", tmp_path / "out.json"
    torch.save(cases, saved)
    done = forked.run(
        [sys.executable, str(CHILDREN / "break_resume_child.py"), str(saved), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"{c['kind']}-w{c['workers']}{'-p' * c['persistent']}"
)
def test_a_loop_that_breaks_or_fails_then_saves_continues_its_pass_with_the_very_next_batch(
    config: dict[str, Any], tmp_path: Path
) -> None:
    full = uninterrupted(config)
    total = len(full)
    assert total >= 2 * STEPS - 2 and len({json.dumps(row) for row in full}) == total
    # every batch of two epochs with no workers; with workers, the first, a middle one and each
    # epoch's last two
    ats = (
        range(total - 1)
        if config["workers"] == 0
        else sorted({0, 4, STEPS - 2, STEPS - 1, total - 2})
    )
    cases, befores = [], []
    for at in ats:
        for how in ("break", "raise"):
            before, state = cut(config, at, how)
            befores.append((at, how, before))
            cases.append((config, state))
    for (at, how, before), after in zip(
        befores, resumed_in_a_fresh_process(cases, tmp_path), strict=True
    ):
        assert before + after == full, f"{how} after batch {at}: resumed with other batches"


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_the_state_is_the_same_whether_the_iterator_was_collected_or_kept_alive(kind: str) -> None:
    """The loop's iterator, after a ``break``: dropped and collected, kept alive by a reference
    cycle with the collector off, or still held: one state."""
    config = {"kind": kind, "workers": 0, "persistent": False}
    states = []
    for fate in ("collected", "kept alive", "held"):
        loader = build(config)
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        if fate == "collected":
            del iterator
            gc.collect()
            states.append(loader.state_dict())
        elif fate == "kept alive":
            gc.disable()
            try:
                cycle: list[Any] = [iterator]
                cycle.append(cycle)
                del iterator, cycle
                states.append(loader.state_dict())
            finally:
                gc.enable()
        else:
            states.append(loader.state_dict())
    assert states[0] == states[1] == states[2]
    assert states[0]["epoch"] == 0 and (kind == "stream" or states[0]["position"] == 3 * BATCH)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_iter_in_the_same_process_still_starts_the_next_epoch(workers: int) -> None:
    config = {"kind": "map", "workers": workers, "persistent": False}
    loader, reference = build(config), build(config)
    epochs = [[record(batch) for batch in reference] for _ in range(EPOCHS)]
    for k, _ in enumerate(loader):
        if k == 2:
            break
    # as DataLoader: the next iter() is a new pass
    assert [record(batch) for batch in loader] == epochs[1]
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (2, 0)


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_state_at_an_epochs_last_batch_starts_the_next_epoch(kind: str) -> None:
    config = {"kind": kind, "workers": 0, "persistent": False}
    full = uninterrupted(config)
    loader, rows = build(config), []
    iterator = iter(loader)
    for batch in iterator:
        rows.append(record(batch))
        # the last batch is out; the iterator has not ended
        if kind == "map" and len(rows) == STEPS:
            break
    state = loader.state_dict()
    resumed = build(config)
    resumed.load_state_dict(state)
    assert rows + rest(resumed) == full and len(rows) == (
        STEPS if kind == "map" else len(full) // EPOCHS
    )


@pytest.mark.parametrize(
    "config",
    [
        {"kind": "map", "workers": 2, "persistent": False},
        {"kind": "stream", "workers": 0, "persistent": False},
    ],
    ids=["map-w2", "stream-w0"],
)
def test_pass_ended_after_a_break_starts_the_next_epoch_as_the_loops_next_iter_does(
    config: dict[str, Any],
) -> None:
    """A loop that leaves passes on purpose (an epoch limit of its own): the state it saves says
    so."""
    loader = build(config)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    state = loader.state_dict(pass_ended=True)
    assert state["epoch"] == 1 and loader.state_dict(pass_ended=True) == state
    resumed = build(config)
    resumed.load_state_dict(state)
    # both: epoch 1, whole
    assert [record(batch) for batch in resumed] == [record(batch) for batch in loader]


def test_which_continuation_was_chosen_is_logged_once_per_loader_and_a_pass_left_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="loader_resume")
    loader = build({"kind": "map", "workers": 0, "persistent": False})
    for k, _ in enumerate(loader):
        loader.state_dict()  # a checkpoint every step: one line, not one per save
        if k == 3:
            break
    notes = [r for r in caplog.records if r.name == "loader_resume.pass_notes"]
    assert [r.levelno for r in notes] == [logging.INFO]
    assert "continues the pass of epoch 0 at batch 2 of 10" in notes[0].getMessage()
    assert "state_dict(pass_ended=True)" in notes[0].getMessage()
    caplog.clear()
    # the loop left that pass on purpose: the state saved at its cut says otherwise
    next(iter(loader))
    (warning,) = [r for r in caplog.records if r.name == "loader_resume.pass_notes"]
    assert warning.levelno == logging.WARNING
    assert "left the pass of epoch 0 after batch 4 of 10" in warning.getMessage()
    caplog.clear()
    said = build({"kind": "map", "workers": 0, "persistent": False})
    for k, _ in enumerate(said):
        if k == 3:
            break
    said.state_dict(pass_ended=True)
    said.state_dict(pass_ended=False)
    list(said)
    # the loop said which
    assert not [r for r in caplog.records if r.name == "loader_resume.pass_notes"]


def test_a_sampler_without_len_takes_states_and_says_batch_k_of_an_unknown_total(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The log line needs the epoch's batches, which a user's sampler without ``__len__`` cannot
    tell: it says "?" (and the state is taken as before)."""

    class Endless(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            pass

        def __iter__(self) -> Any:
            return iter(range(20))

    caplog.set_level(logging.INFO, logger="loader_resume")
    loader = ResumableDataLoader(list(range(20)), batch_size=4, sampler=Endless())
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["position"] == 4
    assert "continues the pass of epoch 0 at batch 2 of ? when loaded" in caplog.text
