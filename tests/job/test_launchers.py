"""Signals sent where schedulers send them: to the launcher. A one-process ``accelerate launch``
passes no signal on (it dies of a SIGTERM at once); the training process follows its death
(``loader_resume.job.launcher``) and writes the agreed checkpoint, and the same command continues
exactly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader_resume.job.launcher import silent_launcher
from support.launch import ACCELERATE_CHILD, free_port, logs, progress_of, weights
from support.reference import accelerate_run


def one_process_launch(out: Path, *args: str) -> list[str]:
    """``accelerate launch`` with one process (Accelerate's simple launcher: the script is its
    child)."""
    accelerate = Path(sys.executable).with_name("accelerate")
    return [
        str(accelerate),
        "launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(ACCELERATE_CHILD),
        str(out),
        *args,
    ]


def ended(pid: int) -> bool:
    """Whether the process ``pid`` (no child of ours: its parent died) has exited, waiting a while
    for it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            # exited, not yet reaped
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_to_a_one_process_accelerate_launch_reaches_training_and_the_same_command_continues(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM to the launcher alone, mid-epoch: the launcher ends at once (143, Accelerate's own
    behaviour), the training process writes the checkpoint at the next step boundary and exits 143;
    the rerun of the same command delivers the uninterrupted run's batches and ends with its
    weights."""
    out = tmp_path / "job"
    command = one_process_launch(out, "--sleep", "0.1")
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while progress_of(out / "progress-0") < 5:
        assert time.monotonic() < deadline and launcher.poll() is None, (
            "training never reached step 5"
        )
        time.sleep(0.02)
    training = int((out / "pid-0").read_text())
    # to the launcher's pid only, as a container runtime sends it
    launcher.send_signal(signal.SIGTERM)
    # the launcher died of it, passing nothing on
    assert launcher.wait(timeout=60) == -signal.SIGTERM
    # the training process holds the pipe until it exits
    _, stderr = launcher.communicate(timeout=120)
    assert ended(training)
    assert "checkpoint written at step" in stderr and "exiting with 143" in stderr, stderr[-3000:]
    (written,) = (out / "resume_checkpoints").iterdir()
    assert 5 <= int(written.name.split("_")[1]) < 24
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    reference = accelerate_run(tmp_path_factory, 1)
    assert logs(out) == logs(reference)  # the rerun's log appends to the first run's
    assert weights(out) == weights(reference)


def test_a_launcher_that_passes_signals_on_or_no_launcher_is_not_followed(tmp_path: Path) -> None:
    """Under ``accelerate launch`` with two processes (torch's elastic agent passes SIGTERM to every
    rank) and under a parent that is no launcher (pytest here; a shell, ``nohup``) nothing is asked
    of the kernel; under one process the launcher is named."""
    script = tmp_path / "which.py"
    # one write: ranks share stdout
    script.write_text("import os\nfrom loader_resume.job.launcher import silent_launcher\n"
                      "os.write(1, f'launcher: {silent_launcher()}\\n'.encode())\n")
    assert silent_launcher() is None
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    common = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    two = subprocess.run(
        [
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            *common,
            "--main_process_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.stdout.count("launcher: None") == 2, two.stderr[-3000:]
    one = subprocess.run(
        [accelerate, "launch", "--num_processes", "1", *common, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f" {accelerate} launch --num_processes 1 " in one.stdout, one.stderr[-3000:]
