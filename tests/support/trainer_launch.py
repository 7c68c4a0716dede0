"""Launching ``tests/children/transformers_child.py`` (the transformers Trainer child): one process,
``torchrun`` or ``accelerate launch``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from support import forked
from support.launch import CHILDREN, TORCHRUN, free_port

CHILD = CHILDREN / "transformers_child.py"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
ITEMS = 30


def command(out: Path, processes: int, *args: str, launcher: str = "torchrun") -> list[str]:
    if processes == 1:
        launch = [sys.executable, str(CHILD)]
    elif launcher == "torchrun":
        launch = [
            TORCHRUN,
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(free_port()),
            str(CHILD),
        ]
    else:
        launch = [
            ACCELERATE,
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            str(CHILD),
        ]
    return [*launch, str(out), "--processes", str(processes), *args]


# NOTE: faulthandler prints each thread's Python stack if a process aborts
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1"}


def run(out: Path, processes: int, *args: str, launcher: str = "torchrun", expect: int = 0,
        env: dict[str, str] | None = None) -> str:
    """The Trainer child on ``processes`` processes (``env``: variables added to ``ENV``); its
    stderr. A launcher reports a rank's failure with its own exit code and the rank's in its
    report."""
    done = forked.run(
        command(out, processes, *args, launcher=launcher),
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, **(env or {})},
    )
    report = f"{args}: exit {done.returncode}\n{done.stderr[-6000:]}"
    if processes > 1 and expect != 0:
        assert done.returncode != 0 and f"exitcode  : {expect}" in done.stderr, report
    else:
        assert done.returncode == expect, report
    return done.stderr
