"""SLURM's requeue after a preemption checkpoint, as Lightning's
``SLURMEnvironment(auto_requeue=True)`` does it.

SLURM warns a job before its time limit or a preemption with a signal of the job's choosing
(``sbatch --signal=USR1@90``); Lightning answers it by checkpointing and running ``scontrol requeue
JOB``, so the job is queued again and continues from its checkpoint. ``requeue_job`` is that
command, run once per job (the main process), after the agreed checkpoint is written: the job id in
the array form when the job is an array task (``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID``), else
``SLURM_JOB_ID``. A failed requeue is logged with its exit code, never raised: the checkpoint is
written and the job ends as it would without the requeue.

``Requeue`` is the same for the front-ends without a SLURM environment of their own (Fabric,
Accelerate, the transformers Trainer): asked for (``slurm_requeue=True``) and inside a SLURM job,
the requeue signal (SIGUSR1: ``sbatch --signal=USR1@90``) requests a preemption checkpoint as any
signal does, and once it is written the main process requeues the job. Other signals (SIGTERM:
``scancel``, the time limit) stop without a requeue.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Callable, Mapping

__all__ = ["Requeue", "requeue_job", "slurm_job_id"]

logger = logging.getLogger(__name__)


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol requeue`` takes for this job (an array task's: ``ARRAYJOB_TASK``), or
    ``None`` outside SLURM; ``ValueError`` for an id that is not one."""
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    job = (
        f"{array_job}_{environ.get('SLURM_ARRAY_TASK_ID', '')}"
        if array_job
        else environ.get("SLURM_JOB_ID")
    )
    if job is not None and re.fullmatch(r"\d+(_\d+)?", job) is None:
        raise ValueError(
            f"SLURM job id {job!r} (SLURM_JOB_ID / SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID): "
            "expected digits, or ARRAYJOB_TASK for an array task"
        )
    return job


def requeue_job(environ: Mapping[str, str] = os.environ) -> bool:
    """``scontrol requeue`` this job; whether it succeeded (the failure logged: no job id, no
    ``scontrol`` on ``PATH``, or its exit code)."""
    job = slurm_job_id(environ)
    if job is None:
        logger.error(
            "SLURM requeue asked for, but SLURM_JOB_ID is not set (not a SLURM job?): not requeued"
        )
        return False
    try:
        code = subprocess.call(["scontrol", "requeue", job])
    except OSError as error:
        logger.error("requeuing SLURM job %s failed: scontrol could not run (%s)", job, error)
        return False
    if code != 0:
        logger.error("requeuing SLURM job %s failed: scontrol exited with %d", job, code)
        return False
    logger.warning(
        "requeued SLURM job %s: it continues from the checkpoint when it starts again", job
    )
    return True


class Requeue:
    """The requeue of one job (see the module's description); off unless ``asked`` inside a SLURM
    job."""

    def __init__(self, asked: bool, requeue_signal: int = signal.SIGUSR1) -> None:
        self.signal = int(requeue_signal) if asked and "SLURM_JOB_ID" in os.environ else None
        if asked and self.signal is None:
            logger.warning(
                "a SLURM requeue was asked for (slurm_requeue, or Lightning's auto_requeue) "
                "outside a SLURM job (no SLURM_JOB_ID): no requeue"
            )
        self.wanted = False

    def decide(self, received: int | None, agree: Callable[[bool], bool]) -> None:
        """At the agreed stop, on every rank (``agree``: a collective, called only when the requeue
        is on): whether any rank got the requeue signal."""
        if self.signal is not None:
            self.wanted = agree(received == self.signal)

    def after_checkpoint(self, main: bool) -> None:
        """Once the checkpoint is written, every rank: the main process requeues the job if it was
        asked for."""
        if self.wanted and main:
            requeue_job()
