"""The edges of real loops through the front doors: epochs that leave a pass early, several training loaders.

Lightning (tests/lightning_loops_child.py): ``limit_train_batches`` (float and int) and a dict of two training
loaders in ``CombinedLoader`` (``min_size``, ``max_size_cycle``, ``max_size``; Lightning refuses ``sequential``
for training), resumed with ``fit(ckpt_path=...)`` from a ``ModelCheckpoint(every_n_train_steps=1)`` file at
every step of two epochs, and SIGTERMed (the whole process group) at an epoch's last batch, then rerun.
Accelerate (tests/accelerate_loops_child.py): two prepared loaders under ``zip`` and alternating steps, a SIGTERM
after every step of two epochs, each time rerun with the same command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parent


def lightning(out: Path, *args: str, expect: int = 0) -> None:
    done = subprocess.run([sys.executable, str(TESTS / "lightning_loops_child.py"), str(out), *args],
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == expect, done.stderr[-3000:]


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize(("shape", "workers"), [("limit-0.5", 0), ("limit-3", 2), ("min_size", 2),
                                                ("max_size_cycle", 0), ("max_size", 0)])
def test_lightning_resumes_exactly_from_a_checkpoint_at_every_step_of_epochs_that_leave_a_pass(
    tmp_path: Path, shape: str, workers: int
) -> None:
    lightning(tmp_path, "--shape", shape, "--workers", str(workers))
    full = read(tmp_path / "full.json")
    steps = len(full["rows"])
    assert steps >= 6
    for at in range(1, steps + 1):
        resumed = read(tmp_path / f"from-{at}.json")
        assert resumed["rows"] == full["rows"][at:], f"{shape}: resumed from the checkpoint at step {at}"
        assert resumed["weights"] == full["weights"], f"{shape}: weights after resuming at step {at}"
    again, at = read(tmp_path / "again.json"), int((tmp_path / "again-from.txt").read_text())  # a resumed run's
    assert again["rows"] == full["rows"][at:] and again["weights"] == full["weights"]  # checkpoint, resumed
    if not shape.startswith("limit"):
        both = [row for row in full["rows"] if "a" in row and "b" in row]
        assert both and all(row["a"][1] != row["b"][1] for row in both), "two loaders drew the same values"


@pytest.mark.parametrize(("shape", "at"), [("limit-0.5", 2), ("min_size", 5)])
def test_lightning_sigterm_to_the_group_at_an_epochs_last_batch_and_a_rerun_continue_exactly(
    tmp_path: Path, shape: str, at: int
) -> None:
    """Each epoch here ends at step ``at`` + 1 (3 of 6 batches; the shorter of two loaders' 6 batches)."""
    lightning(tmp_path / "full", "--shape", shape, "--workers", "2")
    job = tmp_path / "job"
    lightning(job, "--shape", shape, "--workers", "2", "--signal-at", str(at), expect=143)
    assert len(read(job / "job.json")["rows"]) == at + 1
    lightning(job, "--shape", shape, "--workers", "2", "--signal-at", str(at))
    full, resumed = read(tmp_path / "full" / "full.json"), read(job / "job.json")
    assert resumed["rows"] == full["rows"] and resumed["weights"] == full["weights"]


# --- Accelerate -----------------------------------------------------------------------------------------------
def accelerate(out: Path, *args: str) -> int:
    command = [sys.executable, str(TESTS / "accelerate_loops_child.py"), str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode in (0, 143), done.stderr[-3000:]
    return done.returncode


@pytest.mark.parametrize(("shape", "workers"), [("zip", 2), ("alternate", 0)])
def test_accelerate_two_loaders_of_unequal_length_resume_exactly_after_a_sigterm_at_every_step(
    tmp_path: Path, shape: str, workers: int
) -> None:
    """``zip``: the longer loader first, one optimizer step per pair; ``alternate``: the shorter first, one step per
    batch, and the loop steps its optimizer twice per batch (``resume.step`` counts optimizer steps)."""
    assert accelerate(tmp_path / "full", "--shape", shape, "--workers", str(workers)) == 0
    full = read(tmp_path / "full" / "log.json")
    job = tmp_path / "job"
    runs = 0
    while accelerate(job, "--shape", shape, "--workers", str(workers), "--signal-after", "1") == 143:
        runs += 1
        assert runs <= len(full["rows"]) + 1, "the job never finished"
    resumed = read(job / "log.json")
    boundaries = len(full["rows"]) // (2 if shape == "alternate" else 1)  # alternate: zip fetches a pair at once
    assert runs >= boundaries - 1  # a cut at every boundary but the job's last
    assert resumed["rows"] == full["rows"] and resumed["weights"] == full["weights"]
    both = [row for row in full["rows"] if "a" in row and "b" in row]
    assert all(row["a"][1] != row["b"][1] for row in both), "two loaders drew the same values"
    if shape == "alternate":
        assert full["rows"][-1]["step"] == 2 * len(full["rows"])  # two optimizer steps per batch

