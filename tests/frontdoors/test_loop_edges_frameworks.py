"""The edges of real loops through the front doors: epochs that leave a pass early, several training
loaders.

Lightning (tests/children/lightning_loops_child.py): ``limit_train_batches`` (float and int) and a
dict of two training loaders in ``CombinedLoader`` (``min_size``, ``max_size_cycle``, ``max_size``;
Lightning refuses ``sequential`` for training), resumed with ``fit(ckpt_path=...)`` from a
``ModelCheckpoint(every_n_train_steps=1)`` file at every step of two epochs, and SIGTERMed (the
whole process group) at an epoch's last batch, then rerun. Accelerate
(tests/children/accelerate_loops_child.py): two prepared loaders under ``zip`` and alternating
steps, a SIGTERM at every step of two epochs (each a job of its own, cut and rerun with the same
command in batch processes), and one job SIGTERMed at its first step, mid-epoch and at an epoch's
last batch in real processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from support import forked
from support.batch import run_batch
from support.launch import CHILDREN
from support.reference import child_run


def lightning(out: Path, *args: str, expect: int = 0) -> None:
    done = forked.run([sys.executable, str(CHILDREN / "lightning_loops_child.py"), str(out), *args],
                      capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == expect, done.stderr[-3000:]


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def every_step(factory: pytest.TempPathFactory, shape: str, workers: int) -> Path:
    """The uninterrupted run and the resumes from its checkpoint at every step (one process), made
    once per session: the SIGTERM test below compares with its uninterrupted run."""
    return child_run(
        factory, "lightning_loops_child.py", "--shape", shape, "--workers", str(workers)
    )


@pytest.mark.parametrize(("shape", "workers"), [("limit-0.5", 2), ("limit-3", 0), ("min_size", 2),
                                                ("max_size_cycle", 0), ("max_size", 0)])
def test_lightning_resumes_exactly_from_a_checkpoint_at_every_step_of_epochs_that_leave_a_pass(
    tmp_path_factory: pytest.TempPathFactory, shape: str, workers: int
) -> None:
    """``limit-0.5`` and ``limit-3`` both make epochs of 3 of the 6 batches (a float and an int
    limit), one at 2 workers and one at 0; ``limit-0.5`` and ``min_size`` at 2 workers are the runs
    the SIGTERM test compares with."""
    out = every_step(tmp_path_factory, shape, workers)
    full = read(out / "full.json")
    steps = len(full["rows"])
    assert steps >= 6
    for at in range(1, steps + 1):
        resumed = read(out / f"from-{at}.json")
        assert resumed["rows"] == full["rows"][at:], (
            f"{shape}: resumed from the checkpoint at step {at}"
        )
        assert resumed["weights"] == full["weights"], (
            f"{shape}: weights after resuming at step {at}"
        )
    # a resumed run's
    again, at = read(out / "again.json"), int((out / "again-from.txt").read_text())
    # checkpoint, resumed
    assert again["rows"] == full["rows"][at:] and again["weights"] == full["weights"]
    if not shape.startswith("limit"):
        both = [row for row in full["rows"] if "a" in row and "b" in row]
        assert both and all(row["a"][1] != row["b"][1] for row in both), (
            "two loaders drew the same values"
        )


@pytest.mark.parametrize(("shape", "at"), [("limit-0.5", 2), ("min_size", 5)])
def test_lightning_sigterm_to_the_group_at_an_epochs_last_batch_and_a_rerun_continue_exactly(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, shape: str, at: int
) -> None:
    """Each epoch here ends at step ``at`` + 1 (3 of 6 batches; the shorter of two loaders' 6
    batches)."""
    reference = every_step(tmp_path_factory, shape, 2)
    job = tmp_path / "job"
    lightning(job, "--shape", shape, "--workers", "2", "--signal-at", str(at), expect=143)
    assert len(read(job / "job.json")["rows"]) == at + 1
    lightning(job, "--shape", shape, "--workers", "2", "--signal-at", str(at))
    full, resumed = read(reference / "full.json"), read(job / "job.json")
    assert resumed["rows"] == full["rows"] and resumed["weights"] == full["weights"]


# --- Accelerate -----------------------------------------------------------------------------------
ACCELERATE = CHILDREN / "accelerate_loops_child.py"
SHAPES = {"zip": ("2", 8), "alternate": ("0", 16)}  # workers, rows of the job (two epochs)
CHAINS = {"zip": "1,3,4", "alternate": "1,5,8"}  # the first step, mid-epoch, an epoch's last batch


def accelerate(out: Path, shape: str, *args: str) -> int:
    command = [
        sys.executable,
        str(ACCELERATE),
        str(out),
        "--shape",
        shape,
        "--workers",
        SHAPES[shape][0],
        *args,
    ]
    done = forked.run(command, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode in (0, 143), done.stderr[-3000:]
    return done.returncode


def signals(shape: str) -> range:
    """The rows after which a job is SIGTERMed: every row (zip), every batch of b (alternate: zip
    fetches b's and a's batches as a pair, so the checkpoint follows a's: a SIGTERM after a batch of
    a comes at the same boundary)."""
    rows = SHAPES[shape][1]
    return range(1, rows + 1) if shape == "zip" else range(1, rows + 1, 2)


@pytest.fixture(scope="module")
def cuts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per shape: the uninterrupted job, and a job SIGTERMed after its N-th row for every N of
    :func:`signals` (a cut at every step boundary of two epochs), all in one process
    (tests/support/batch.py); then every one of those that stopped (exit 143) rerun with the same
    command, in one fresh process (each loads a checkpoint another process wrote)."""
    root = tmp_path_factory.mktemp("cuts")
    plan = [(shape, None) for shape in SHAPES] + [
        (shape, at) for shape in SHAPES for at in signals(shape)
    ]

    def out(shape: str, at: int | None) -> Path:
        return root / f"{shape}-{at or 'full'}"

    def argv(shape: str, at: int | None) -> list[str]:
        options = [] if at is None else ["--signal-at", str(at)]
        return [str(out(shape, at)), "--shape", shape, "--workers", SHAPES[shape][0], *options]

    first = run_batch(ACCELERATE, [argv(*run) for run in plan], root / "first")
    stopped = {run: (done.returncode, read(out(*run) / "log.json"), done.stderr)
               for run, done in zip(plan, first, strict=True)}
    again = [run for run in plan if run[1] is not None and stopped[run][0] == 143]
    second = run_batch(ACCELERATE, [argv(*run) for run in again], root / "again")
    return {
        "stopped": stopped,
        "again": {
            run: (done.returncode, read(out(*run) / "log.json"), done.stderr)
            for run, done in zip(again, second, strict=True)
        },
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_accelerate_two_loaders_of_unequal_length_resume_exactly_after_a_sigterm_at_every_step(
    cuts: dict[str, Any], shape: str
) -> None:
    """``zip``: the longer loader first, one optimizer step per pair; ``alternate``: the shorter
    first, one step per batch, and the loop steps its optimizer twice per batch (``resume.step``
    counts optimizer steps). A job SIGTERMed after a row checkpoints at the next step boundary (exit
    143) and the same command again ends with the uninterrupted run's rows and weights; a SIGTERM
    with no boundary left (alternate's last pair: zip ends at b) lets the job finish. The test after
    this one cuts one job at several steps in real processes."""
    code, full, stderr = cuts["stopped"][shape, None]
    assert code == 0, stderr[-3000:]
    rows = SHAPES[shape][1]
    assert len(full["rows"]) == rows
    for at in signals(shape):
        code, stopped, stderr = cuts["stopped"][shape, at]
        boundary = at + (at % 2 if shape == "alternate" else 0)
        if shape == "alternate" and boundary == rows:
            assert code == 0 and stopped == full, (
                f"SIGTERM at row {at}: exit {code}\n{stderr[-3000:]}"
            )
            continue
        assert code == 143, f"SIGTERM at row {at}: exit {code}\n{stderr[-3000:]}"
        assert stopped["rows"] == full["rows"][:boundary], (
            f"SIGTERM at row {at}: the rows before its checkpoint"
        )
        code, resumed, stderr = cuts["again"][shape, at]
        assert code == 0, f"rerun after the SIGTERM at row {at}: exit {code}\n{stderr[-3000:]}"
        assert resumed["rows"] == full["rows"] and resumed["weights"] == full["weights"], (
            f"SIGTERM at row {at}"
        )
    both = [row for row in full["rows"] if "a" in row and "b" in row]
    assert all(row["a"][1] != row["b"][1] for row in both), "two loaders drew the same values"
    if shape == "alternate":
        assert full["rows"][-1]["step"] == 2 * len(full["rows"])  # two optimizer steps per batch


@pytest.mark.parametrize("shape", SHAPES)
def test_accelerate_a_job_sigtermed_at_several_steps_in_real_processes_continues_exactly(
    cuts: dict[str, Any], tmp_path: Path, shape: str
) -> None:
    """One job, each run a process of its own, SIGTERMed at its first step, mid-epoch and at an
    epoch's last batch (the resumed runs cut in turn), each time rerun with the same command."""
    full = cuts["stopped"][shape, None][1]
    stops = {"zip": [1, 3, 4], "alternate": [2, 6, 8]}[shape]  # the rows logged at each checkpoint
    for stop in stops:
        assert accelerate(tmp_path, shape, "--signal-at", CHAINS[shape]) == 143
        assert len(read(tmp_path / "log.json")["rows"]) == stop
    assert accelerate(tmp_path, shape, "--signal-at", CHAINS[shape]) == 0
    resumed = read(tmp_path / "log.json")
    assert resumed["rows"] == full["rows"] and resumed["weights"] == full["weights"]
