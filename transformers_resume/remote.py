"""``ResumableTrainer``'s checkpoints copied to object storage: ``remote=`` (or
``LOADER_RESUME_REMOTE``).

Trainer writes local directories only. With a remote URL (``s3://bucket/run``, ``gs://...``: an
fsspec URL), each complete ``checkpoint-N`` — every rank's files and ``trainer_state.json`` written,
agreed by the ranks — gets a manifest (its files' sizes and SHA-256 sums), and the main process
uploads it to ``URL/checkpoint-N/``, the manifest last (``loader_resume.job.remote_copy``: a remote
directory without one is incomplete and skipped, named). A failed upload fails the save on every
rank, as a failed local write does: ``CheckpointError``, or exit 74 at a preemption; the local
checkpoint stays. ``train(resume_from_checkpoint=True)`` first downloads the complete remote
checkpoints newer than the newest local one, so the same command on a new machine continues from the
bucket. The job holds the URL's lease while ``train`` runs (one job per remote directory).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from loader_resume.distributed import any_rank
from loader_resume.job.checkpoint import describe_failure, write_manifest
from loader_resume.job.remote_copy import RemoteCopy, fetch_newer, start_remote_copy

from .saving import SaveFailed, end_processes

__all__ = ["REMOTE_VARIABLE", "copy_checkpoint", "fetch_remote", "start_remote"]

REMOTE_VARIABLE = "LOADER_RESUME_REMOTE"
"""The environment variable read where ``remote=`` is not given (as Accelerate's ``enable_resume``
reads it)."""


def start_remote(trainer: Any, remote: str | None) -> RemoteCopy | None:
    """The remote copy of ``trainer``'s checkpoints (``remote``, else ``$LOADER_RESUME_REMOTE``;
    ``None``: none), its lease held. Refused on every process (a store that cannot be reached,
    another job holding it), the processes end first (``end_processes``), then the error leaves
    ``train``."""
    url = remote if remote is not None else os.environ.get(REMOTE_VARIABLE) or None
    try:
        return start_remote_copy(
            url,
            Path(trainer.args.output_dir),
            keep=trainer.args.save_total_limit or sys.maxsize,
            main=trainer.args.process_index == 0,
            agree=any_rank,
            pattern=rf"{PREFIX_CHECKPOINT_DIR}-(\d+)",
        )
    except Exception:
        end_processes(trainer)
        raise


def fetch_remote(trainer: Any, copy: RemoteCopy | None) -> None:
    """Before a resume looks for local checkpoints: the newer complete remote ones downloaded (every
    process)."""
    fetch_newer(copy, main=trainer.args.process_index == 0, agree=any_rank)


def copy_checkpoint(trainer: Any, copy: RemoteCopy | None, directory: Path) -> None:
    """After ``directory`` is complete on every rank: its manifest, then its upload, on the main
    process; a failure there is ``SaveFailed`` on every rank, naming the URL and the cause (a bug:
    raised as itself there)."""
    if copy is None:
        return
    failure: Exception | None = None
    if trainer.args.process_index == 0:
        try:
            write_manifest(directory)
            copy.upload(directory)
        except Exception as error:
            failure = error
    if any_rank(failure is not None):
        if failure is not None and not isinstance(failure, OSError):
            raise failure
        cause = (
            "it failed on the main process"
            if failure is None
            else describe_failure(failure, directory.parent)
        )
        raise SaveFailed(
            f"checkpoint at step {trainer.state.global_step} written to {directory} but NOT copied "
            f"to {copy.url}: {cause}"
        ) from failure
