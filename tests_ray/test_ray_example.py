"""The Ray Train page's program, copied from the built page (``ray_digits.py``) into an empty
directory and run with the page's command, as a user runs it: interrupted with Ctrl-C (SIGINT)
mid-run, then the same command again; it ends with the uninterrupted run's digest, and every step's
batch is the uninterrupted run's."""

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.pages import runnable

pytestmark = pytest.mark.timeout(900)
# the package as installed, nothing of the repository's on the path
ENV = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def command(out: Path) -> list[str]:
    """The page's command, in ``out`` (where the page's files are saved), with what the test
    watches added (the program's own options): a checkpoint every 4 steps, each step's batch
    logged, steps of 0.1 s, the audit."""
    program = runnable("ray/")
    program.save(out)
    first, again = program.commands
    assert first.words == again.words and first.words[:2] == ["python", "ray_digits.py"], (
        "the page runs ray_digits.py, then the same command again"
    )
    return [sys.executable, *first.words[1:], "--every", "4", "--batch-log", str(out),
            "--sleep", "0.1", "--audit", str(out / "audit")]


def batches(out: Path) -> dict[tuple[int, int], Any]:
    rows = {}
    for rank in range(2):
        for line in (out / f"log-{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            # a replayed step: the last
            rows[rank, row["step"]] = [row["epoch"], row["ids"], row["batch"]]
    return rows


def test_interrupted_with_ctrl_c_and_run_again_it_ends_with_the_uninterrupted_digest(
    tmp_path: Path,
) -> None:
    full = subprocess.run(
        command(tmp_path / "full"), capture_output=True, text=True, timeout=600, env=ENV,
        cwd=tmp_path / "full",
    )
    assert full.returncode == 0, full.stderr[-4000:]
    log = tmp_path / "cut" / "log-0.jsonl"
    first = subprocess.Popen(
        command(tmp_path / "cut"),
        cwd=tmp_path / "cut",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    deadline = time.monotonic() + 300
    # mid second epoch (15 steps an epoch)
    while not log.exists() or log.read_text().count("\n") < 14:
        assert time.monotonic() < deadline and first.poll() is None, (
            "training never reached step 14"
        )
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode != 0 and "digest" not in stderr, stderr[-4000:]
    again = subprocess.run(
        command(tmp_path / "cut"), capture_output=True, text=True, timeout=600, env=ENV,
        cwd=tmp_path / "cut",
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    assert full.stdout.splitlines()[-1].startswith("final weights digest: ")
    assert batches(tmp_path / "cut") == batches(tmp_path / "full")
    # the job's own audit (ResumableDataLoader(audit=...)) agrees: every sample once per epoch, one
    # resume
    for out, attempts in (("full", 1), ("cut", 2)):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from loader_resume.tools.cli import main; "
                "sys.exit(main(sys.argv[1:]))",
                "audit",
                str(tmp_path / out / "audit"),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=ENV,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        (report,) = json.loads(done.stdout)
        assert [(row["epoch"], row["delivered"], row["status"]) for row in report["epochs"]] == [
            (0, 1797, "ok"), (1, 1797, "ok")]
        assert len(report["attempts"]) == attempts
        assert [a["resumed"] == "(fresh)" for a in report["attempts"]] == [True] + [False] * (
            attempts - 1
        )
