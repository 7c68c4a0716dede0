"""A plain FSDP2 + ``torch.distributed.checkpoint`` loop (``examples/fsdp2_dcp.py``) under ``torchrun``, two CPU
processes (gloo): SIGTERM to the whole launch mid-epoch, the same command again, and the uninterrupted run's
batches on every rank (ids and values, one log line per step) and its final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from loader_resume.checkpoint import complete_checkpoints
from support.launch import ROOT, TORCHRUN, free_port

EXAMPLE = ROOT / "examples" / "fsdp2_dcp.py"


def command(out: Path) -> list[str]:
    return [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), str(EXAMPLE), "--out", str(out),
            "--batch-log", str(out), "--workers", "2", "--every", "100"]


def rows(out: Path) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(out.glob("log-*.jsonl"))]


def digest(stdout: str) -> str:
    found = [line.split(": ")[1] for line in stdout.splitlines() if line.startswith("final weights digest: ")]
    assert len(found) == 1, stdout[-3000:]
    return found[0]


def test_sigterm_to_the_launch_and_the_same_command_continue_with_the_uninterrupted_runs_batches(
    tmp_path: Path
) -> None:
    full = tmp_path / "full"
    full.mkdir()
    done = subprocess.run(command(full), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = digest(done.stdout)
    out = tmp_path / "cut"
    out.mkdir()
    first = subprocess.Popen(command(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out / "log-0.jsonl").is_file() or len((out / "log-0.jsonl").read_text().splitlines()) < 5:
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 5"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=120)
    assert stdout.count("exiting with 143") == 2 and "final weights digest" not in stdout, stderr[-3000:]
    sealed = complete_checkpoints(out / "checkpoints")
    assert len(sealed) == 1 and 5 <= int(sealed[0].name[5:]) < 15, sealed  # mid-epoch 0 (15 steps an epoch)
    rerun = subprocess.run(command(out), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rows(out) == rows(full) and digest(rerun.stdout) == reference
