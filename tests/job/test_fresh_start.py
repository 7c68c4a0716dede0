"""Never a silent start from step 0: a job that finds no checkpoint where an earlier job left traces
says so in one warning (``LOADER_RESUME_NO_CHECKPOINT=refuse``: refuses), in the core and through
the front doors.

The earlier job here is a real process that took the directory and was SIGKILLed, as a scheduler
kills a job whose grace period ran out: its lock file stays, naming it, and so does a checkpoint
write it never finished.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loader_resume.job.checkpoint import write_sealed
from loader_resume.job.checkpoint_dir import LOCK_FILE, CheckpointDirectoryError, DirectoryLock
from loader_resume.job.fresh_start import NO_CHECKPOINT_VARIABLE, newest_or_start, resuming_nothing
from support import forked
from support.launch import CHILDREN
from support.reference import child_run

KILLED_JOB = """
import sys, time
from pathlib import Path
from loader_resume.job.checkpoint_dir import DirectoryLock
directory = Path(sys.argv[1])
DirectoryLock.acquire(directory)
if sys.argv[2] == "writing":
    (directory / ".step_000000007.tmp-123-abcdef12").mkdir()  # a sealed write in flight's name
print("held", flush=True)
time.sleep(60)
"""


def killed_job(directory: Path, writing: bool) -> None:
    """A real job that holds ``directory`` (and, if ``writing``, has a checkpoint write in flight),
    SIGKILLed."""
    job = forked.popen(
        [sys.executable, "-c", KILLED_JOB, str(directory), "writing" if writing else "idle"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None and job.stdout.readline().strip() == "held"
    job.send_signal(signal.SIGKILL)
    assert job.wait(timeout=30) == -signal.SIGKILL


def no(flag: bool) -> bool:
    return flag  # a one-process job's agreement


def test_an_earlier_killed_job_and_no_checkpoint_is_said_in_one_warning_naming_what_it_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    killed_job(tmp_path, writing=True)
    lock = DirectoryLock.acquire(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, "loader_resume.job.fresh_start"):
            assert newest_or_start([], lock, no) is None
    finally:
        lock.release()
    said = [r.getMessage() for r in caplog.records if r.name == "loader_resume.job.fresh_start"]
    assert len(said) == 1, said
    assert "the lock file of a job that did not end cleanly (pid " in said[0]
    assert f": -c {tmp_path} writing)" in said[0]  # the killed job's command line
    assert ".step_000000007.tmp-123-abcdef12, a checkpoint write it never finished" in said[0]
    assert said[0].endswith(f"starting from step 0 ({NO_CHECKPOINT_VARIABLE}=refuse stops instead)")


def test_refuse_stops_the_job_naming_the_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed_job(tmp_path, writing=False)
    monkeypatch.setenv(NO_CHECKPOINT_VARIABLE, "refuse")
    lock = DirectoryLock.acquire(tmp_path)
    try:
        with pytest.raises(
            CheckpointDirectoryError,
            match=r"an earlier job left the lock file of a job that did not "
            r"end cleanly \(pid \d+ .*refused, as LOADER_RESUME_NO_CHECKPOINT=refuse",
        ):
            newest_or_start([], lock, no)
    finally:
        lock.release()
    refused = lock.traces
    # the next start meets the same traces, and starts over saying so
    monkeypatch.delenv(NO_CHECKPOINT_VARIABLE)
    lock = DirectoryLock.acquire(tmp_path)
    assert lock.traces == refused and resuming_nothing(lock, no)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()  # the start that went on let go cleanly


def test_a_checkpoint_to_resume_or_a_clean_directory_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed job that left a complete checkpoint is resumed (refuse or not); a directory a job
    let go of cleanly (its lock file removed) and a first start hold no traces."""
    monkeypatch.setenv(NO_CHECKPOINT_VARIABLE, "refuse")
    assert write_sealed(
        tmp_path / "step_000000003",
        lambda d: torch.save({"x": 1}, d / "model.pt"),
        main=True,
        agree=no,
        step=3,
    )
    killed_job(tmp_path, writing=True)
    lock = DirectoryLock.acquire(tmp_path)
    assert newest_or_start([tmp_path / "step_000000003"], lock, no) == tmp_path / "step_000000003"
    lock.release()
    for directory in (tmp_path, tmp_path / "new"):  # let go of cleanly just now; never used
        with caplog.at_level(logging.WARNING, "loader_resume.job.fresh_start"):
            lock = DirectoryLock.acquire(directory)
            assert not resuming_nothing(lock, no)
            lock.release()
    assert not [r for r in caplog.records if r.name == "loader_resume.job.fresh_start"]


def test_a_misspelt_choice_is_refused_naming_the_variable_and_the_choices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NO_CHECKPOINT_VARIABLE, "refused")
    with pytest.raises(ValueError, match=r"LOADER_RESUME_NO_CHECKPOINT='refused': expected one of "
                                         r"\['start-over', 'refuse'\]"):
        newest_or_start([], None, no)


# --- through a front door: a Lightning job killed while its first checkpoint was still being
# written ---------------
LIGHTNING_CHILD = CHILDREN / "lightning_child.py"


def test_a_lightning_job_killed_before_its_first_checkpoint_was_whole_is_not_restarted_silently(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``AsyncCheckpointIO`` 1 s per file; SIGKILL to the job's process group while step 3's file is
    being written: nothing complete on storage. The same command with
    ``LOADER_RESUME_NO_CHECKPOINT=refuse`` stops before any step, naming the killed job; without it,
    it says in one warning that it starts from step 0, and trains exactly the uninterrupted run."""
    out = tmp_path / "job"
    out.mkdir()
    job = [sys.executable, str(LIGHTNING_CHILD), str(out), "--async-io", "1", "--sleep", "0.1"]
    first = forked.popen(
        job, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    marker = out / "writing"
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text() == "step=3.ckpt"):
        assert time.monotonic() < deadline and first.poll() is None, (
            "the job never began writing step=3.ckpt"
        )
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert not list(out.glob("**/*.ckpt"))  # nothing complete on storage
    refused = forked.run(job, capture_output=True, text=True, timeout=300,
                         env={**os.environ, NO_CHECKPOINT_VARIABLE: "refuse"})
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert (
        f"CheckpointDirectoryError: {out}: an earlier job left the lock file of a job that did not "
        f"end cleanly (pid {first.pid} on " in refused.stderr
    )
    assert not (out / "log-0.json").exists()  # stopped before training
    rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stderr.count("starting from step 0") == 1
    assert (
        f"an earlier job left the lock file of a job that did not end cleanly (pid {first.pid} on "
        in rerun.stderr
    )
    uninterrupted = child_run(tmp_path_factory, "lightning_child.py", "--every", "3")
    for name in ("log-0.json", "weights-0.txt"):
        assert (out / name).read_text() == (uninterrupted / name).read_text()


# --- through the other front doors: a job SIGKILLed before its first checkpoint -------------------
FRONT_DOORS = {  # the child, its options, where the front door keeps its checkpoints (under OUT)
    "fabric": ("fabric_child.py", [], "resume_checkpoints"),
    "accelerate": ("accelerate_child.py", [], "resume_checkpoints"),
    "transformers": ("transformers_child.py", ["--resume", "true", "--save-steps", "1000"], "run"),
}


@pytest.mark.parametrize("front_door", sorted(FRONT_DOORS))
def test_every_front_door_refuses_or_names_the_start_over_after_a_kill_before_any_checkpoint(
    tmp_path: Path, front_door: str
) -> None:
    child, options, directory = FRONT_DOORS[front_door]
    out = tmp_path / "job"
    job = [sys.executable, str(CHILDREN / child), str(out), *options]
    first = forked.popen(
        [*job, "--sleep", "0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log = out / "log-0.jsonl"
    deadline = time.monotonic() + 120
    while not log.exists() or len(log.read_text().splitlines()) < 3:
        assert time.monotonic() < deadline and first.poll() is None, (
            "the job never trained 3 batches"
        )
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    log.unlink()  # the rerun's log alone
    refused = forked.run(job, capture_output=True, text=True, timeout=300,
                         env={**os.environ, NO_CHECKPOINT_VARIABLE: "refuse"})
    assert (
        refused.returncode != 0
        and f"{out / directory}: an earlier job left the lock file of a job that did "
        f"not end cleanly (pid {first.pid} on "
        in refused.stderr
    ), refused.stderr[-3000:]
    assert not log.exists() or not log.read_text()  # refused before its first batch
    rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stderr.count("no checkpoint to resume from: starting from step 0") == 1, (
        rerun.stderr[-3000:]
    )


def test_accelerates_configuration_takes_the_variable_as_ours_and_names_its_typo() -> None:
    """Accelerate's ``LOADER_RESUME_*`` variables are checked against its configuration's fields:
    this one, read by every front door, is accepted beside them; a misspelt one fails naming it."""
    from accelerate_resume.config import load_config

    assert (
        load_config(
            None, environ={NO_CHECKPOINT_VARIABLE: "refuse", "LOADER_RESUME_KEEP": "3"}
        ).keep
        == 3
    )
    with pytest.raises(ValueError, match=r"LOADER_RESUME_NO_CHECKPOINTS: unknown \(did you mean "
                                         r"LOADER_RESUME_NO_CHECKPOINT\?\)"):
        load_config(None, environ={"LOADER_RESUME_NO_CHECKPOINTS": "refuse"})
