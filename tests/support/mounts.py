"""Real storage faults for the tests (they run as root, as CI does): a small tmpfs that fills up, a
read-only bind mount (each undone when its ``with`` block ends), and :func:`fill`, which the
children call to fill one."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    assert done.returncode == 0, (
        f"mount {' '.join(args)}: {done.stderr} (the storage-fault tests need root)"
    )


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` (a directory) seen read-only through a bind mount over itself: files opened before
    stay as they were opened, every new write fails with ``EROFS``."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path))
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path) -> None:
    """Write zeros into ``path`` until its file system is full."""
    with path.open("wb", buffering=0) as file:
        try:
            while True:
                file.write(bytes(1 << 16))
        except OSError:
            pass
