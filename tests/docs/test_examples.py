"""The README's main job runs as documented and proves its own claim (exit 0 only if exact)."""

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


ONE_EPOCH = {
    "lightning": ["trainer.max_epochs=1"],
    "accelerate": ["epochs=1"],
    "fabric": ["epochs=1"],
}
"""One epoch of 57 steps (not the default three) for the SIGTERM-and-rerun tests: the signal at step
20 is still mid-epoch and the rerun still finishes the epoch from the checkpoint; resuming into a
later epoch is the mixture example's test (and each front door's own tests')."""


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


def test_lightning_example_interrupted_by_sigterm_and_rerun_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    def stopped() -> None:
        assert (tmp_path / "b" / "preempted.ckpt").exists()

    uninterrupted, rerun = interrupted_and_rerun(
        str(EXAMPLES / "lightning_digits.py"),
        "trainer.default_root_dir",
        tmp_path,
        *ONE_EPOCH["lightning"],
        stopped=stopped,
    )
    assert "epoch 0 step 0 " not in rerun  # it continued, it did not start over
    assert _digest(rerun) == _digest(uninterrupted)


def test_lightning_example_config_typo_fails_clearly(tmp_path: Path) -> None:
    done = forked.run(
        [sys.executable, str(EXAMPLES / "lightning_digits.py"), "trainer.max_epoch=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "max_epoch" in done.stderr


def test_lightning_example_runs_on_two_processes(tmp_path: Path) -> None:
    done = forked.run([sys.executable, str(EXAMPLES / "lightning_digits.py"), "--devices", "2",
                       "trainer.max_epochs=1", f"trainer.default_root_dir={tmp_path}"],
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        _digest(done.stdout)
        and "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stderr
    )


def test_demo_command_sigterms_resumes_and_reports_exactness() -> None:
    cli = Path(sys.executable).parent / "loader-resume"
    done = forked.run([str(cli), "demo", "--workers", "0", "--signal-after", "20"],
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SIGTERM during step 20" in done.stdout and "step 1\n" not in done.stdout
    assert "identical ids and noise: yes; final weights identical: yes" in done.stdout
    assert "plain DataLoader + skipping seen batches: diverges at" in done.stdout


def test_accelerate_example_interrupted_by_sigterm_and_rerun_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    uninterrupted, rerun = interrupted_and_rerun(
        str(EXAMPLES / "accelerate_digits.py"), "project_dir", tmp_path, *ONE_EPOCH["accelerate"]
    )
    assert "resumed from" in rerun and "epoch 0 step 20 " not in rerun  # it continued
    assert _digest(rerun) == _digest(uninterrupted)


def test_accelerate_example_runs_on_two_processes(tmp_path: Path) -> None:
    accelerate = Path(sys.executable).with_name("accelerate")
    done = forked.run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "0",
            str(EXAMPLES / "accelerate_digits.py"),
            "--cpu",
            "epochs=1",
            f"project_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training on 2 process(es)" in done.stdout and _digest(done.stdout)


def test_fabric_example_interrupted_by_sigterm_and_rerun_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    # one sealed checkpoint, at a step boundary after the signal (step 20 or a later one)
    def stopped() -> None:
        (written,) = (tmp_path / "b").iterdir()
        assert written.name.startswith("step_") and int(written.name[5:]) >= 20
        assert (written / "loader_resume_manifest.json").is_file()

    uninterrupted, rerun = interrupted_and_rerun(
        str(EXAMPLES / "fabric_digits.py"),
        "checkpoint_dir",
        tmp_path,
        *ONE_EPOCH["fabric"],
        stopped=stopped,
    )
    assert "resumed from" in rerun and "epoch 0 step 20 " not in rerun  # it continued
    assert _digest(rerun) == _digest(uninterrupted)


def test_fabric_example_typo_fails_clearly() -> None:
    typo = forked.run(
        [sys.executable, str(EXAMPLES / "fabric_digits.py"), "epoch=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert typo.returncode != 0 and "unknown setting 'epoch=1'" in typo.stderr


def test_transformers_example_interrupted_by_sigterm_and_rerun_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    """SIGTERM at step 20 of 60, mid-epoch 0 (no checkpoint due before step 50): the job checkpoints
    at the next optimizer step and exits 143; the same command again continues from there, not from
    the beginning."""
    def stopped() -> None:
        names = [p.name for p in (tmp_path / "b").iterdir()]
        assert (
            len(names) == 1 and names[0].startswith("checkpoint-") and 20 <= int(names[0][11:]) < 50
        ), names

    uninterrupted, rerun = interrupted_and_rerun(
        str(EXAMPLES / "transformers_digits.py"), "output_dir", tmp_path, stopped=stopped
    )
    assert "epoch 0 step 10 " in uninterrupted and "epoch 0 step 10 " not in rerun  # it continued
    assert _digest(rerun) == _digest(uninterrupted)


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
