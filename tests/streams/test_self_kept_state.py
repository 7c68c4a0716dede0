"""A stream that keeps its own epoch or position, with no protocol the loader knows, is never
silently wrong: where its copy lives on across epochs (``num_workers=0``, persistent workers) and
nothing restores what its own ``iter()`` changes, the resume says that the continuation will not be
bit-identical, and why."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from loader_resume import ResumableDataLoader
from loader_resume.testing import fingerprint
from support import forked
from support.data import CountsOwnEpochs
from support.launch import CHILDREN

CLI = Path(sys.executable).parent / "loader-resume"


def _loader(workers: int, persistent: bool) -> ResumableDataLoader[Any]:
    return ResumableDataLoader(
        CountsOwnEpochs(), batch_size=3, num_workers=workers, persistent_workers=persistent
    )


def _cut(
    workers: int, persistent: bool, epoch: int, batches: int
) -> tuple[dict[str, Any], list[str]]:
    loader = _loader(workers, persistent)
    for _ in range(epoch):
        list(loader)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return loader.state_dict(), [fingerprint(b) for b in iterator]


def _resume(state: dict[str, Any], workers: int, persistent: bool) -> list[str]:
    resumed = _loader(workers, persistent)
    resumed.load_state_dict(state)
    return [fingerprint(b) for b in resumed]


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)])
def test_a_stream_counting_its_own_epochs_is_named_at_resume(
        workers: int, persistent: bool, caplog: pytest.LogCaptureFixture) -> None:
    state, rest = _cut(workers, persistent, epoch=1, batches=1)
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        got = _resume(state, workers, persistent)
    assert "will NOT be bit-identical" in caplog.text and "'epochs_seen'" in caplog.text
    assert "set_epoch(epoch)" in caplog.text  # the fix
    assert got != rest  # and indeed it is not: the warning is not a formality


@pytest.mark.parametrize(("workers", "persistent", "epoch"), [(0, False, 0), (2, False, 1)])
def test_where_a_new_copy_would_count_the_same_nothing_is_said_and_the_resume_is_exact(
        workers: int, persistent: bool, epoch: int, caplog: pytest.LogCaptureFixture) -> None:
    """In the first epoch, or with workers started afresh each epoch, the uninterrupted run's copy
    counted from scratch too: the replay is exact."""
    state, rest = _cut(workers, persistent, epoch=epoch, batches=1)
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        got = _resume(state, workers, persistent)
    assert got == rest and "bit-identical" not in caplog.text


def test_the_attributes_are_in_the_state_and_refused_when_malformed() -> None:
    state, _ = _cut(0, False, epoch=1, batches=1)
    assert state["stream"]["workers"][0]["own"] == ["epochs_seen"]
    state["stream"]["workers"][0]["own"] = "epochs_seen"
    with pytest.raises(ValueError, match=r"stream\.workers\[0\]\.own"):
        _loader(0, False).load_state_dict(state)


def test_loader_resume_check_reports_the_warning_with_the_divergence() -> None:
    done = forked.run([str(CLI), "check", "check_pipelines:counts_own_epochs",
                       "--epochs", "2", "--cuts", "5", "--workers", "0", "--json"],
                      capture_output=True, text=True, cwd=CHILDREN, timeout=300)
    (scenario,) = json.loads(done.stdout)
    assert done.returncode == 1 and not scenario["exact"]
    assert any(
        "will NOT be bit-identical" in w and "'epochs_seen'" in w for w in scenario["warned"]
    )
