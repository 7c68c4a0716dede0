"""Launchers of real processes shared by the tests: gloo jobs, ``accelerate launch``, torchrun."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from support import forked

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
CHILDREN = TESTS / "children"
"""The scripts the tests run as real processes (``python CHILD ...``)."""
ACCELERATE_CHILD = CHILDREN / "accelerate_child.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
BATCH_KEYS = ("step", "epoch", "ids", "batch")
"""The fields of a batch-log row that an audit compares (``--batch-log`` of the examples and child
scripts)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(script: Path, mode: str, out: Path, workers: int = 0, args: Sequence[str] = ()) -> None:
    """Run ``script MODE OUT *args`` as a real 2-process gloo job on loopback; both ranks must exit
    0."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORKERS": str(workers)}
        procs.append(forked.popen([sys.executable, str(script), mode, str(out), *args], env=env))
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0], f"{mode}: exit codes {codes}"


def forked_ranks(target: Callable[..., None], *args: Any, ranks: int = 2) -> None:
    """``target(rank, *args)`` in ``ranks`` forked processes (each sets up its own process group);
    every one must exit 0 within 60 s — a rank left waiting in a collective fails the test instead
    of hanging it."""
    import multiprocessing

    processes = [multiprocessing.get_context("fork").Process(target=target, args=(rank, *args))
                 for rank in range(ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
        if process.exitcode is None:
            process.kill()
        assert process.exitcode == 0, "a rank hung or died"


def command(out: Path, processes: int, *args: str) -> list[str]:
    if processes == 1:
        return [sys.executable, str(ACCELERATE_CHILD), str(out), *args]
    port = free_port()
    accelerate = Path(sys.executable).with_name("accelerate")
    return [
        str(accelerate),
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
        str(port),
        str(ACCELERATE_CHILD),
        str(out),
        "--processes",
        str(processes),
        *args,
    ]


def run(
    out: Path, processes: int, *args: str, expect: int = 0, env: dict[str, str] | None = None
) -> str:
    """Run the Accelerate child (``env``: variables added to this process's environment); its
    stderr."""
    done = forked.run(command(out, processes, *args), capture_output=True, text=True, timeout=300,
                      env=None if env is None else {**os.environ, **env})
    failed = expect != 0 and processes > 1  # the launcher reports a failed child with its own code
    assert (done.returncode != 0 if failed else done.returncode == expect), done.stderr[-3000:]
    if failed:
        assert f"exitcode  : {expect}" in done.stderr, done.stderr[-3000:]
    return done.stderr


def logs(out: Path) -> list[list[dict[str, Any]]]:
    return [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob("log-*.jsonl"))
    ]


def weights(out: Path) -> list[str]:
    return [path.read_text() for path in sorted(out.glob("weights-*.txt"))]


def trained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if "ids" in row]


def progress_of(path: Path) -> int:
    """The step a child script last wrote to ``path`` (-1 before the first): read once, since the
    child rewrites the file while the test polls it (two reads can see two different contents)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return -1
    return int(text) if text else -1
