"""The tests' forked processes (tests/support/forked.py) behave as ``python SCRIPT`` does: each case
runs the same script both ways and compares what a test can see — standard streams, exit status, a
signal's death, the working directory, the environment, the process group, atexit handlers, the
RNGs' seeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import forked

SCRIPT = """\
import atexit, os, sys, time
import numpy, torch
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:], "cwd", os.getcwd(), "FOO", os.environ.get("FOO"), flush=True)
print("own group", os.getpgrp() == os.getpid(),
      "main file", sys.modules["__main__"].__file__ == sys.argv[0])
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(sys.argv[0])))
print("seeds", torch.initial_seed(), numpy.random.get_state()[1][0], file=sys.stderr)
what = sys.argv[1]
if what == "raise":
    raise ValueError("from the script")
if what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
sys.exit(int(what))
"""


def both(
    script: Path, *args: str, **kwargs: object
) -> tuple[subprocess.CompletedProcess[str], ...]:
    command = [sys.executable, str(script), *args]
    real = subprocess.run(  # type: ignore[call-overload]
        command, capture_output=True, text=True, timeout=120, **kwargs
    )
    fork = forked.run(command, capture_output=True, text=True, timeout=120, **kwargs)
    process = forked.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)
    # really forked
    assert isinstance(process, forked.Forked) and process.wait(timeout=120) == real.returncode
    return real, fork


def seeds(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("seeds"))


@pytest.mark.parametrize("args", [("0",), ("3",), ("raise",)])
def test_streams_exit_status_environment_and_atexit_are_a_fresh_interpreters(
    tmp_path: Path, args: tuple[str]
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real, fork = both(
        script, *args, cwd=elsewhere, env={**os.environ, "FOO": "bar"}, start_new_session=True
    )
    assert fork.returncode == real.returncode == {"0": 0, "3": 3, "raise": 1}[args[0]]
    assert (
        fork.stdout == real.stdout and "FOO bar" in real.stdout and "own group True" in real.stdout
    )
    assert [line for line in fork.stderr.splitlines() if not line.startswith("seeds")] == [
        line for line in real.stderr.splitlines() if not line.startswith("seeds")]
    # each process seeds from the OS
    assert seeds(fork.stderr) != seeds(both(script, *args)[1].stderr)


def test_a_signal_to_the_group_ends_it_as_it_ends_a_fresh_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    codes = []
    for start in (subprocess.Popen, forked.popen):
        process = start(
            [sys.executable, str(script), "sleep"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert process.stdout is not None
        while "sleeping" not in process.stdout.readline():
            time.sleep(0.01)
        assert process.poll() is None
        os.killpg(process.pid, signal.SIGTERM)
        codes.append(process.wait(timeout=60))
        process.stdout.close()
    assert codes == [-signal.SIGTERM, -signal.SIGTERM]


def test_a_timeout_kills_it_and_raises(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, str(script), "sleep"], capture_output=True, timeout=3)


def test_what_the_interpreter_reads_at_its_start_is_not_forked(tmp_path: Path) -> None:
    assert not forked.forkable([sys.executable, "-c", "pass"], None)
    assert not forked.forkable(
        [sys.executable, str(tmp_path / "script.py")], {**os.environ, "PYTHONHASHSEED": "1"}
    )
    assert forked.forkable(
        [sys.executable, str(tmp_path / "script.py")], {**os.environ, "PYTHONFAULTHANDLER": "1"}
    )
