"""``ResumeCallback``: add it to a ``lightning.Trainer`` and mid-epoch resume becomes exact.

The user's module or datamodule keeps returning plain ``torch.utils.data.DataLoader``s. The callback
converts the training loaders to ``loader_resume.ResumableDataLoader`` (same dataset, batch size,
collate, workers, pin-memory, drop-last and shuffle choice), which shard themselves across DDP
ranks; every checkpoint gets each rank's loader state and RNG states under one key, and a resumed
``fit`` continues with the very next batch.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import DataLoader
from typing_extensions import override

from loader_resume import GENERATORS, ResumableDataLoader
from loader_resume.audit.log import audit_from_environment
from loader_resume.convert import resumable
from loader_resume.distributed import gather_rng_states, gather_states
from loader_resume.job.checkpoint_dir import (
    FAILED_SAVE_EXIT_CODE,
    DirectoryLock,
    preemption_exit_code,
)
from loader_resume.job.checkpoint_entry import checked_entry, new_entry
from loader_resume.job.fresh_start import resuming_nothing
from loader_resume.job.preemption import Preemption
from loader_resume.job.remote_lease import RemoteLease
from loader_resume.job.slurm import Requeue
from loader_resume.job.storage import is_remote, join, local_path
from loader_resume.order.sampler import loader_seed

from .fit_start import make_newest, quiet_fresh_fit, trainer_calling
from .generators import FitGenerators
from .integrity import exists, nothing_else_to_resume, save_atomically, usable, verify_loads
from .loaders import TrainingLoaders, drop_lightning_loader_states, evaluation_workers_ignore
from .remote import checkpoints_in, claim_directory, newer, newest_last, refuse_a_silent_start
from .stopping import (
    adopt_lightnings_sigterm,
    leave_process,
    slurm_requeue,
    stop_validating_as_planned,
)

__all__ = ["CHECKPOINT_KEY", "ResumeCallback"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "loader_resume"
"""Where the callback's state lives in a Lightning checkpoint (beside ``state_dict``,
``loops``...)."""


class ResumeCallback(OnExceptionCheckpoint):
    """Exact mid-epoch resume for Lightning training loops, with automatic preemption checkpoints.

    Args:
        seed: the data order and keyed augmentation seed (see ``ResumableDataLoader``).
        keying: ``"batch"``, ``"sample"`` or ``"off"`` (see ``ResumableDataLoader``).
        keyed_generators: which global generators are keyed inside data loading.
        signals: signals that request a preemption checkpoint (``()`` for none). The handler only
            sets a flag; at the next optimizer-step boundary all ranks agree (one ``all_reduce``),
            the checkpoint is written atomically and the trainer stops.
        dirpath: where the preemption checkpoint goes; ``None``: the trainer's ``default_root_dir``
            (``Trainer(default_root_dir=...)``, or LightningCLI's ``trainer.default_root_dir``). A
            restarted ``fit()`` (no ``ckpt_path``) resumes from the newest of it and your
            ``ModelCheckpoint``'s ``last`` file.
        filename: the preemption checkpoint's name, without ``.ckpt``.
        check_every_n_steps: agree on signals every N optimizer steps (one tiny collective each
            time).
        exit_code: after a preemption checkpoint, end the process with this code (143 = 128 +
            SIGTERM, so a scheduler sees a failure and requeues); ``None``: return from ``fit()``
            normally (``callback.preempted_at`` tells the step).
        audit: a directory or URL each rank logs its loaders' batches to, for ``loader-resume audit
            DIR`` (``None``: ``$LOADER_RESUME_AUDIT``, if set; see
            ``ResumableDataLoader(audit=...)``).

    One per ``Trainer``: a second one is refused at ``setup``. The training loaders' state and every
    rank's torch/numpy/random RNG states are written under ``checkpoint["loader_resume"]``;
    Lightning's own copy of loader states (rank 0's only) is dropped from the checkpoint in favour
    of it. It is an ``OnExceptionCheckpoint`` only so that a restart finds its checkpoint: it never
    saves on an exception (that would be mid-step), and a finished fit removes its stale preemption
    checkpoint.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        keying: str = "batch",
        keyed_generators: Sequence[str] = GENERATORS,
        signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1"),
        dirpath: str | os.PathLike[str] | None = None,
        filename: str = "preempted",
        check_every_n_steps: int = 1,
        exit_code: int | None = 143,
        audit: str | os.PathLike[str] | None = None,
    ) -> None:
        # NOTE: file: URLs
        super().__init__(local_path(dirpath) if dirpath is not None else os.getcwd(), filename)
        if type(check_every_n_steps) is not int or check_every_n_steps < 1:
            raise ValueError(
                f"ResumeCallback(check_every_n_steps={check_every_n_steps!r}): expected an int >= 1"
            )
        self.seed, self.keying, self.keyed_generators = seed, keying, tuple(keyed_generators)
        self.audit = audit_from_environment(audit)
        self.preemption = Preemption(signals)
        self.check_every_n_steps, self.exit_code = check_every_n_steps, exit_code
        self.preempted_at: int | None = None
        self._dirpath_known = dirpath is not None  # else: learnt from the trainer (see ckpt_path)
        # Lightning asked for ckpt_path before we could learn the trainer's dir
        self._asked_unknown = False
        self._training = TrainingLoaders(self._resumable)
        self._generators = FitGenerators()
        self._lock: DirectoryLock | RemoteLease | None = None
        self._claimed = False  # on every rank (the lock: the main one's)
        self._choosing = True  # Lightning may be choosing the checkpoint of a fit (see ckpt_path)
        # our preemption checkpoint, passed over as it does not verify
        self._skipped: str | None = None
        self._exit_with = 0
        self._requeue = Requeue(asked=False)  # see setup
        quiet_fresh_fit(True)

    @property
    @override
    def ckpt_path(self) -> str:
        """The preemption checkpoint: ``dirpath/filename.ckpt``.

        NOTE: a restarted ``fit()`` (no ``ckpt_path``) picks its checkpoint before any callback hook
        runs: Lightning 2.6 reads this property from inside ``Trainer.fit`` (resolving "last" across
        the checkpoint callbacks). Without a ``dirpath`` we learn the directory there, from the
        ``Trainer`` running ``fit`` with this callback (found on the call stack), so
        ``Trainer(default_root_dir=d)`` resumes from ``d`` by itself. Should that ever fail,
        ``setup`` refuses to start over silently.
        """
        if not self._dirpath_known:
            trainer = trainer_calling(self)
            if trainer is None:
                self._asked_unknown = True
            else:
                self.dirpath, self._dirpath_known = local_path(str(trainer.default_root_dir)), True
        path = join(str(self.dirpath), self.filename + self.FILE_EXTENSION)
        if not self._choosing:
            return path
        if exists(path) and not usable(path):
            # NOTE: no such file: Lightning looks for another one
            self._skipped, path = path, path + ".skipped"
        # NOTE: Lightning's own search finds no remote last.ckpt: the newer of it and ours
        if is_remote(path):
            return newer(path if exists(path) else None, newest_last(trainer_calling(self))) or path
        return path

    # --- hooks ---------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning has chosen its checkpoint: warnings about any later choice are shown
        quiet_fresh_fit(False)
        self._choosing = False
        verify_loads(trainer.strategy)
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if sum(isinstance(c, ResumeCallback) for c in callbacks) > 1:
            raise ValueError(
                "Trainer(callbacks=[...]) has more than one ResumeCallback; expected exactly one "
                "(each would convert and save the same loaders)"
            )
        if not self._dirpath_known:
            self.dirpath, self._dirpath_known = local_path(str(trainer.default_root_dir)), True
            if self._asked_unknown and stage == "fit" and exists(self.ckpt_path):
                raise RuntimeError(
                    f"ResumeCallback: a preemption checkpoint is waiting in {self.ckpt_path}, but "
                    "this fit() looked for its checkpoint before the callback could learn "
                    "default_root_dir, so it would start over. Pass "
                    f"ResumeCallback(dirpath={self.dirpath!r}) (or "
                    f"fit(ckpt_path={self.ckpt_path!r})) to resume"
                )
        if any(isinstance(c, ModelCheckpoint) for c in callbacks[callbacks.index(self) + 1:]):
            # NOTE: Lightning (ckpt_path="best", its launchers and loggers) reads ModelCheckpoint
            # attributes from trainer.checkpoint_callback, the first Checkpoint in the list: move
            # after the user's. A new list, as the hook loop running now iterates the old one.
            moved = [c for c in callbacks if c is not self] + [self]
            trainer.callbacks = moved  # type: ignore[attr-defined]
        if stage == "fit":
            agree = functools.partial(trainer.strategy.reduce_boolean_decision, all=False)
            if not self._claimed:  # NOTE: every rank
                self._lock, self._claimed = (
                    claim_directory(str(self.dirpath), trainer.is_global_zero, agree),
                    True,
                )
            # NOTE: before the workers learn the signals
            self._requeue = slurm_requeue(trainer, self.preemption)
            self._training.intercept(trainer)
            evaluation_workers_ignore(trainer, self.preemption.signals)

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)  # NOTE: the sanity check runs before on_train_start

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # NOTE: after the restore, whenever the strategy does it
        skipped, self._skipped = self._skipped, None
        if skipped is not None and trainer.ckpt_path is None:
            raise nothing_else_to_resume(skipped)
        if trainer.ckpt_path is None and is_remote(self.dirpath):
            refuse_a_silent_start(checkpoints_in(str(self.dirpath), trainer))
        # NOTE: an earlier job's traces and nothing to resume: said (or refused)
        if trainer.ckpt_path is None:
            resuming_nothing(
                self._lock, functools.partial(trainer.strategy.reduce_boolean_decision, all=False)
            )
        self._training.check_iterated(trainer)
        self._install(trainer)

    def _install(self, trainer: Trainer) -> None:
        # NOTE: installed once Lightning registered its own SIGTERM handler (it composes with ours
        # and, on a signal, kills the launcher's processes, broadcasts inside the handler and then
        # aborts fit with SIGTERMException: no checkpoint, exit 0, and under DDP a hang). Replacing
        # it for our signals leaves one flag, read at the next step boundary by every rank together.
        # One that reached Lightning's handler before (it is registered right before the sanity
        # check) becomes ours.
        self.preemption.install()
        adopt_lightnings_sigterm(trainer, self.preemption)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._generators.step_ended()
        at_step_boundary = (
            batch_idx + 1
        ) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch
        if not at_step_boundary or trainer.global_step % self.check_every_n_steps:
            return
        agree = functools.partial(trainer.strategy.reduce_boolean_decision, all=False)
        if agree(self.preemption.received is not None):
            # NOTE: a kill mid-save leaves the previous whole
            written = save_atomically(trainer, self.ckpt_path)
            self.preempted_at = trainer.global_step
            self._exit_with = preemption_exit_code(
                written,
                trainer.global_step,
                self.exit_code or 0,
                "the newest checkpoint Lightning finds",
            )
            self._requeue.decide(self.preemption.received, agree)
            stop_validating_as_planned(trainer)

    @override
    def on_exception(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        """No save (an exception arrives mid-step; we save at step boundaries); the directory is let
        go."""
        self._let_go()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.preempted_at is None:
            # finished: nothing left to resume from
            trainer.strategy.remove_checkpoint(self.ckpt_path)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.preemption.uninstall()
        if stage != "fit":
            self._choosing = True
            return
        self._let_go()
        written = self.preempted_at is not None and self._exit_with != FAILED_SAVE_EXIT_CODE
        if (
            written
            and trainer.is_global_zero
            and not is_remote(self.dirpath)
            and os.path.exists(self.ckpt_path)
        ):
            # NOTE: a restart resumes from the newest of this file and ModelCheckpoint's last file
            # (by mtime); ModelCheckpoint may still write last.ckpt while the stopping fit winds
            # down, within the same tick
            make_newest(self.ckpt_path, trainer)
        if written:
            self._requeue.after_checkpoint(trainer.is_global_zero)
        quiet_fresh_fit(True)
        self._choosing = True
        if self.preempted_at is not None and (
            self.exit_code is not None or self._exit_with == FAILED_SAVE_EXIT_CODE
        ):
            # NOTE: Lightning's strategy teardown (the DDP wrapper undone) ran before this hook
            leave_process(
                trainer.strategy.barrier if trainer.world_size > 1 else None,
                trainer.global_rank,
                self._exit_with,
            )

    def _let_go(self) -> None:
        if self._lock is not None:
            self._lock.release()
        self._lock, self._claimed = None, False

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = new_entry(
            loaders=[gather_states(loader, self._training.state_at_trainer_step(trainer, loader))
                     for loader in self._training.loaders],
            rng=gather_rng_states(),
        )
        drop_lightning_loader_states(checkpoint)

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            logger.warning(
                "this checkpoint has no loader_resume state (written before ResumeCallback was "
                "added?): the data order restarts from the start of the epoch"
            )
            return
        checked_entry(saved, f"{trainer.ckpt_path}: [{CHECKPOINT_KEY!r}]", needs=("loaders", "rng"))
        self._training.load(saved["loaders"])
        rng = saved["rng"]
        self._generators.to_restore = (
            rng[trainer.global_rank] if trainer.global_rank < len(rng) else None
        )
        drop_lightning_loader_states(checkpoint)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._generators.restore()

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._generators.restore()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._generators.validation_starts(
            trainer.state.fn == "fit" and not trainer.sanity_checking
        )

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._generators.validation_ends()

    # --- loaders -------------------------------------------------------------------------------
    def _resumable(self, loader: DataLoader[Any], rank: int, world_size: int, distributed: bool,
                   index: int) -> ResumableDataLoader[Any]:
        """The same loader, made resumable (``loader_resume.convert``) and sharded; the ``index``-th
        training loader gets its own seed (``loader_seed``). NOTE: under a parallel strategy
        Lightning rebuilds any training loader whose sampler is not a ``DistributedSampler``: ours
        carry one (or a ``ShardedSampler``), so it keeps them.
        """
        return resumable(
            loader,
            seed=loader_seed(self.seed, index),
            keying=self.keying,
            keyed_generators=self.keyed_generators,
            rank=rank,
            world_size=world_size,
            distributed=distributed,
            ignore_signals=self.preemption.signals,
            audit=self.audit,
        )
