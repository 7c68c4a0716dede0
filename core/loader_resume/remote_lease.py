"""One job per checkpoint directory on object storage: a lease object that only one job can create.

An object store has no file locks. Where it has a conditional create — S3's ``If-None-Match: *`` (``s3fs``'s
``pipe_file(..., mode="create")``) — the job's main process creates ``DIR/.loader_resume.lease`` (who holds it, and
until when) only if no such object exists: a second job finds it and is refused, naming the first. The holder
renews the lease (a background thread, every third of its term) and removes it when it lets go, at the end of the
job or of a preemption stop. A job killed with no chance to remove it blocks nothing for ever: once its term has
passed (``LOADER_RESUME_LEASE_SECONDS``, 120 by default), the next job deletes it and creates its own — through the
same conditional create, so of two jobs taking over at once only one wins. Where a store has no conditional
create, the directory is not locked, and the job says so at start.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Final

from .storage import join, remote_filesystem

__all__ = ["LEASE_FILE", "LEASE_VARIABLE", "RemoteLease", "lease_seconds"]

logger = logging.getLogger(__name__)

LEASE_FILE: Final = ".loader_resume.lease"
LEASE_VARIABLE: Final = "LOADER_RESUME_LEASE_SECONDS"
"""The environment variable of the lease's term, in seconds (every front door; not a field of their configs)."""
_WAIT: Final = 10.0  # seconds a job waits for a lease held by another job (one still exiting) before it is refused


def lease_seconds() -> float:
    """The lease's term: ``LOADER_RESUME_LEASE_SECONDS`` (a number > 0), else 120."""
    text = os.environ.get(LEASE_VARIABLE, "120")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"LOADER_RESUME_LEASE_SECONDS={text!r}: expected a number of seconds > 0")
    return seconds


class RemoteLease:
    """This job holds the remote directory ``url`` (see the module's description); :meth:`release` lets go."""

    def __init__(self, fs: Any, path: str, url: str, term: float) -> None:
        self._fs, self._path, self.url, self._term = fs, path, url, term
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="loader-resume lease", daemon=True)
        self._renewer.start()

    @classmethod
    def acquire(cls, directory: str, wait: float = _WAIT) -> RemoteLease | None:
        """Hold the remote ``directory``; ``None`` (said in a warning) where its store has no conditional create;
        a :class:`~loader_resume.checkpoint_dir.CheckpointDirectoryError` if another job holds it after ``wait``."""
        from .checkpoint_dir import CheckpointDirectoryError

        fs, root = remote_filesystem(directory)
        if not _creates_conditionally(fs):
            logger.warning("the checkpoint directory %s is not locked: its store (%s) has no conditional create, so "
                           "a second job writing to it is not refused", directory, type(fs).__name__)
            return None
        url, path, term = join(directory, LEASE_FILE), f"{root.rstrip('/')}/{LEASE_FILE}", lease_seconds()
        deadline = time.monotonic() + wait
        while True:
            try:
                fs.pipe_file(path, _record(term), mode="create")
                return cls(fs, path, url, term)
            except FileExistsError:
                holder = _read(fs, path)
                if holder is not None and holder.get("until", 0) < time.time():
                    logger.warning("taking over %s: its lease ended at %s (a job that was killed: %s)", directory,
                                   time.strftime("%H:%M:%S", time.localtime(holder["until"])), holder.get("owner"))
                    fs.rm(path)  # NOTE: two jobs may both delete it; the conditional create lets one through
                    continue
                if time.monotonic() > deadline:
                    raise CheckpointDirectoryError(
                        f"checkpoint directory {directory} is in use by another job ({(holder or {}).get('owner')}; "
                        f"its lease {url} runs until {_until(holder)} and is renewed while that job runs); expected "
                        "one job per directory: give this job its own, or stop the other") from None
                time.sleep(1.0)

    def release(self) -> None:
        """Let go: the renewing stops and the lease object is removed (a failure to remove it is logged: it ends
        with its term)."""
        self._stop.set()
        self._renewer.join(timeout=30)
        try:
            self._fs.rm(self._path)
        except Exception as error:  # NOTE: the job's result stands; the lease ends with its term
            logger.warning("could not remove the lease %s (%s: %s): it ends with its term", self.url,
                           type(error).__name__, error)

    def _renew(self) -> None:
        while not self._stop.wait(self._term / 3):
            try:
                self._fs.pipe_file(self._path, _record(self._term))  # NOTE: only the holder writes it
            except Exception as error:
                logger.warning("could not renew the lease %s (%s: %s); trying again", self.url, type(error).__name__,
                               error)


def _creates_conditionally(fs: Any) -> bool:
    """Whether ``fs.pipe_file`` takes ``mode="create"`` (s3fs: S3's conditional write)."""
    try:
        return "mode" in inspect.signature(fs._pipe_file).parameters and type(fs).__name__ == "S3FileSystem"
    except (AttributeError, TypeError, ValueError):
        return False


def _record(term: float) -> bytes:
    owner = f"host {socket.gethostname()}, pid {os.getpid()}"
    return json.dumps({"owner": owner, "until": time.time() + term}).encode()


def _read(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        found = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return {"until": time.time() + 1}  # NOTE: gone meanwhile: try the create again
    except (ValueError, TypeError):
        return None  # NOTE: not ours to read: treated as held
    return found if isinstance(found, dict) else None


def _until(holder: dict[str, Any] | None) -> str:
    until = (holder or {}).get("until")
    return time.strftime("%H:%M:%S", time.localtime(until)) if isinstance(until, (int, float)) else "an unknown time"
