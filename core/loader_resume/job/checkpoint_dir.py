"""One job per checkpoint directory, and a directory that cannot be written refused at start.

``claim`` (every process of a job calls it; the main process acts): the directory is created if
needed and locked for this process's lifetime with a record lock on ``.loader_resume.lock``: an
open-file-description lock (Linux's ``F_OFD_SETLK``; elsewhere ``fcntl.lockf``). The kernel drops it
when its process ends, however it ends (a killed job never blocks its restart); other code of the
process reading the file (an upload of the directory) leaves it held, and a forked process (a
DataLoader worker) closes its copy at once, so it does not keep the lock past its parent. The holder
writes who it is (host, pid, start time, command) into that file, so a second job on the same
directory is refused with an error naming the first; the file is removed when the job lets go (at
its exit too, unless it is killed: a file left behind blocks nothing). A directory that cannot be
written fails there, naming it and the cause. Leftovers of writes interrupted in an earlier job
(``.NAME.tmp-TOKEN``, see ``loader_resume.job.checkpoint.temporary_name``) are deleted once the lock
is held (no other writer can be using them). What an earlier job left (its lock file, as a job
killed leaves it, and those leftovers) is kept as ``DirectoryLock.traces``, for
``loader_resume.job.fresh_start``.

``newest_usable``: an automatic resume skips a newest checkpoint that fails verification (naming it)
and takes the one before. ``preemption_exit_code``: after a preemption checkpoint that could not be
written, the process exits with ``FAILED_SAVE_EXIT_CODE``, never with the code that tells a
scheduler it can resume.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from loader_resume.errors import CheckpointDirectoryError
from loader_resume.job.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    describe_failure,
    is_temporary,
    verify,
)
from loader_resume.job.remote_lease import RemoteLease
from loader_resume.job.storage import is_remote, local_path

__all__ = [
    "FAILED_SAVE_EXIT_CODE",
    "LOCK_FILE",
    "CheckpointDirectoryError",
    "DirectoryLock",
    "claim",
    "local_directory",
    "newest_complete",
    "newest_usable",
    "preemption_exit_code",
]

logger = logging.getLogger(__name__)

FAILED_SAVE_EXIT_CODE: Final = 74
"""Exit code after a preemption checkpoint that could not be written (``EX_IOERR`` of
``sysexits.h``): unlike 143 it does not tell a scheduler that the job can continue where it stopped
(it continues from the newest complete checkpoint, if any)."""
LOCK_FILE: Final = ".loader_resume.lock"
"""The file locked, holding who holds it (JSON: host, pid, since, command)."""
LOCK_WAIT: Final = 10.0
"""Seconds a job waits for a directory held by another process (one still exiting) before it is
refused."""
_HELD: dict[Path, DirectoryLock] = {}



class DirectoryLock:
    """This process holds ``directory`` (see the module's description); ``release`` lets go."""

    def __init__(self, directory: Path, descriptor: int) -> None:
        self.directory, self._descriptor, self._users = directory, descriptor, 1
        # NOTE: a forked child shares none of it (it must not remove the file)
        self._pid = os.getpid()
        self.traces: list[str] = []
        """What an earlier job that did not end cleanly left here, as a warning names it (empty:
        nothing)."""
        self._earlier, self._keep = b"", False

    @classmethod
    def acquire(cls, directory: Path, wait: float = LOCK_WAIT) -> DirectoryLock:
        """Hold ``directory``; ``CheckpointDirectoryError`` if it cannot be written or another
        process holds it after ``wait`` seconds. A second claim in the same process shares the first
        (one job)."""
        directory = Path(os.path.realpath(directory))
        held = _HELD.get(directory)
        if held is not None:
            held._users += 1
            return held
        deadline = time.monotonic() + wait
        while True:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                descriptor = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as error:
                raise CheckpointDirectoryError(
                    f"checkpoint directory {directory} cannot be written ({error}); "
                    "expected a writable directory (checkpoint_dir / dirpath)"
                ) from None
            try:
                _lock(descriptor)
            except OSError as error:
                os.close(descriptor)
                # NOTE: locks unsupported (NFS without lockd)
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    logger.warning(
                        "checkpoint directory %s cannot be locked (%s): a second job on it is not "
                        "refused",
                        directory,
                        error,
                    )
                    return cls(directory, -1)
                if time.monotonic() >= deadline:
                    raise CheckpointDirectoryError(
                        f"checkpoint directory {directory} is in use by another job "
                        f"({_owner(directory)}); expected one job per directory: stop that job, or "
                        "give this one another directory"
                    ) from None
                time.sleep(0.1)
                continue
            if _same_file(descriptor, directory / LOCK_FILE):
                break
            # NOTE: its holder removed it as it let go: lock the file that is there now
            os.close(descriptor)
        lock = cls(directory, descriptor)
        try:
            lock._note_earlier_owner()
            lock._write_owner()
            lock._clean_leftovers()
        except OSError as error:
            lock._close()
            raise CheckpointDirectoryError(
                f"checkpoint directory {directory} cannot be written "
                f"({describe_failure(error, directory)}); expected a writable "
                "directory (checkpoint_dir / dirpath)"
            ) from None
        _HELD[directory] = lock
        return lock

    def release(self) -> None:
        """Let go (once every claim of this process did)."""
        self._users -= 1
        if self._users == 0 and _HELD.get(self.directory) is self and os.getpid() == self._pid:
            del _HELD[self.directory]
            if self._descriptor < 0:
                return
            with contextlib.suppress(OSError):
                if not self._keep:
                    # NOTE: while locked (acquire: a waiter checks the file)
                    (self.directory / LOCK_FILE).unlink()
            self._close()

    def _close(self) -> None:
        if self._descriptor >= 0:
            with contextlib.suppress(OSError):
                os.close(self._descriptor)  # NOTE: drops the lock

    def _note_earlier_owner(self) -> None:
        """A lock file that names a holder was left by a job that ended without letting go
        (killed)."""
        # NOTE: through the locked descriptor (_write_owner)
        self._earlier = os.pread(self._descriptor, 1 << 16, 0)
        if self._earlier:
            self.traces.append(
                f"the lock file of a job that did not end cleanly ({_holder(self._earlier)})"
            )

    def keep_traces(self) -> None:
        """Leave the lock file (the earlier job's, where there was one) as it lets go: a start
        refused for the traces it found leaves them for the next start to find."""
        if self._earlier and self._descriptor >= 0:
            os.ftruncate(self._descriptor, 0)
            os.pwrite(self._descriptor, self._earlier, 0)
        self._keep = True

    def _write_owner(self) -> None:
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        data = json.dumps(owner).encode()
        # NOTE: through the locked descriptor (closing another drops the lock)
        os.ftruncate(self._descriptor, 0)
        os.pwrite(self._descriptor, data, 0)
        os.fsync(self._descriptor)

    def _clean_leftovers(self) -> None:
        for path in self.directory.iterdir():
            if is_temporary(path):
                logger.warning("deleting %s: left by a write interrupted in an earlier job", path)
                self.traces.append(f"{path.name}, a checkpoint write it never finished (deleted)")
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        path.unlink()


def local_directory(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a local path (a ``file:`` URL's path), for a front-end that writes local
    directories; a URL of another store is refused, naming it (never a local ``./s3:/...`` directory
    that only looks remote)."""
    if is_remote(directory):
        raise CheckpointDirectoryError(
            f"checkpoint directory {os.fspath(directory)}: a URL, but this front-end "
            "writes its checkpoints as local directories; expected a local path (a shared "
            "mount, for checkpoints that outlive the machine)"
        )
    return Path(local_path(directory))


def claim(directory: str | os.PathLike[str], *, main: bool, agree: Callable[[bool], bool],
          remote: bool = False) -> DirectoryLock | RemoteLease | None:
    """``DirectoryLock.acquire`` on the main process (an fsspec URL, where the front-end writes
    there (``remote``): ``RemoteLease.acquire``, ``None`` where its store cannot lock); every
    process of the job calls it (``agree``: a flag held on any process, a collective) and raises if
    the main process was refused."""
    lock: DirectoryLock | RemoteLease | None = None
    error: Exception | None = None
    if main:
        try:
            lock = (
                RemoteLease.acquire(os.fspath(directory))
                if is_remote(directory) and remote
                else DirectoryLock.acquire(local_directory(directory))
            )
        # NOTE: whatever the main process met, every process learns of it
        except Exception as refused:
            error = refused
    if agree(error is not None):
        if lock is not None:
            lock.release()
        raise error or CheckpointDirectoryError(
            f"checkpoint directory {directory}: refused on the main process (its log names why)"
        )
    return lock


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except OSError:
        return False


def _lock(descriptor: int) -> None:
    """An exclusive lock on the whole file, or ``OSError`` (``EAGAIN``/``EACCES``: another process
    holds it)."""
    if _OFD_LOCK is None:
        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # NOTE: struct flock of 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    else:
        fcntl.fcntl(
            descriptor, _OFD_LOCK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        )


_OFD_LOCK = getattr(fcntl, "F_OFD_SETLK", None) if struct.calcsize("P") == 8 else None


def _forget_in_child() -> None:
    """A forked process holds none of its parent's locks: it closes its copy of each descriptor (an
    OFD lock lives while any copy is open) and must not let go."""
    for lock in _HELD.values():
        lock._close()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _release_all() -> None:
    """At exit (``SystemExit`` after a preemption checkpoint included) every lock lets go, its file
    removed."""
    for lock in list(_HELD.values()):
        lock._users = 1
        lock.release()


def _owner(directory: Path) -> str:
    try:
        return _holder((directory / LOCK_FILE).read_bytes())
    except OSError:
        return f"its {LOCK_FILE} names no holder"


def _holder(text: bytes) -> str:
    try:
        owner = json.loads(text)
        return f"pid {owner['pid']} on {owner['host']} since {owner['since']}: {owner['command']}"
    except (ValueError, KeyError, TypeError):
        return f"its {LOCK_FILE} names no holder"


def newest_usable(checkpoints: list[Path], agree: Callable[[bool], bool]) -> Path | None:
    """The newest of ``checkpoints`` (oldest first, as ``complete_checkpoints``
    lists them) that passes ``verify`` on every process (``agree``: a collective);
    a newer one that fails is skipped with a warning naming it and why. ``None`` if there are none;
    ``CheckpointError`` if none verifies (never a silent start from scratch)."""
    newest: str | None = None
    for path in reversed(checkpoints):
        failure = None
        try:
            verify(path)
        # NOTE: every process takes part in each agreement
        except (CheckpointError, OSError) as error:
            failure = error
        if not agree(failure is not None):
            if newest is not None:
                logger.warning("resuming from %s, the newest checkpoint that verifies", path)
            return path
        reason = str(failure or f"{path}: it failed verification on another process")
        newest = newest or reason
        logger.warning("skipping checkpoint %s: %s; trying the one before it", path, reason)
    if newest is not None:
        raise CheckpointError(
            f"{newest}; and no older checkpoint in {checkpoints[0].parent} verifies either "
            "(expected at least one intact: move them away to start over)"
        )
    return None


def preemption_exit_code(
    written: str | os.PathLike[str] | None, step: int, resumable: int, continues_from: str
) -> int:
    """The exit code after the agreed preemption checkpoint at ``step`` (``written``: where it went,
    ``None`` if the write failed), logged: ``resumable`` (143) once written, else
    ``FAILED_SAVE_EXIT_CODE`` (the log says that a rerun ``continues_from``: ``newest_complete``, or
    what the framework will find)."""
    if written is not None:
        logger.warning(
            "preemption signal: checkpoint written at step %d (%s); exiting with %d",
            step,
            os.fspath(written),  # NOTE: a URL as given (a Path would make s3:// read s3:/)
            resumable,
        )
        return resumable
    logger.error(
        "preemption signal: the checkpoint at step %d could NOT be written (the error above says "
        "why); exiting with %d, not %d: a rerun continues from %s",
        step,
        FAILED_SAVE_EXIT_CODE,
        resumable,
        continues_from,
    )
    return FAILED_SAVE_EXIT_CODE


def newest_complete(directory: Path) -> str:
    """The newest complete checkpoint in ``directory``, as a log names it."""
    kept = complete_checkpoints(directory)
    return str(kept[-1]) if kept else "the start (no complete checkpoint)"
