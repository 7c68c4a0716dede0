"""Faults during training, on real processes with `enable_resume`
(tests/children/accelerate_child.py): SIGTERM storms, a full disk, writes interrupted at any byte.

Each interrupted run must leave exactly one new consistent checkpoint, and the job's concatenated
log and final weights must equal the uninterrupted run's.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from loader_resume.job.checkpoint import (
    MANIFEST,
    CheckpointError,
    complete_checkpoints,
    seal,
    temporary_name,
    verify,
)
from support.launch import logs, run, trained, weights
from support.reference import accelerate_run

EVAL = ("--eval-n", "13")


def checkpoints(out: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(out / "resume_checkpoints")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    run(out, 1, *EVAL)
    return out


def test_a_storm_of_signals_each_ends_in_one_checkpoint_and_the_job_stays_exact(
    uninterrupted: Path, tmp_path: Path
) -> None:
    """Five runs of one job: SIGTERM twice at once, in the first step after a resume, during a save,
    during evaluation; the sixth run finishes. 8 steps an epoch, an evaluation after each."""
    storms = [
        (["--signal-at", "3,3"], "step_000000003"),  # two signals: one checkpoint, one exit
        (["--signal-at", "1"], "step_000000004"),  # the first step after a resume
        # periodic save at 6, signal inside it
        (["--signal-in-save", "save_every_n_steps=2"], "step_000000007"),
        # during epoch 0's evaluation: taken at epoch 1's first request
        (["--signal-in-eval"], "step_000000008"),
        (["--signal-at", "2"], "step_000000010"),
    ]
    for options, newest in storms:
        run(tmp_path, 1, *EVAL, *options, expect=143)
        assert checkpoints(tmp_path)[-1] == newest
        assert not list((tmp_path / "resume_checkpoints").glob(".*.tmp"))
    run(tmp_path, 1, *EVAL)
    assert logs(tmp_path) == logs(uninterrupted)  # every evaluation ran once, at its place
    assert weights(tmp_path) == weights(uninterrupted)


def test_a_signal_to_one_rank_only_stops_both_at_the_same_step(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # made once per session (other modules compare with it too)
    full = accelerate_run(tmp_path_factory, 2)
    run(tmp_path / "job", 2, "--signal-at", "3", "--signal-rank", "1", expect=143)
    assert [len(trained(rows)) for rows in logs(tmp_path / "job")] == [3, 3]
    run(tmp_path / "job", 2)
    assert logs(tmp_path / "job") == logs(full)
    assert weights(tmp_path / "job") == weights(full)


def test_a_full_disk_during_a_save_keeps_training_and_reports_it(
    uninterrupted: Path, tmp_path: Path
) -> None:
    stderr = run(tmp_path, 1, *EVAL, "--disk-full-at", "10", "save_every_n_steps=5", "keep=5")
    assert "checkpoint at step 10 NOT written to" in stderr
    assert (
        "OSError: [Errno 28] No space left on device (simulated) (no space left on device, or over "
        "quota:"
        in stderr
    )
    assert "the newest complete checkpoint is still" in stderr and "step_000000005" in stderr
    assert checkpoints(tmp_path) == ["step_000000005", "step_000000015", "step_000000020"]
    assert not list((tmp_path / "resume_checkpoints").glob(".*"))  # the partial one is gone
    assert logs(tmp_path) == logs(uninterrupted) and weights(tmp_path) == weights(uninterrupted)


def test_a_full_disk_on_two_processes_is_agreed_by_both(tmp_path: Path) -> None:
    stderr = run(tmp_path, 2, "--disk-full-at", "4", "save_every_n_steps=4")
    # each process logs it, both went on
    assert stderr.count("checkpoint at step 4 NOT written") == 2
    # the last step (12) ends the run: no boundary after it
    assert checkpoints(tmp_path) == ["step_000000008"]


# --- writes interrupted at any byte (no processes needed: the files a kill would leave) -----------
def sealed_pair(root: Path) -> tuple[Path, Path]:
    """A sealed checkpoint step_1 and the files of step_2, ready to be sealed."""
    first = root / "step_000000001"
    temporary = temporary_name(first)
    temporary.mkdir(parents=True)
    (temporary / "model.bin").write_bytes(bytes(range(256)) * 8)
    (temporary / "loader_resume.pt").write_bytes(b'{"position": 64}' * 4)
    seal(temporary, first)
    second = temporary_name(root / "step_000000002")
    shutil.copytree(first, second)
    (second / MANIFEST).unlink()
    (second / "model.bin").write_bytes(bytes(range(255, -1, -1)) * 8)
    return first, second


def test_a_save_killed_at_any_byte_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = sealed_pair(tmp_path)
    full = (second / "model.bin").read_bytes()
    # the second save stopped after `cut` bytes of its largest file
    for cut in range(0, len(full) + 1, 97):
        (second / "model.bin").write_bytes(full[:cut])
        with caplog.at_level(logging.WARNING, logger="loader_resume.job.checkpoint"):
            assert complete_checkpoints(tmp_path) == [first]
        assert "an incomplete checkpoint (a save interrupted, or in progress)" in caplog.text
        verify(first)  # still loadable, byte for byte
        caplog.clear()


@pytest.mark.parametrize("damage", ["truncate", "flip", "append", "delete", "manifest"])
def test_a_damaged_sealed_checkpoint_is_refused_naming_the_file(
    tmp_path: Path, damage: str
) -> None:
    first, _ = sealed_pair(tmp_path)
    target = first / "loader_resume.pt"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[:-1])
    elif damage == "flip":
        target.write_bytes(data[:5] + bytes([data[5] ^ 0x80]) + data[6:])
    elif damage == "append":
        target.write_bytes(data + b" ")
    elif damage == "delete":
        target.unlink()
    else:
        (first / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"loader_resume|manifest"):
        verify(first)
