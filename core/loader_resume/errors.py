"""Every error loader-resume raises on purpose: one base class, ``LoaderResumeError``, and one class
per kind of failure, each also the built-in exception it has always been (``ValueError``,
``RuntimeError``, ``OSError``), so ``except ValueError`` still catches a ``StateError``. Each is
importable from the module of its idea too (the API page names it there), and from
``loader_resume``; the troubleshooting page has an entry for each."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuditFormatError",
    "CheckpointDirectoryError",
    "CheckpointError",
    "LoaderResumeError",
    "RemoteCopyError",
    "StateError",
    "WorkerStartError",
]


class LoaderResumeError(Exception):
    """The base of every error loader-resume raises on purpose: ``except LoaderResumeError`` catches
    all of them (and none of your own code's or a framework's)."""


class StateError(LoaderResumeError, ValueError):
    """A loader state that cannot be resumed here; names the field, the saved and the expected
    value."""

    def __init__(self, field: str, saved: Any, expected: str, hint: str = "") -> None:
        """``expected``: what would have been accepted, as the message shows it (``repr(value)`` for
        a value, or a description such as ``"an int >= 0"``); ``hint``: what to do about it."""
        self.field, self.saved, self.expected, self.hint = field, saved, expected, hint
        message = f"loader state field {field!r}: saved {saved!r}, expected {expected}"
        super().__init__(f"{message}. {hint}" if hint else message)


class CheckpointError(LoaderResumeError, ValueError):
    """A checkpoint is incomplete, corrupted, edited, or of another format; the message names the
    file and what was expected."""


class CheckpointDirectoryError(LoaderResumeError, RuntimeError):
    """A checkpoint directory cannot be written, or another job holds it."""


class RemoteCopyError(LoaderResumeError, OSError):
    """An upload to, or a download from, the remote copy failed; the message names the URL and the
    cause."""


class WorkerStartError(LoaderResumeError, RuntimeError):
    """A DataLoader worker was forked but never started (see
    ``loader_resume.workers.worker_start``)."""


class AuditFormatError(LoaderResumeError, ValueError):
    """An audit directory that cannot be read: nothing there, a damaged record, an unknown
    format."""
