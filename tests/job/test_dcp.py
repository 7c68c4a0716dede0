"""A plain FSDP2 + ``torch.distributed.checkpoint`` loop (``examples/fsdp2_dcp.py``) under
``torchrun``, two CPU processes (gloo): SIGTERM to the whole launch mid-epoch, the same command
again, and the uninterrupted run's batches on every rank (ids and values, one log line per step) and
its final weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from loader_resume.job.checkpoint import MANIFEST, complete_checkpoints
from support import forked
from support.launch import ROOT, TORCHRUN, free_port
from support.s3 import bucket, objects, s3_server

EXAMPLE = ROOT / "examples" / "fsdp2_dcp.py"


def command(out: Path, *args: str) -> list[str]:
    return [
        TORCHRUN,
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(EXAMPLE),
        "--out",
        str(out),
        "--batch-log",
        str(out),
        "--workers",
        "2",
        "--every",
        "100",
        *args,
    ]


def rows(out: Path) -> list[list[dict[str, Any]]]:
    return [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob("log-*.jsonl"))
    ]


def digest(stdout: str) -> str:
    found = [
        line.split(": ")[1]
        for line in stdout.splitlines()
        if line.startswith("final weights digest: ")
    ]
    assert len(found) == 1, stdout[-3000:]
    return found[0]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted run: its directory (batch logs) and final weights' digest."""
    out = tmp_path_factory.mktemp("full")
    done = forked.run(command(out), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, digest(done.stdout)


def stopped(out: Path, *args: str, kept: int = 1) -> Path:
    """The command SIGTERMed (the whole launch) after step 5, mid-epoch 0: every rank exits 143; the
    newest of the ``kept`` sealed checkpoints it leaves (the preemption's)."""
    out.mkdir()
    first = forked.popen(
        command(out, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while (
        not (out / "log-0.jsonl").is_file()
        or len((out / "log-0.jsonl").read_text().splitlines()) < 5
    ):
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 5"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=120)
    assert stdout.count("exiting with 143") == 2 and "final weights digest" not in stdout, stderr[
        -3000:
    ]
    sealed = complete_checkpoints(out / "checkpoints")
    # mid-epoch 0 (15 steps an epoch)
    assert len(sealed) == kept and 5 <= int(sealed[-1].name[5:]) < 15, sealed
    assert f"checkpoint at step {int(sealed[-1].name[5:])}; exiting with 143" in stdout
    return sealed[-1]


def test_sigterm_to_the_launch_and_the_same_command_continue_with_the_uninterrupted_runs_batches(
    full: tuple[Path, str], tmp_path: Path
) -> None:
    out = tmp_path / "cut"
    stopped(out)
    rerun = forked.run(command(out), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rows(out) == rows(full[0]) and digest(rerun.stdout) == full[1]


def test_async_save_sigterm_during_a_save_and_each_checkpoint_holds_one_steps_model_and_data(
    full: tuple[Path, str], tmp_path: Path
) -> None:
    """``--async-save --every 1``: every step starts a write that runs while the next step trains,
    so the SIGTERM always finds one in flight. The job finishes and seals it, writes the preemption
    checkpoint whole, and only then exits 143: both are sealed. The same command continues exactly
    from the newest; from the one before it (written in the background while a step trained on: its
    loader position must be its model's step) it does too."""
    out, before = tmp_path / "cut", tmp_path / "before"
    newest = stopped(out, "--async-save", "--every", "1", kept=2)
    shutil.copytree(out, before)
    shutil.rmtree(before / "checkpoints" / newest.name)
    for job in (out, before):
        rerun = forked.run(
            command(job, "--async-save", "--every", "1"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert digest(rerun.stdout) == full[1]
    assert rows(out) == rows(full[0])  # the rerun's log appends to the first run's
    # the first run's last step; the older checkpoint's rerun trains it again
    step = int(newest.name[5:])
    assert rows(before) == [ranks[:step] + ranks[step - 1:] for ranks in rows(full[0])]


def test_with_a_remote_copy_a_rerun_on_a_new_disk_continues_from_the_bucket(
    full: tuple[Path, str], tmp_path: Path
) -> None:
    """``--remote s3://...`` against a real S3 API server on loopback: the sealed DCP directory is
    uploaded, its manifest last; with the local checkpoints deleted (a new machine), the same
    command downloads it and continues with the uninterrupted run's batches and weights."""
    out = tmp_path / "cut"
    with s3_server() as env:
        bucket("dcp")
        sealed = stopped(out, "--remote", "s3://dcp/job")
        assert f"s3://dcp/job/{sealed.name}/{MANIFEST}" in objects("s3://dcp/job")
        shutil.rmtree(out / "checkpoints")
        written = [len(each) for each in rows(out)]
        rerun = forked.run(command(out, "--remote", "s3://dcp/job"), capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    step = int(sealed.name[5:])  # one log line per step, from step 1
    for rank, (each, uninterrupted) in enumerate(zip(rows(out), rows(full[0]), strict=True)):
        assert each[written[rank]]["step"] == step + 1  # it continued from the bucket's copy
        assert each[written[rank]:] == uninterrupted[step:]
    assert digest(rerun.stdout) == full[1]
