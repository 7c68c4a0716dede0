"""Where a ``Trainer.fit`` without ``ckpt_path`` looks for its checkpoint, seen from
``ResumeCallback``: which trainer is asking, which file is newest, and Lightning's warnings about
that search on a fresh fit."""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any, cast

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["make_newest", "quiet_fresh_fit", "trainer_calling"]


def trainer_calling(callback: Any) -> Trainer | None:
    """The ``Trainer`` on the call stack whose callbacks hold ``callback`` (``None`` outside
    one)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and any(
            c is callback for c in getattr(candidate, "callbacks", ())
        ):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


_FRESH_FIT_WARNINGS = (
    r"`\.fit\(ckpt_path=None\)` was called without a model",
    r'\.fit\(ckpt_path="last"\) is set',
)
"""What Lightning says on every fit() with an ``OnExceptionCheckpoint`` and no ``ckpt_path``: it
then looks for the "last" checkpoint itself, which is how a restarted fit finds ours; on a fresh fit
there is none to find. Neither is a warning a user can act on
(``checkpoint_connector._parse_ckpt_path``)."""


def quiet_fresh_fit(quiet: bool) -> None:
    """Hide (or show again) Lightning's two warnings about the checkpoint a fit() without
    ``ckpt_path`` looks for."""
    filters = cast(list[Any], warnings.filters)  # NOTE: a list (typeshed says Sequence)
    filters[:] = [f for f in filters if getattr(f[1], "pattern", None) not in _FRESH_FIT_WARNINGS]
    for message in _FRESH_FIT_WARNINGS if quiet else ():
        warnings.filterwarnings(
            "ignore", message, UserWarning, r"lightning\.pytorch\.trainer\.connectors"
        )


def make_newest(path: str, trainer: Trainer) -> None:
    """Give ``path`` an mtime later than every ``last*.ckpt`` of the trainer's
    ``ModelCheckpoint``s."""
    newest = 0
    for callback in trainer.checkpoint_callbacks:
        folder = getattr(callback, "dirpath", None)
        if isinstance(callback, ModelCheckpoint) and folder and os.path.isdir(folder):
            for name in os.listdir(folder):
                if name.startswith(
                    callback.CHECKPOINT_NAME_LAST or "last"
                ) and name != os.path.basename(path):
                    newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    now = time.time_ns()
    os.utime(path, ns=(now, max(now, newest + 1_000_000)))
