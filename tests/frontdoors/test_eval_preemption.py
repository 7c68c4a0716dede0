"""Evaluation loaders under preemption: a SIGTERM to the whole process group (the job and every
DataLoader worker, as ``kill -TERM -PGID`` or a scheduler sends it) during an evaluation, in each
front door, with evaluation loaders at ``num_workers`` 0 and 2
(tests/children/eval_preemption_child.py). The evaluation finishes, the agreed checkpoint follows at
the next step boundary, the job exits 143, and the same command again ends with the uninterrupted
run's training batches, evaluation points (and their losses) and final weights. The first runs are
processes of their own; the uninterrupted runs, and the second runs (resumes from a checkpoint
another process wrote), run in batch processes (tests/support/batch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import forked
from support.batch import run_batch
from support.launch import CHILDREN
from support.reference import shared_run

CHILD = CHILDREN / "eval_preemption_child.py"


def run(out: Path, front: str, workers: int, *args: str | int) -> subprocess.CompletedProcess[str]:
    return forked.run(
        [sys.executable, str(CHILD), *argv(out, front, workers, *args)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )


def argv(out: Path, front: str, workers: int, *args: str | int) -> list[str]:
    return [str(out), "--front", front, "--eval-workers", str(workers), *map(str, args)]


def log(out: Path) -> dict[str, Any]:
    return json.loads((out / "log.json").read_text())  # type: ignore[no-any-return]


FRONTS = ("lightning", "fabric", "accelerate", "transformers")
CASES = [(front, workers, "--signal-in-eval", 2) for front in FRONTS for workers in (0, 2)] + [
    ("lightning", 2, "--signal-in-eval", 0), ("lightning", 2, "--signal-in-eval", 3),
    *((front, 2, "--signal-in-step", 4) for front in FRONTS)]


def name(front: str, workers: int, when: str = "", at: int = 0) -> str:
    return f"{front}-{workers}{when}-{at}" if when else f"{front}-{workers}"


@pytest.fixture(scope="module")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, int], dict[str, Any]]:
    """Every front door at 0 and 2 evaluation workers, uninterrupted, in one process
    (tests/support/batch.py), once per session."""
    runs = [(front, workers) for front in FRONTS for workers in (0, 2)]

    def make(root: Path) -> None:
        done = run_batch(CHILD, [argv(root / name(*each), *each) for each in runs], root / "batch")
        for each, result in zip(runs, done, strict=True):
            assert result.returncode == 0, f"{each}: {result.stderr[-3000:]}"

    root = shared_run(tmp_path_factory, "eval_preemption-uninterrupted", make)
    return {each: log(root / name(*each)) for each in runs}


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, int, str, int], tuple[Any, ...]]:
    """Every case's first run, a process of its own in a session of its own (the SIGTERM goes to its
    group), then every case's same command again, in one fresh process (tests/support/batch.py): per
    case, the first run's exit status, standard error and log, and the second's exit status and
    standard error."""
    root = tmp_path_factory.mktemp("jobs")
    first = {}
    for case in CASES:
        done = run(root / name(*case), *case)
        first[case] = (
            done.returncode,
            done.stderr,
            log(root / name(*case)) if done.returncode == 143 else None,
        )
    again = run_batch(CHILD, [argv(root / name(*case), *case) for case in CASES], root / "again")
    return {case: (*first[case], result.returncode, result.stderr, root / name(*case))
            for case, result in zip(CASES, again, strict=True)}


@pytest.mark.parametrize(("front", "workers", "when", "at"), CASES)
def test_a_sigterm_to_the_group_during_an_evaluation_checkpoints_and_the_same_command_continues(
    uninterrupted: dict[tuple[str, int], dict[str, Any]],
    jobs: dict[tuple[str, int, str, int], tuple[Any, ...]],
    front: str,
    workers: int,
    when: str,
    at: int,
) -> None:
    """``--signal-in-eval K``: during the K-th evaluation (Lightning: 0 is the sanity check, 3 the
    validation at the epoch's end); ``--signal-in-step 4``: in the training step after which an
    evaluation is due. Evaluation workers 0 and 2 in every front door at the second evaluation:
    without workers the evaluation draws in the job's own process (its random state must come back
    with the checkpoint), with them the SIGTERM reaches the evaluation's workers too."""
    full = uninterrupted[front, workers]
    assert len(full["rows"]) == 12 and [e["after"] for e in full["evals"]] == [2, 4, 6, 8, 10, 12]
    code, stderr, stopped, code_again, stderr_again, out = jobs[front, workers, when, at]
    assert code == 143, stderr[-3000:]
    assert len(stopped["rows"]) < 12  # stopped early
    assert code_again == 0, stderr_again[-3000:]
    resumed = log(out)
    assert resumed["rows"] == full["rows"]
    assert resumed["evals"] == full["evals"]
    assert resumed["weights"] == full["weights"]
