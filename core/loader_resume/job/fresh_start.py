"""Never a silent start from step 0: a job that resumes nothing says so when an earlier job left
traces.

A rerun that finds no checkpoint to resume from starts at step 0. Where an earlier job in the same
checkpoint directory got as far as leaving something behind — its lock file (a job killed, or one
whose process never let go), a checkpoint write it never finished — that start is the loss of
whatever that job trained, so it is said in one warning naming what was found and what happens now.
What happens is ``LOADER_RESUME_NO_CHECKPOINT``'s choice:

- ``start-over`` (the default): the job starts from step 0. Nothing usable is lost by it (a write
  never finished is not a checkpoint), and a requeued job keeps running, as Lightning does for
  ``fit(ckpt_path="last")`` with no checkpoint to find.
- ``refuse``: the job stops at once with ``CheckpointDirectoryError`` naming the same traces, for a
  person to look before anything is trained again.

Every front-end calls ``resuming_nothing`` once it knows that it resumes nothing (every process of
the job: the choice is agreed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from loader_resume.job.checkpoint_dir import CheckpointDirectoryError, DirectoryLock, newest_usable

__all__ = [
    "NO_CHECKPOINT_CHOICES",
    "NO_CHECKPOINT_VARIABLE",
    "newest_or_start",
    "no_checkpoint_choice",
    "resuming_nothing",
]

logger = logging.getLogger(__name__)

NO_CHECKPOINT_VARIABLE: Final = "LOADER_RESUME_NO_CHECKPOINT"
"""What a job does that resumes nothing where an earlier job left traces (see the module's
description)."""
NO_CHECKPOINT_CHOICES: Final = ("start-over", "refuse")


def no_checkpoint_choice() -> str:
    """``$LOADER_RESUME_NO_CHECKPOINT`` (unset or empty: ``start-over``); ``ValueError`` naming
    another value."""
    choice = os.environ.get(NO_CHECKPOINT_VARIABLE, "").strip() or NO_CHECKPOINT_CHOICES[0]
    if choice not in NO_CHECKPOINT_CHOICES:
        raise ValueError(
            f"{NO_CHECKPOINT_VARIABLE}={choice!r}: expected one of {list(NO_CHECKPOINT_CHOICES)} "
            "(what a job that finds no checkpoint does where an earlier job left traces)"
        )
    return choice


def resuming_nothing(lock: object, agree: Callable[[bool], bool]) -> bool:
    """The job resumes nothing: if ``lock`` (the job's hold on its checkpoint directory, on the main
    process; any other value elsewhere) found an earlier job's traces, one warning, or
    ``CheckpointDirectoryError`` on every process if ``refuse`` was chosen. Every process calls it
    (``agree``: a flag held on any process, a collective). Whether this process warned."""
    refuse = no_checkpoint_choice() == "refuse"
    traces = lock.traces if isinstance(lock, DirectoryLock) else []
    found = (
        f"{lock.directory}: an earlier job left {'; '.join(traces)}"
        if isinstance(lock, DirectoryLock)
        else ""
    )
    if traces and not refuse:
        logger.warning(
            "%s, and there is no checkpoint to resume from: starting from step 0 (%s=refuse stops "
            "instead)",
            found,
            NO_CHECKPOINT_VARIABLE,
        )
    if agree(bool(traces) and refuse):
        if isinstance(lock, DirectoryLock):
            # NOTE: the next start meets them again (refused or told) until a person acts
            lock.keep_traces()
        where = (
            found
            if traces
            else "the main process found an earlier job's traces (its log names them)"
        )
        raise CheckpointDirectoryError(
            f"{where}, and there is no checkpoint to resume from; refused, as "
            f"{NO_CHECKPOINT_VARIABLE}=refuse: expected a checkpoint to resume from (set "
            "it to start-over to start from step 0)"
        )
    return bool(traces)


def newest_or_start(
    checkpoints: list[Path], lock: object, agree: Callable[[bool], bool]
) -> Path | None:
    """``newest_usable(checkpoints, agree)``; when there is none, ``resuming_nothing(lock, agree)``
    first."""
    # NOTE: a misspelt value fails on every start, not only on one that needs it
    no_checkpoint_choice()
    found = newest_usable(checkpoints, agree)
    if found is None:
        resuming_nothing(lock, agree)
    return found
