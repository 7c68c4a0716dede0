"""Checkpoints written in the background (Lightning's ``AsyncCheckpointIO``): the preemption
checkpoint is whole on storage before anything renames or announces it and before the process exits;
a write that fails in the background is a failed save (exit 74); a job killed while a periodic write
is in flight resumes from the newest complete one.

Every job here runs ``tests/children/lightning_child.py --async-io SECONDS``: ``AsyncCheckpointIO``
over Lightning's own ``TorchCheckpointIO`` made that many seconds slower per file (a large
checkpoint on slow storage), so that each write is still in flight when the job goes on, is
signalled or is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loader_resume.job.checkpoint_dir import FAILED_SAVE_EXIT_CODE
from support import forked
from support.launch import CHILDREN, progress_of
from support.mounts import tmpfs
from support.reference import child_run

CHILD = CHILDREN / "lightning_child.py"


def command(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(CHILD), str(out), *args]


def finished(out: Path) -> dict[str, Any]:
    ranks = sorted(out.glob("log-*.json"))
    return {
        "logs": [json.loads(path.read_text()) for path in ranks],
        "weights": [(out / f"weights-{path.stem.split('-')[1]}.txt").read_text() for path in ranks],
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted one-device fit (no worker: batches do not depend on ``num_workers``)."""
    return finished(child_run(tmp_path_factory, "lightning_child.py", "--every", "3"))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted two-rank DDP fit (test_lightning.py's; its checkpoints every 2 steps change
    nothing)."""
    return finished(
        child_run(tmp_path_factory, "lightning_child.py", "--devices", "2", "--every", "2")
    )


def wait_for(condition: Any, process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline and process.poll() is None, (
            f"the job never reached {what}"
        )
        time.sleep(0.02)


@pytest.mark.parametrize(("devices", "workers"), [(1, 0), (1, 2), (2, 2)])
def test_sigterm_with_an_async_writer_exits_143_once_the_checkpoint_is_whole_and_reruns_exactly(
    single: dict[str, Any], ddp: dict[str, Any], tmp_path: Path, devices: int, workers: int
) -> None:
    """SIGTERM mid-epoch (to the process group on two devices, as a scheduler sends it) while the
    writer is seconds behind: exit 143 with ``preempted.ckpt`` whole and no temporary file left,
    then the same command continues with the uninterrupted run's batches and final weights."""
    out = tmp_path / "job"
    out.mkdir()
    job = command(out, "--async-io", "1", "--sleep", "0.15", "--append", "--workers", str(workers),
                  "--devices", str(devices))
    first = forked.popen(
        job, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    wait_for(lambda: progress_of(out / "progress-0") >= 4, first, "step 4")
    (os.killpg if devices > 1 else os.kill)(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr[-3000:]
    assert stderr.count("checkpoint written at step") == devices, stderr[-3000:]
    assert [path.name for path in out.iterdir() if ".tmp-" in path.name] == []
    stopped_at = len(json.loads((out / "log-0.json").read_text()))
    # mid-training, well before its 24 (one device) or 12 steps
    assert 4 <= stopped_at < 20, stopped_at
    rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {out / 'preempted.ckpt'}" in rerun.stderr
    # the rerun's log appends to the first run's
    assert finished(out) == (single if devices == 1 else ddp)


def test_a_users_own_checkpoint_io_that_writes_from_threads_is_waited_for_through_its_teardown(
    single: dict[str, Any], tmp_path: Path
) -> None:
    """Not Lightning's class: a ``CheckpointIO`` of the user's whose ``save_checkpoint`` starts a
    thread and returns, and whose ``teardown()`` joins them. SIGTERM after step 5: exit 143 with
    ``preempted.ckpt`` whole, and the rerun continues exactly."""
    out = tmp_path / "job"
    out.mkdir()
    job = command(out, "--own-async-io", "1", "--append")
    done = forked.run([*job, "--signal-at", "5"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, done.stderr[-3000:]
    assert "checkpoint written at step 5" in done.stderr
    rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {out / 'preempted.ckpt'}" in rerun.stderr
    assert finished(out) == single


def test_a_preemption_save_failing_in_the_background_exits_74_and_reruns_from_the_last_complete(
    ddp: dict[str, Any], tmp_path: Path
) -> None:
    """DDP on two ranks; the callback's directory is a tmpfs that fills after step 5, then SIGTERM:
    the write fails in the writer's thread after ``save_checkpoint`` returned. Both ranks report it
    and exit 74, nothing is left in the directory but the filler, and the rerun resumes from
    ModelCheckpoint's ``last.ckpt`` exactly."""
    out, directory = tmp_path / "job", tmp_path / "resume"
    out.mkdir()
    job = command(out, "--async-io", "0.5", "--devices", "2", "--resume-dir", str(directory))
    with tmpfs(directory, "1m"):
        done = forked.run(
            [*job, "--fill-disk-at", "5", "--signal-at", "5"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == FAILED_SAVE_EXIT_CODE, done.stderr[-3000:]
        assert done.stderr.count("could NOT be written") == 2, done.stderr[-3000:]
        assert "no space left on device" in done.stderr and "Traceback" not in done.stderr
        # no preempted.ckpt, no temporary
        assert sorted(path.name for path in directory.iterdir()) == ["filler"]
        (directory / "filler").unlink()
        rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (
        f"Restoring states from the checkpoint path at {out / 'ckpt' / 'last.ckpt'}" in rerun.stderr
    )
    assert finished(out)["weights"] == ddp["weights"]


def test_a_job_killed_during_a_periodic_write_resumes_from_the_newest_complete_checkpoint(
    single: dict[str, Any], tmp_path: Path
) -> None:
    """ModelCheckpoint every 3 steps, each file 1.5 s in the writer: SIGKILL to the job while
    ``step=6.ckpt`` is being written (step 3's files are whole, later steps' are queued). The rerun
    resumes from step 3's ``last.ckpt`` and delivers the uninterrupted run's batches from there,
    with its final weights."""
    out = tmp_path / "job"
    out.mkdir()
    job = command(out, "--async-io", "1.5", "--sleep", "0.1")
    first = forked.popen(
        job, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True
    )
    marker = out / "writing"
    wait_for(
        lambda: marker.exists() and marker.read_text() == "step=6.ckpt",
        first,
        "the write of step=6.ckpt",
    )
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert sorted(path.name for path in (out / "ckpt").iterdir()) == ["last.ckpt", "step=3.ckpt"]
    rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (
        f"Restoring states from the checkpoint path at {out / 'ckpt' / 'last.ckpt'}" in rerun.stderr
    )
    resumed = finished(out)
    assert resumed["logs"][0] == single["logs"][0][3:]  # the rerun's own log: from step 3 on
    assert resumed["weights"] == single["weights"]


# --- Fabric: FabricResume's sealed checkpoints through Fabric(plugins=[AsyncCheckpointIO(...)]) ---
FABRIC_CHILD = CHILDREN / "fabric_child.py"


def fabric_logs(out: Path) -> dict[str, Any]:
    return {"logs": [path.read_text() for path in sorted(out.glob("log-*.jsonl"))],
            "weights": [path.read_text() for path in sorted(out.glob("weights-*.txt"))]}


def test_fabric_seals_a_preemption_checkpoint_only_once_the_background_write_is_on_storage(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two ranks, SIGTERM to the process group mid-epoch, each file 1 s in the writer's thread: the
    sealed checkpoint holds Fabric's file (its manifest names it), exit 143, and the same command
    continues exactly."""
    full = child_run(tmp_path_factory, "fabric_child.py", "--devices", "2")  # test_fabric.py's too
    out = tmp_path / "job"
    job = [sys.executable, str(FABRIC_CHILD), str(out), "--devices", "2", "--async-io", "1"]
    first = forked.popen(
        [*job, "--sleep", "0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for(lambda: progress_of(out / "progress-0") >= 5, first, "step 5")
    os.killpg(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr[-3000:]
    (sealed,) = (
        path for path in (out / "resume_checkpoints").iterdir() if path.name.startswith("step_")
    )
    manifest = json.loads((sealed / "loader_resume_manifest.json").read_text())
    assert sorted(manifest["files"]) == ["checkpoint.ckpt"]
    assert (
        manifest["files"]["checkpoint.ckpt"]["size"]
        == (sealed / "checkpoint.ckpt").stat().st_size
        > 0
    )
    rerun = forked.run(job, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert fabric_logs(out) == fabric_logs(full)  # the rerun's log appends to the first run's


def test_fabric_a_background_write_that_fails_is_a_failed_save(tmp_path: Path) -> None:
    """One device, the checkpoint directory a tmpfs filled after step 4, then SIGTERM: the write
    fails in the writer's thread; nothing is sealed, and the job exits 74 naming the cause."""
    out = tmp_path / "job"
    with tmpfs(out / "resume_checkpoints", "1m"):
        done = forked.run(
            [
                sys.executable,
                str(FABRIC_CHILD),
                str(out),
                "--async-io",
                "0.5",
                "--fill-disk-at",
                "4",
                "--signal-at",
                "4",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == FAILED_SAVE_EXIT_CODE, done.stderr[-3000:]
        assert "could NOT be written" in done.stderr and "no space left on device" in done.stderr
        assert "Traceback" not in done.stderr
        # nothing sealed
        assert [path.name for path in (out / "resume_checkpoints").iterdir()] == ["filler"]
