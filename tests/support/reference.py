"""Uninterrupted reference runs, made once per test session and shared by every test that compares
with one.

Several modules compare with the same uninterrupted run of a child script (the same command, the
same arguments). Under pytest-xdist each worker is a process of its own, so a session fixture alone
would still make the run once per worker: here the run goes to a directory all workers share (the
session's base temporary directory), under a file lock, so the first test that needs it makes it and
any other (on any worker) waits for it and reads it. A run that failed is made again by the next
test that asks (and fails there too).

Reference directories are read, never written: a test that changes files copies the directory first.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support import forked

from .launch import CHILDREN, run

__all__ = ["accelerate_run", "child_run", "shared_run"]


def _root(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    root.mkdir(exist_ok=True)
    return root


def shared_run(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The directory of the run ``name`` (a file name: it says what the run is), made by
    ``make(directory)`` the first time any test of this session asks for it."""
    root = _root(factory)
    out, done = root / name, root / f"{name}.done"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            if out.exists():  # an attempt that failed
                shutil.rmtree(out)
            out.mkdir()
            make(out)
            done.touch()
    return out


def _name(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9=.-]+", "_", "-".join(parts))


def child_run(factory: pytest.TempPathFactory, child: str, *args: str) -> Path:
    """``python tests/CHILD OUT *args`` (it must exit 0), made once per session."""
    def make(out: Path) -> None:
        done = forked.run(
            [sys.executable, str(CHILDREN / child), str(out), *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, (
            f"{child} {args}: exit {done.returncode}\n{done.stderr[-3000:]}"
        )

    return shared_run(factory, _name(Path(child).stem, *args), make)


def accelerate_run(factory: pytest.TempPathFactory, processes: int, *args: str) -> Path:
    """tests/children/accelerate_child.py on ``processes`` processes (``accelerate launch`` for more
    than one), made once per session."""
    return shared_run(
        factory, _name("accelerate", str(processes), *args), lambda out: run(out, processes, *args)
    )
