"""Evaluation loaders under preemption: a SIGTERM to the whole process group (the job and every DataLoader worker,
as ``kill -TERM -PGID`` or a scheduler sends it) during an evaluation, in each front door, with evaluation loaders
at ``num_workers`` 0 and 2 (tests/eval_preemption_child.py). The evaluation finishes, the agreed checkpoint follows
at the next step boundary, the job exits 143, and the same command again ends with the uninterrupted run's
training batches, evaluation points (and their losses) and final weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHILD = Path(__file__).parent / "eval_preemption_child.py"


def run(out: Path, front: str, workers: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHILD), str(out), "--front", front, "--eval-workers", str(workers),
                           *args], capture_output=True, text=True, timeout=300, start_new_session=True)


def log(out: Path) -> dict[str, Any]:
    return json.loads((out / "log.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    runs: dict[tuple[str, int], dict[str, Any]] = {}

    def get(front: str, workers: int) -> dict[str, Any]:
        if (front, workers) not in runs:
            out = tmp_path_factory.mktemp(f"{front}{workers}")
            done = run(out, front, workers)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[front, workers] = log(out)
        return runs[front, workers]

    return get


FRONTS = ("lightning", "fabric", "accelerate", "transformers")
CASES = [(front, workers, "--signal-in-eval", 2) for front in FRONTS for workers in (0, 2)] + [
    ("lightning", 2, "--signal-in-eval", 0), ("lightning", 2, "--signal-in-eval", 3),
    *((front, 2, "--signal-in-step", 4) for front in FRONTS)]


@pytest.mark.parametrize(("front", "workers", "when", "at"), CASES)
def test_a_sigterm_to_the_group_during_an_evaluation_checkpoints_and_the_same_command_continues(
    uninterrupted: Any, tmp_path: Path, front: str, workers: int, when: str, at: int
) -> None:
    """``--signal-in-eval K``: during the K-th evaluation (Lightning: 0 is the sanity check, 3 the validation at the
    epoch's end); ``--signal-in-step 4``: in the training step after which an evaluation is due."""
    full = uninterrupted(front, workers)
    assert len(full["rows"]) == 12 and [e["after"] for e in full["evals"]] == [2, 4, 6, 8, 10, 12]
    first = run(tmp_path, front, workers, when, str(at))
    assert first.returncode == 143, first.stderr[-3000:]
    stopped = log(tmp_path)
    assert len(stopped["rows"]) < 12  # stopped early
    second = run(tmp_path, front, workers, when, str(at))
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = log(tmp_path)
    assert resumed["rows"] == full["rows"]
    assert resumed["evals"] == full["evals"]
    assert resumed["weights"] == full["weights"]
