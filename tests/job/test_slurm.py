"""SLURM's requeue: real jobs of every front door in a process that sees SLURM's variables (one
task, as ``sbatch`` starts it), with a stand-in ``scontrol`` first on ``PATH`` (SLURM itself cannot
run here) that records how it was called and exits with ``SCONTROL_EXIT``.

Lightning's ``SLURMEnvironment`` (``auto_requeue`` on, its default under SLURM) answers SIGUSR1 by
checkpointing and running ``scontrol requeue JOB``; with our callback the checkpoint is ours
(agreed, at a step boundary) and the requeue still happens, after it is written (the requeued fit's
exact continuation: ``tests/frontdoors/test_lightning.py``, ``test_under_slurm_sigusr1...``).
SIGTERM (``scancel``, the time limit) checkpoints without a requeue. Fabric, Accelerate and the
transformers Trainer requeue the same way when asked (``slurm_requeue``).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from loader_resume.job.slurm import slurm_job_id
from support import forked
from support.launch import CHILDREN

CHILD = CHILDREN / "lightning_child.py"


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\nexit "${SCONTROL_EXIT:-0}"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLURM_", "TORCHELASTIC"))
    }
    return {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
        **extra,
    }


def fit(out: Path, env: dict[str, str], *args: str, expect: int = 0) -> str:
    out.mkdir(parents=True, exist_ok=True)
    done = forked.run(
        [sys.executable, str(CHILD), str(out), "--batch-log", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == expect, done.stderr[-4000:]
    return done.stderr


def batches(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "log-0.jsonl").read_text().splitlines()]


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def test_sigterm_checkpoints_without_a_requeue(tmp_path: Path) -> None:
    stderr = fit(tmp_path / "run", slurm_env(tmp_path), "--signal-at", "7", expect=143)
    assert "checkpoint written at step 7" in stderr and calls(tmp_path) == []


def test_a_failed_requeue_of_an_array_task_is_logged_with_its_exit_code(tmp_path: Path) -> None:
    env = slurm_env(tmp_path, SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="3", SCONTROL_EXIT="1")
    stderr = fit(tmp_path / "run", env, "--signal-at", "7", "--signal-name", "SIGUSR1", expect=143)
    assert calls(tmp_path) == ["requeue 100_3"]
    assert "requeuing SLURM job 100_3 failed: scontrol exited with 1" in stderr
    assert (tmp_path / "run" / "preempted.ckpt").is_file()  # written all the same


def test_slurm_job_ids() -> None:
    assert slurm_job_id({"SLURM_JOB_ID": "12"}) == "12"
    assert (
        slurm_job_id({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"})
        == "10_2"
    )
    assert slurm_job_id({}) is None
    with pytest.raises(ValueError, match=r"SLURM job id '12; rm' .*expected digits"):
        slurm_job_id({"SLURM_JOB_ID": "12; rm"})


# (child, its options for a requeue on SIGUSR1 after micro-batch 5, options of every run)
FRONT_DOORS = {
    "fabric": (
        "fabric_child.py",
        ["--slurm-requeue", "--signal-name", "SIGUSR1", "--signal-at", "5"],
        [],
    ),
    "accelerate": (
        "accelerate_child.py",
        ["--signal-name", "SIGUSR1", "--signal-at", "5"],
        ["slurm_requeue=true"],
    ),
    "transformers": (
        "transformers_child.py",
        ["--slurm-requeue", "--signal-name", "SIGUSR1", "--signal-at", "5"],
        ["--resume", "true"],
    ),
}


def job(front_door: str, out: Path, env: dict[str, str], *args: str, expect: int = 0) -> str:
    child, _, every_run = FRONT_DOORS[front_door]
    done = forked.run([sys.executable, str(CHILDREN / child), str(out), *args, *every_run], env=env,
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == expect, done.stderr[-4000:]
    return done.stderr


@pytest.mark.parametrize("front_door", sorted(FRONT_DOORS))
def test_asked_for_a_requeue_sigusr1_checkpoints_requeues_and_the_requeued_job_continues_exactly(
    tmp_path: Path, front_door: str
) -> None:
    env = slurm_env(tmp_path)
    job(front_door, tmp_path / "full", env)
    assert calls(tmp_path) == []
    stderr = job(front_door, tmp_path / "cut", env, *FRONT_DOORS[front_door][1], expect=143)
    assert calls(tmp_path) == ["requeue 4242"] and "requeued SLURM job 4242" in stderr, stderr[
        -3000:
    ]
    job(front_door, tmp_path / "cut", env)
    for name in ("log-0.jsonl", "weights-0.txt"):
        assert (tmp_path / "cut" / name).read_text() == (tmp_path / "full" / name).read_text(), name
    assert calls(tmp_path) == ["requeue 4242"]


def test_not_asked_for_a_requeue_sigusr1_only_checkpoints(tmp_path: Path) -> None:
    stderr = job(
        "fabric",
        tmp_path / "cut",
        slurm_env(tmp_path),
        "--signal-name",
        "SIGUSR1",
        "--signal-at",
        "5",
        expect=143,
    )
    assert calls(tmp_path) == [] and "checkpoint written at step 5" in stderr


def test_a_requeue_asked_for_outside_slurm_is_a_warning_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import signal

    from loader_resume.job.slurm import Requeue

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with caplog.at_level("WARNING", logger="loader_resume.job.slurm"):
        requeue = Requeue(True)
    assert "outside a SLURM job (no SLURM_JOB_ID): no requeue" in caplog.text
    requeue.decide(
        signal.SIGUSR1, lambda flag: pytest.fail("no agreement when there is nothing to requeue")
    )
    assert not requeue.wanted
