"""The README's main job runs as documented and proves its own claim (exit 0 only if exact); the
examples no front-end page runs (those run as copied from their pages: test_docs_runnable.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from support import forked

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_digits_example_resumes_exactly_in_fresh_processes() -> None:
    done = forked.run(
        [
            sys.executable,
            str(EXAMPLES / "digits_resume.py"),
            "--workers",
            "0",
            "--signal-after",
            "25",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical ids and noise: yes; final weights identical: yes" in done.stdout
    assert (
        "plain DataLoader + skipping seen batches: diverges at the first step after resume"
        in done.stdout
    )


def _digest(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("final weights digest: ")]
    assert lines, output[-3000:]
    return lines[-1].split(": ")[1]


def interrupted_and_rerun(script: str, directory: str, tmp_path: Path, *settings: str,
                          stopped: Callable[[], None] = lambda: None) -> tuple[str, str]:
    """(uninterrupted stdout, rerun stdout): a run of ``script`` (with ``settings``) SIGTERMed at
    its "epoch 0 step 20" line (mid-epoch 0) must exit 143 without finishing (then ``stopped()``
    checks what it left); the same command again must finish."""
    uninterrupted = forked.run([sys.executable, script, *settings, f"{directory}={tmp_path / 'a'}"],
                               capture_output=True, text=True, timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    command = [sys.executable, script, *settings, f"{directory}={tmp_path / 'b'}"]
    first = forked.popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert first.stdout is not None
    for line in first.stdout:  # training is under way, mid-epoch 0
        if line.startswith("epoch 0 step 20 "):
            os.kill(first.pid, signal.SIGTERM)
            break
    rest = first.communicate(timeout=120)[0]
    assert first.returncode == 143 and "final weights digest" not in rest
    stopped()
    rerun = forked.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    return uninterrupted.stdout, rerun.stdout


def test_lightning_example_config_typo_fails_clearly(tmp_path: Path) -> None:
    done = forked.run(
        [sys.executable, str(EXAMPLES / "lightning_digits.py"), "trainer.max_epoch=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "max_epoch" in done.stderr


def test_demo_command_sigterms_resumes_and_reports_exactness() -> None:
    cli = Path(sys.executable).parent / "loader-resume"
    done = forked.run([str(cli), "demo", "--workers", "0", "--signal-after", "20"],
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SIGTERM during step 20" in done.stdout and "step 1\n" not in done.stdout
    assert "identical ids and noise: yes; final weights identical: yes" in done.stdout
    assert "plain DataLoader + skipping seen batches: diverges at" in done.stdout


def test_fabric_example_typo_fails_clearly() -> None:
    typo = forked.run(
        [sys.executable, str(EXAMPLES / "fabric_digits.py"), "epoch=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert typo.returncode != 0 and "unknown setting 'epoch=1'" in typo.stderr


def test_mixture_example_interrupted_by_sigterm_and_rerun_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    """SIGTERM at step 20: after the schedule's change of step 15 (in the checkpoint), before that
    of step 90 (made again by the rerun, at the same step). Two epochs of 50 steps (not the default
    three): the rerun goes on into epoch 1 and past step 90 to its end at step 100."""
    uninterrupted, rerun = interrupted_and_rerun(
        str(EXAMPLES / "mixture_digits.py"), "project_dir", tmp_path, "epochs=2"
    )
    assert "resumed from" in rerun and "epoch 0 step 20 " not in rerun
    assert "step 100 loss" in rerun and "'high': 0.6" in rerun
    assert _digest(rerun) == _digest(uninterrupted)
