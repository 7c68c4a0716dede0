"""One job per checkpoint directory on object storage: a lease that only one job can take.

An object store has no file locks. Where it has a conditional create — S3's ``If-None-Match: *``
(``s3fs``'s ``pipe_file(..., mode="create")``) — a lease is a numbered object,
``DIR/.loader_resume.lease.N``, that says who holds the directory; the highest number is the lease
in force. The job's main process:

1. takes the directory by creating ``.1`` if there is no lease, or ``.N+1`` once lease ``.N`` has
   ended — conditionally, so of two jobs taking it at once exactly one succeeds, and nothing is ever
   deleted to take over;
2. renews its own object (every third of its term), which only it writes; its store's modification
   time shows the renewals. A renewal that finds a higher number than its own says loudly that the
   lease was lost;
3. removes its own object when it lets go (the end of the job, or of a preemption stop).

A second job that finds a lease being renewed waits a few seconds, then is refused naming the
holder. A job killed with no chance to let go blocks nothing for ever: a lease whose store time is
older than its term has ended (``LOADER_RESUME_LEASE_SECONDS``, 120 by default), and the next job
waits for that, then takes over, saying so. Where a store has no conditional create, the directory
is not locked, and the job says so at start.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, Final

from loader_resume.errors import CheckpointDirectoryError
from loader_resume.job.storage import join, remote_filesystem

__all__ = ["LEASE_FILE", "LEASE_VARIABLE", "RemoteLease", "lease_seconds"]

logger = logging.getLogger(__name__)

LEASE_FILE: Final = ".loader_resume.lease"
"""The leases' name, before their number."""
LEASE_VARIABLE: Final = "LOADER_RESUME_LEASE_SECONDS"
"""The environment variable of the lease's term, in seconds (every front-end; not a field of their
configs)."""
# seconds a job waits for a lease being renewed (its holder still exiting) before it is refused
_WAIT: Final = 10.0


def lease_seconds() -> float:
    """The lease's term: ``LOADER_RESUME_LEASE_SECONDS`` (a number > 0), else 120."""
    text = os.environ.get(LEASE_VARIABLE, "120")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{LEASE_VARIABLE}={text!r}: expected a number of seconds > 0")
    return seconds


class RemoteLease:
    """This job holds the remote directory (see the module's description); ``release`` lets go."""

    def __init__(
        self, fs: Any, root: str, directory: str, number: int, term: float, token: str
    ) -> None:
        self._fs, self._root, self.directory, self.number, self._term = (
            fs,
            root,
            directory,
            number,
            term,
        )
        self._token, self.lost = token, False
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew, name="loader-resume lease", daemon=True
        )
        self._renewer.start()

    @property
    def url(self) -> str:
        """The lease object this job holds."""
        return join(self.directory, f"{LEASE_FILE}.{self.number}")

    @classmethod
    def acquire(cls, directory: str, wait: float = _WAIT) -> RemoteLease | None:
        """Hold the remote ``directory``; ``None`` (said in a warning) where its store has no
        conditional create; ``CheckpointDirectoryError`` if another job holds it (renewing it after
        ``wait`` seconds), or if the store cannot be reached (naming the URL and the cause)."""
        fs, root = remote_filesystem(directory)
        root = root.rstrip("/")
        if not _creates_conditionally(fs):
            logger.warning(
                "the checkpoint directory %s is not locked: its store (%s) has no conditional "
                "create, so a second job writing to it is not refused",
                directory,
                type(fs).__name__,
            )
            return None
        term, token = lease_seconds(), uuid.uuid4().hex
        deadline, first = time.monotonic() + wait, None
        while True:
            try:
                leases = _leases(fs, root)
                number = 1
                if leases:
                    number, modified = leases[-1]
                    # NOTE: in force: a silent one is waited out, not a renewed one
                    if modified + term > time.time():
                        first = first or (number, modified)
                        if (number, modified) != first and time.monotonic() > deadline:
                            holder = _read(fs, f"{root}/{LEASE_FILE}.{number}")
                            raise CheckpointDirectoryError(
                                f"checkpoint directory {directory} is in use by another job "
                                f"({holder}; its lease {LEASE_FILE}.{number} is renewed while that "
                                "job runs); expected one job per directory: give this job its "
                                "own, or stop the other"
                            )
                        time.sleep(min(1.0, term / 6))
                        continue
                    logger.warning(
                        "taking over %s: its lease %s.%d ended %.0f s ago (its job was killed: %s)",
                        directory,
                        LEASE_FILE,
                        number,
                        time.time() - modified - term,
                        _read(fs, f"{root}/{LEASE_FILE}.{number}"),
                    )
                    number += 1
                fs.pipe_file(f"{root}/{LEASE_FILE}.{number}", _record(token), mode="create")
            except FileExistsError:
                continue  # NOTE: another job took this number first: look again
            except CheckpointDirectoryError:
                raise
            except Exception as error:
                raise CheckpointDirectoryError(
                    f"checkpoint directory {directory}: cannot take its lease "
                    f"({type(error).__name__}: {error})"
                ) from error
            # NOTE: ended, or of a job whose renewal will find this one's number
            for older, _ in leases:
                _remove(fs, f"{root}/{LEASE_FILE}.{older}")
            return cls(fs, root, directory, number, term, token)

    def release(self) -> None:
        """Let go: the renewing stops, and this job's own lease object is removed (never another's;
        a failure to remove it is logged: it ends with its term)."""
        self._stop.set()
        self._renewer.join(timeout=30)
        if not _remove(self._fs, f"{self._root}/{LEASE_FILE}.{self.number}"):
            logger.warning("could not remove the lease %s: it ends with its term", self.url)

    def _renew(self) -> None:
        while not self._stop.wait(self._term / 3):
            try:
                leases = _leases(self._fs, self._root)
                if leases and leases[-1][0] > self.number:
                    self.lost = True
                    logger.error(
                        "the lease of %s was taken by another job (%s) after this one's renewals "
                        "stopped "
                        "for longer than its term: two jobs may now write checkpoints there",
                        self.directory,
                        _read(self._fs, f"{self._root}/{LEASE_FILE}.{leases[-1][0]}"),
                    )
                    return
                self._fs.pipe_file(f"{self._root}/{LEASE_FILE}.{self.number}", _record(self._token))
            except Exception as error:
                logger.warning(
                    "could not renew the lease %s (%s: %s); trying again",
                    self.url,
                    type(error).__name__,
                    error,
                )


def _creates_conditionally(fs: Any) -> bool:
    """Whether ``fs.pipe_file`` takes ``mode="create"``: s3fs's S3 conditional write
    (``If-None-Match``)."""
    try:
        return (
            type(fs).__name__ == "S3FileSystem"
            and "mode" in inspect.signature(fs._pipe_file).parameters
        )
    except (AttributeError, TypeError, ValueError):
        return False


def _leases(fs: Any, root: str) -> list[tuple[int, float]]:
    """``(number, store modification time)`` of the lease objects in ``root``, lowest number
    first."""
    try:
        entries = fs.ls(root, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = re.fullmatch(
            re.escape(LEASE_FILE) + r"\.(\d+)", entry["name"].rstrip("/").rsplit("/", 1)[-1]
        )
        if match is not None:
            modified = entry.get("LastModified")
            stamp = (
                modified.timestamp()
                if modified is not None
                else fs.modified(entry["name"]).timestamp()
            )
            found.append((int(match.group(1)), stamp))
    return sorted(found)


def _record(token: str) -> bytes:
    return json.dumps({"owner": f"host {socket.gethostname()}, pid {os.getpid()}", "token": token,
                       "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()


def _read(fs: Any, path: str) -> str:
    """Who holds the lease at ``path``, as it says."""
    try:
        return str(json.loads(fs.cat_file(path)).get("owner"))
    except Exception:  # NOTE: gone meanwhile, or not ours to read: only named in a message
        return "unknown holder"


def _remove(fs: Any, path: str) -> bool:
    try:
        fs.rm(path)
    except FileNotFoundError:
        return True
    except Exception:
        return False
    return True
