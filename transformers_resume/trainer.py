"""``ResumableTrainer``: the transformers ``Trainer`` resuming mid-epoch with the very next batch.

Stock ``Trainer`` resumes by re-reading ``global_step % steps_per_epoch`` batches through
Accelerate's ``skip_first_batches`` (a plain ``DataLoader`` over a skipping batch sampler), so every
skipped batch is loaded again, and the order and augmentation values after the resume are not the
uninterrupted run's. Here, with public Trainer APIs where they exist:

- ``get_train_dataloader`` builds Trainer's own training ``DataLoader`` (its collator, workers,
  pinning, sampler choice) and makes it an ``AcceleratedResumableDataLoader``, sharded by us across
  ``args.world_size`` (instead of Accelerate's ``DataLoaderShard``), seeded by ``args.data_seed``
  (else ``args.seed``).
- Every checkpoint ``checkpoint-N`` gets one ``loader_resume_<rank>.pt`` per rank, written
  (atomically) before Trainer writes its ``trainer_state.json``, the file whose presence makes a
  Trainer checkpoint complete; the ranks wait for each other after their last file (Trainer's
  ``rng_state_<rank>.pth``), so ``trainer_state.json`` is written, and older checkpoints deleted,
  only once every rank's files exist. ``train(resume_from_checkpoint=True)`` resumes from the newest
  complete checkpoint that verifies (one that lacks a file or fails a check is skipped with a
  warning naming it; ``checkpoint_files``), and starts from the beginning where there is none, so
  one command starts a job and continues it (saying so where an earlier job left traces:
  ``loader_resume.job.fresh_start``); an explicit path that lacks a file or fails a check is
  refused, naming the file. A write that fails on any rank is agreed by all (``saving``): nothing
  partial stays, and training stops with ``CheckpointError`` (a preemption save: exit 74).
  ``output_dir`` is locked while ``train`` runs (one job per directory).
- While ``train`` runs, Trainer's skipping is a no-op for our loader: it already stands at the next
  batch. Trainer still counts the skipped steps as done, and restores its RNG files
  (``rng_state_<rank>.pth``).
- Evaluation and test loaders stay Trainer's; their workers ignore the preemption signals, so a
  signal to the whole process group during an evaluation leaves it whole, and the checkpoint follows
  at the next step.
- Preemption: SIGTERM or SIGUSR1 only sets a flag; at the end of the next optimizer step
  (``on_step_end``, after the LR scheduler's) all ranks agree, Trainer writes its checkpoint (ours
  included) and stops, and every process exits with ``exit_code`` (143); the same command continues
  with the next batch. ``enable_jit_checkpoint`` is refused: it checkpoints on one process,
  unagreed, possibly mid-step.

Another number of processes (map-style datasets): the rest of the epoch is spread over the new
ranks, each sample exactly once, and Trainer's step counter is re-expressed at the new world size:
``global_step`` becomes the optimizer steps a run started on the new number of processes would have
taken to reach the same sample (completed epochs * its steps per epoch + its steps into this epoch),
and the LR scheduler is moved to that step. Everything Trainer derives from steps (the epoch,
``max_steps``, the LR horizon, ``save_steps``) then means what it means in a run started on the new
number of processes, whose steps a ``max_steps`` budget counts. A position that is not an
optimizer-step boundary there (e.g. 1 → 2 processes after an odd number of steps) is refused, naming
the sample and what it must divide; so is an iterable dataset's state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers.trainer as trainer_module
from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from accelerate_resume import AcceleratedResumableDataLoader
from accelerate_resume.loader import placed
from loader_resume import GENERATORS
from loader_resume.audit.log import audit_from_environment
from loader_resume.convert import sharded_resumable
from loader_resume.distributed import any_rank, load_rank_state
from loader_resume.job.checkpoint import CheckpointError, temporary_name, writer_token
from loader_resume.job.checkpoint_dir import preemption_exit_code
from loader_resume.job.checkpoint_entry import new_entry
from loader_resume.job.fresh_start import resuming_nothing
from loader_resume.job.preemption import Preemption, workers_ignore_signals
from loader_resume.job.remote_copy import RemoteCopy
from loader_resume.job.slurm import Requeue

from .checkpoint_files import (
    LOADER_STATE_FILE,
    newest_complete,
    newest_resumable,
    read_states,
    step_at,
    verify_named,
)
from .remote import copy_checkpoint, fetch_remote, start_remote
from .saving import AgreedWrite, SaveFailed, end_processes, hold_output_dir
from .signals import AgreeOnSignals
from .trainer_patches import no_skipping, unprepared

__all__ = ["LOADER_STATE_FILE", "ResumableTrainer", "ResumeTrainerMixin"]

logger = logging.getLogger(__name__)



class ResumeTrainerMixin:
    """Exact mid-epoch resume for a ``transformers.Trainer`` subclass: put it first in the bases
    (``class MyTrainer(ResumeTrainerMixin, Trainer)``); see the module docstring.

    Keyword arguments taken off the Trainer's: ``keying`` (``"batch"``, ``"sample"`` or ``"off"``)
    and ``keyed_generators`` (see ``ResumableDataLoader``); ``signals`` that request a preemption
    checkpoint (``()``: none), ``check_every_n_steps`` (how often the ranks agree on them),
    ``exit_code`` (after a preemption checkpoint) and ``slurm_requeue`` (inside a SLURM job,
    ``scontrol requeue`` after a checkpoint requested by SIGUSR1: ``loader_resume.job.slurm``);
    ``remote``, an fsspec URL each checkpoint is copied to and resumed from (else
    ``$LOADER_RESUME_REMOTE``; ``transformers_resume.remote``); ``audit``, a directory or URL where
    each rank logs the batches its training loader hands over, for ``loader-resume audit DIR`` (else
    ``$LOADER_RESUME_AUDIT``, if set).
    """

    args: Any
    accelerator: Any
    state: Any
    model: Any
    model_wrapped: Any

    def __init__(
        self,
        *args: Any,
        keying: str = "batch",
        keyed_generators: Sequence[str] = GENERATORS,
        signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1"),
        check_every_n_steps: int = 1,
        exit_code: int = 143,
        slurm_requeue: bool = False,
        remote: str | None = None,
        audit: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        for name, value, least in (
            ("check_every_n_steps", check_every_n_steps, 1),
            ("exit_code", exit_code, 0),
        ):
            if type(value) is not int or value < least:
                raise ValueError(
                    f"{type(self).__name__}({name}={value!r}): expected an int >= {least}"
                )
        self.resume_keying, self.resume_keyed_generators = keying, tuple(keyed_generators)
        self.resume_audit = audit_from_environment(audit)
        self.resume_loader: AcceleratedResumableDataLoader | None = None
        """The training loader of the current ``train()`` (``None`` before)."""
        self.preemption, self.requeue = Preemption(signals), Requeue(slurm_requeue)
        self.check_every_n_steps, self.exit_code = check_every_n_steps, exit_code
        self.remote = remote
        self._copy: RemoteCopy | None = None  # while train() runs, with a remote URL
        self.preempted_at: int | None = None
        """The step of the preemption checkpoint, once taken."""
        self._loader_states: dict[str, Any] | None = None
        self._write: AgreedWrite | None = None  # the checkpoint being written
        # checkpoint, its world size, rank 0's
        self._moved_from: tuple[Path, int, dict[str, Any]] | None = None
        self._move_scheduler_to: int | None = None
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        # NOTE: before Trainer installs its handler
        if getattr(training_args, "enable_jit_checkpoint", False):
            raise ValueError(
                f"TrainingArguments(enable_jit_checkpoint=True) with {type(self).__name__}: "
                "expected it off. It checkpoints on one process without the others' agreement, "
                "possibly before an optimizer step when the loader has delivered that step's "
                "batches; ResumableTrainer handles SIGTERM/SIGUSR1 itself, agreed by every rank "
                "at a step boundary (its signals= argument)"
            )
        super().__init__(*args, **kwargs)
        self.add_callback(AgreeOnSignals(self))  # type: ignore[attr-defined]

    # --- the loader -------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader[Any]:
        """Trainer's training loader, as an
        [`AcceleratedResumableDataLoader`][accelerate_resume.AcceleratedResumableDataLoader] sharded
        across the processes; a checkpoint's state being resumed goes into it."""
        plain = unprepared(self.accelerator, super().get_train_dataloader)  # type: ignore[misc]
        args, accelerator = self.args, self.accelerator
        ours = sharded_resumable(
            plain,
            rank=args.process_index,
            world_size=args.world_size,
            loader_class=AcceleratedResumableDataLoader,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            keying=self.resume_keying,
            keyed_generators=self.resume_keyed_generators,
            ignore_signals=self.preemption.signals,
            audit=self.resume_audit,
        )
        ours.attach_accelerate(None, *placed(accelerator, None))
        if self._loader_states is not None:
            load_rank_state(ours, self._loader_states)
            self._loader_states = None
        self.resume_loader = ours
        return ours

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader[Any]:
        loader = super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]
        safe: DataLoader[Any] = workers_ignore_signals(loader, self.preemption.signals)
        return safe

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader[Any]:
        loader = super().get_test_dataloader(test_dataset)  # type: ignore[misc]
        safe: DataLoader[Any] = workers_ignore_signals(loader, self.preemption.signals)
        return safe

    # --- train / checkpoints ----------------------------------------------------------------------
    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the newest complete checkpoint
        in ``args.output_dir`` that verifies (see the module docstring). ``args.output_dir`` is this
        job's while it trains: a second job on it is refused."""
        # NOTE: _train tells it whether it resumes nothing
        lock = self._held = hold_output_dir(self)
        try:
            self._copy = start_remote(self, self.remote)
            return self._train(resume_from_checkpoint, *args, **kwargs)
        finally:
            for held in (lock, self._copy):
                if held is not None:
                    held.release()

    def _train(self, resume_from_checkpoint: str | bool | None, *args: Any, **kwargs: Any) -> Any:
        args_, root = self.args, Path(self.args.output_dir)
        checkpoint: str | None
        if resume_from_checkpoint is True:
            fetch_remote(self, self._copy)
            found = newest_resumable(
                root, rank=args_.process_index, world_size=args_.world_size, agree=any_rank
            )
            checkpoint = None if found is None else os.fspath(found)
            # NOTE: stock Trainer raises here
            if checkpoint is None and not resuming_nothing(self._held, any_rank):
                logger.warning(
                    "no complete checkpoint in %s: training starts from the beginning", root
                )
        else:
            checkpoint = resume_from_checkpoint or None
            if checkpoint is not None:
                verify_named(
                    Path(checkpoint),
                    rank=args_.process_index,
                    world_size=args_.world_size,
                    agree=any_rank,
                )
        if checkpoint is not None and args_.ignore_data_skip:
            raise ValueError(
                f"TrainingArguments(ignore_data_skip=True) with {type(self).__name__}: expected it "
                f"off. {type(self).__name__} continues {checkpoint} with the very next batch and "
                "reads none to skip it; ignore_data_skip would start the epoch's data over while "
                "Trainer's step counter goes on"
            )
        self._move_scheduler_to = None
        # NOTE: transformers >= 5.3
        movable = hasattr(trainer_module.Trainer, "_init_training_state")
        self._loader_states, self._moved_from = (None, None) if checkpoint is None else \
            read_states(Path(checkpoint), args_.world_size, can_move=movable)
        self.preempted_at = None
        self.preemption.install()
        try:
            with no_skipping():
                output = super().train(checkpoint, *args, **kwargs)  # type: ignore[misc]
        except SaveFailed as failed:
            end_processes(self)
            if self.preempted_at is None:
                raise CheckpointError(str(failed)) from failed.__cause__
            logger.error("%s", failed)
            raise SystemExit(
                preemption_exit_code(
                    None,
                    self.preempted_at,
                    self.exit_code,
                    os.fspath(newest_complete(root) or "the start"),
                )
            ) from None
        finally:
            self.preemption.uninstall()
        if self.preempted_at is not None:
            written = root / f"{PREFIX_CHECKPOINT_DIR}-{self.preempted_at}"
            self.requeue.after_checkpoint(self.args.process_index == 0)
            end_processes(self)
            raise SystemExit(
                preemption_exit_code(written, self.preempted_at, self.exit_code, os.fspath(written))
            )
        return output

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # NOTE: Trainer's own (transformers 4.x and 5.x), run by every process; its last write is
        # trainer_state.json
        loader = self.resume_loader
        if loader is None:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            return
        if trial is None:
            run_dir = Path(self.args.output_dir)
        else:
            run_dir = Path(self._get_output_dir(trial=trial))  # type: ignore[attr-defined]
        directory = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"

        def write() -> None:
            directory.mkdir(parents=True, exist_ok=True)
            rank = self.args.process_index
            # NOTE: Trainer resumes an epoch's last step with the next epoch's iter()
            position = loader.resume_state(loop_ends_pass=False)
            state = new_entry(
                world_size=self.args.world_size,
                rank=rank,
                global_step=self.state.global_step,
                rng_files=not self.args.save_only_model,
                loader=position,
            )
            final = directory / LOADER_STATE_FILE.format(rank=rank)
            # NOTE: this rank's name
            temporary = temporary_name(final, writer_token(lambda token: token))
            torch.save(state, temporary)
            os.replace(temporary, final)
            super(ResumeTrainerMixin, self)._save_checkpoint(model, trial)  # type: ignore[misc]

        self._write = AgreedWrite(any_rank)
        try:
            self._write.run(
                write,
                directory,
                main=self.args.should_save,
                step=self.state.global_step,
                newest=lambda: newest_complete(run_dir),
            )
        finally:
            self._write = None
        copy_checkpoint(self, self._copy, directory)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        # NOTE: inside _save_checkpoint, on every process
        if self._write is not None and _internal_call:
            self._write.point()

    def _save_rng_state(self, output_dir: str) -> None:
        # NOTE: Trainer's own, the last per-rank file of its checkpoint; rank 0 then writes
        # trainer_state.json (the mark of a complete checkpoint) and deletes older checkpoints
        # (save_total_limit). Every rank's files exist before that (the ranks agree here), or a kill
        # could leave the only checkpoint without another rank's files.
        super()._save_rng_state(output_dir)  # type: ignore[misc]
        if self._write is not None:
            self._write.point()

    def _init_training_state(
        self, max_steps: int, num_update_steps_per_epoch: int, *args: Any
    ) -> tuple[int, int]:
        # NOTE: Trainer's own (transformers 5.x): restores trainer_state.json and derives the epoch
        # and the batches into it from global_step; after a change of world size, global_step is
        # re-expressed first
        epochs, batches = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, *args)
        if self._moved_from is None:
            return epochs, batches
        checkpoint, world, state = self._moved_from
        loader, accumulation = self.resume_loader, self.args.gradient_accumulation_steps
        assert loader is not None and loader.batch_size is not None
        step = step_at(
            state,
            world_size=self.args.world_size,
            batch_size=loader.batch_size,
            accumulation=accumulation,
            steps_per_epoch=num_update_steps_per_epoch,
            checkpoint=checkpoint,
        )
        logger.warning(
            "%s: written by %d process(es), resumed on %d: step %d is step %d here (the same "
            "sample)",
            checkpoint,
            world,
            self.args.world_size,
            self.state.global_step,
            step,
        )
        self.state.global_step = self._move_scheduler_to = step
        epochs = step // num_update_steps_per_epoch
        # (ignore_data_skip is refused with a checkpoint)
        batches = step % num_update_steps_per_epoch * accumulation
        return epochs, batches

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        step, scheduler = self._move_scheduler_to, getattr(self, "lr_scheduler", None)
        if step is None or scheduler is None:
            return
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            # NOTE: Trainer's schedules are LambdaLRs built with this run's horizon; step() computes
            # the learning rates of ``last_epoch + 1`` in closed form and sets them on the optimizer
            scheduler.last_epoch = step - 1
            scheduler.step()
        # not indexed by steps
        elif type(scheduler).__name__ not in ("ReduceLROnPlateau", "GreedyLR"):
            logger.warning(
                "LR scheduler %s not moved to step %d after the change of world size (only "
                "LambdaLR "
                "schedules are); its learning rates continue from the checkpoint's step",
                type(scheduler).__name__,
                step,
            )

    def resumable_checkpoint(self) -> str | None:
        """The newest complete checkpoint in ``args.output_dir`` that verifies (what
        ``train(resume_from_checkpoint= True)`` resumes from, read by this process alone), or
        ``None``: ``trainer.train(resume_from_checkpoint= trainer.resumable_checkpoint() is not
        None)`` starts or continues with one command."""
        found = newest_resumable(Path(self.args.output_dir))
        return None if found is None else os.fspath(found)


class ResumableTrainer(ResumeTrainerMixin, trainer_module.Trainer):
    """``transformers.Trainer`` with exact mid-epoch resume
    ([`ResumeTrainerMixin`][transformers_resume.ResumeTrainerMixin])."""
