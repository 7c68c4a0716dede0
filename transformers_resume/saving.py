"""A Trainer checkpoint written so that every rank agrees whether it was written.

Trainer writes ``checkpoint-N`` in steps, each rank its own part: the model (the main process), the
optimizer and the scheduler, each rank's RNG file, then ``trainer_state.json`` (the mark of a
complete checkpoint) and the deletion of older checkpoints. A storage failure on one rank (a full
disk, a read-only or vanished directory: an ``OSError``, the ``RuntimeError`` torch's writer makes
of one, safetensors' error) would leave the other ranks waiting in a collective, or training on
after a checkpoint that one rank never finished.

``AgreedWrite``: the ranks agree at fixed points of each write (after the model; after each rank's
last file; at the end). Every rank passes each point once, and a rank that failed between two points
joins the next one with its failure, so the collectives stay paired and all ranks stop the write at
the same point. Then the main process removes the partial ``checkpoint-N``, and every rank raises
``SaveFailed`` naming what failed and which checkpoint is still the newest complete one. A
collective inside Trainer's own writing (a sharded model's gather) is not such a point: a failure
inside one is not agreed.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loader_resume.distributed import any_rank
from loader_resume.job.checkpoint import describe_failure, storage_failure
from loader_resume.job.checkpoint_dir import DirectoryLock, claim
from loader_resume.job.remote_lease import RemoteLease

__all__ = ["AgreedWrite", "SaveFailed", "end_processes", "hold_output_dir"]


class SaveFailed(Exception):
    """A checkpoint write failed on some rank, agreed by every rank; the message names the path and
    the cause."""


class AgreedWrite:
    """One checkpoint write, every rank together; ``agree(flag)``: whether ``flag`` holds on any
    rank (a collective)."""

    def __init__(self, agree: Callable[[bool], bool]) -> None:
        self._agree = agree
        self._agreeing = False

    def point(self, failed: bool = False) -> None:
        """A point every rank passes once, at the same place of the write: ``SaveFailed`` on every
        rank once any rank failed."""
        self._agreeing = True
        agreed = self._agree(failed)
        self._agreeing = False
        if agreed:
            raise SaveFailed

    def run(self, write: Callable[[], None], directory: Path, *, main: bool, step: int,
            newest: Callable[[], Path | None]) -> None:
        """``write()`` (which passes the points inside it), then the last point. If it failed on any
        rank: the main process removes ``directory`` and ``SaveFailed`` is raised on every rank,
        naming ``directory``, the cause and ``newest()`` (the checkpoint a resume would still find);
        an error other than the storage's is raised instead, after the agreement."""
        own: Exception | None = None
        try:
            write()
            self.point()
            return
        except SaveFailed:
            pass
        except Exception as error:
            # NOTE: a collective failed (a rank gone): there is nothing left to agree with
            if self._agreeing:
                raise
            own = error
            try:
                self.point(True)
            except SaveFailed:
                pass
        if main:
            shutil.rmtree(directory, ignore_errors=True)
        if own is not None:
            # NOTE: raises anything the storage cannot cause (a bug), now that all agreed
            storage_failure(own)
        cause = (
            "it failed on another process"
            if own is None
            else describe_failure(own, directory.parent)
        )
        raise SaveFailed(
            f"checkpoint at step {step} NOT written to {directory}: {cause}; the newest complete "
            f"checkpoint is still {newest() or 'none'}"
        ) from own


def end_processes(trainer: Any) -> None:
    """Every process of ``trainer``'s job, before it exits: the process group torn down before the
    interpreter does it (gloo aborts a process, SIGABRT, whose worker threads still hold
    collectives' tensors at exit). The DDP wrapper keeps the group alive past
    ``destroy_process_group``, so it goes first (the process is ending)."""
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model
    gc.collect()
    trainer.accelerator.end_training()


def hold_output_dir(trainer: Any) -> DirectoryLock | RemoteLease | None:
    """``claim`` of ``trainer.args.output_dir`` on every process of the job. Where it is refused (on
    every process, agreed), the processes end first (``end_processes``), then the error leaves
    ``train``: a process that exits with the group alive would be aborted by gloo (SIGABRT) on some
    ranks, and the launcher report that instead."""
    try:
        return claim(trainer.args.output_dir, main=trainer.args.process_index == 0, agree=any_rank)
    except Exception:
        end_processes(trainer)
        raise
