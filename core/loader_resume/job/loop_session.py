"""One session of a hand-written training loop: what every front-end for such loops does the same
way.

Accelerate's ``enable_resume`` and Lightning's ``FabricResume`` hand their framework's own ways as a
``Framework`` (how ranks agree, how the job's state goes into a checkpoint directory and comes back
out of one, how a process leaves after a preemption checkpoint); the ``LoopSession`` does the rest:

- step boundaries (``StepBoundaries``) from its loaders' reports (it is their ``BatchRequests``) and
  the optimizers' steps, and ``epochs()``;
- at a boundary, the periodic save and the agreed preemption stop: the checkpoint written whole and
  sealed (``write_sealed``), the SLURM requeue, the exit code (``exit_code`` once written, 74 when
  the write failed), then the framework's way out;
- the checkpoint directory held by one job at a time (``claim``), the remote copy's lease, its
  download before a resume and its upload after each sealed write;
- the automatic resume: the newest complete checkpoint that verifies, never a silent start over a
  job that left traces (``newest_or_start``);
- the front-end's checkpoint entry, written by ``entry`` and read back by ``take`` (its format
  checked; the loaders' states loaded as soon as the loaders exist, this rank's generators right
  before the next batch).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

from loader_resume.distributed import gather_rng_states, gather_states
from loader_resume.job.checkpoint import complete_checkpoints, write_sealed
from loader_resume.job.checkpoint_dir import (
    DirectoryLock,
    claim,
    newest_complete,
    preemption_exit_code,
)
from loader_resume.job.checkpoint_entry import PendingEntry, new_entry
from loader_resume.job.fresh_start import newest_or_start
from loader_resume.job.preemption import Preemption
from loader_resume.job.remote_copy import RemoteCopy, fetch_newer
from loader_resume.job.remote_lease import RemoteLease
from loader_resume.job.slurm import Requeue
from loader_resume.job.step_boundary import ReportingDataLoader, StepBoundaries

__all__ = ["Framework", "LoopHandle", "LoopSession", "SaveEvery"]

logger = logging.getLogger(__name__)


class Framework(Protocol):
    """What a front-end's framework does its own way; every method is called on every rank."""

    @property
    def is_main(self) -> bool:
        """Whether this process writes what one process writes (the manifest, the lock)."""

    @property
    def rank(self) -> int:
        """This process's rank among the job's."""

    @property
    def world_size(self) -> int:
        """How many processes the job has."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective)."""

    def write(self, directory: Path) -> None:
        """The job's state (the model, the optimizer, ``LoopSession.entry``) into the new
        ``directory``, whole once this returns."""

    def load(self, directory: Path) -> None:
        """The complete checkpoint ``directory`` into the job (its entry through
        ``LoopSession.take``)."""

    def leave(self, code: int) -> NoReturn:
        """End this process with ``code`` after a preemption checkpoint, every rank together."""


class SaveEvery:
    """When a ``LoopSession`` saves and stops: ``save_every_n_steps`` (0: only on preemption),
    agreeing on signals every ``check_every_n_steps``, keeping ``keep`` checkpoints, exiting with
    ``exit_code`` after a preemption checkpoint; each checked here, naming ``owner`` (the
    front-end's call) in the error (``None``: checked by the front-end's own configuration)."""

    def __init__(
        self,
        owner: str | None,
        *,
        save_every_n_steps: int = 0,
        check_every_n_steps: int = 1,
        keep: int = 2,
        exit_code: int = 143,
        verify_checksums: bool = True,
    ) -> None:
        for name, value, least in (
            ("save_every_n_steps", save_every_n_steps, 0),
            ("check_every_n_steps", check_every_n_steps, 1),
            ("keep", keep, 1),
            ("exit_code", exit_code, 0),
        ):
            if owner is not None and (type(value) is not int or value < least):
                raise ValueError(f"{owner}({name}={value!r}): expected an int >= {least}")
        self.save_every_n_steps = save_every_n_steps
        self.check_every_n_steps = check_every_n_steps
        self.keep = keep
        self.exit_code = exit_code
        self.verify_checksums = verify_checksums


class LoopSession:
    """The session of one hand-written loop (see the module docstring): one per front-end object.

    Args:
        framework: the framework's own ways.
        checkpoint_dir: the local directory of ``step_N`` checkpoints.
        every: when to save, what to keep, how to exit.
        signals: the signals that request a preemption checkpoint (installed by
            ``preemption.install()``).
        slurm_requeue: after a checkpoint that SIGUSR1 requested inside a SLURM job, ``scontrol
            requeue``.
        remote: the remote copy each sealed checkpoint is uploaded to (``None``: none); ``remote``
            may be set later, before ``hold``.
    """

    def __init__(
        self,
        framework: Framework,
        checkpoint_dir: Path,
        every: SaveEvery,
        *,
        signals: Sequence[str | int],
        slurm_requeue: bool = False,
        remote: RemoteCopy | None = None,
    ) -> None:
        self.framework = framework
        self.checkpoint_dir = checkpoint_dir
        self.every = every
        self.preemption = Preemption(signals)
        self.boundaries = StepBoundaries()
        self.epoch = 0
        """The epoch ``epochs()`` is in (restored by ``take``)."""
        self.loaders: list[ReportingDataLoader] = []
        """The loop's loaders, in the order their states are saved."""
        self.loaded_from: Path | None = None
        """The checkpoint directory ``resume`` loaded, if any."""
        self.preempted_at: int | None = None
        """The step of the preemption checkpoint, once taken."""
        self.failed_saves = 0
        """Checkpoints that could not be written (each logged as an error)."""
        self.saving = True
        """Whether a step boundary may save (a front-end that has no state to save yet turns it
        off)."""
        self._requeue = Requeue(slurm_requeue)
        # a loaded entry's generators and loader states, until they can go in
        self._entry = PendingEntry()
        self._lock: DirectoryLock | RemoteLease | None = None
        self._held = False
        self._saving: dict[str, Any] | None = None  # what save() gathered before its write
        self.remote = remote

    @property
    def step(self) -> int:
        """Optimizer steps completed (two per batch count two); restored by ``take``."""
        return self.boundaries.step

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``range(num_epochs)``, from the epoch the session is in."""
        while self.epoch < num_epochs:
            yield self.epoch
            self.epoch += 1
            self.boundaries.epoch_ended()

    def hold(self) -> None:
        """Hold the checkpoint directory, and the remote copy's lease, for this job (every rank;
        once until ``close``): another job there, or a store that cannot be reached, is refused on
        every rank."""
        if self._held:
            return
        framework = self.framework
        self._lock = claim(self.checkpoint_dir, main=framework.is_main, agree=framework.any_rank)
        if self.remote is not None:
            self.remote.hold(main=framework.is_main, agree=framework.any_rank)
        self._held = True

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint that verifies (the remote copy's newer ones
        downloaded first) through ``Framework.load``; or, with none, say what an earlier job left
        (``newest_or_start``). Every rank."""
        framework = self.framework
        fetch_newer(self.remote, main=framework.is_main, agree=framework.any_rank)
        found = newest_or_start(self.checkpoints(), self._lock, framework.any_rank)
        if found is not None:  # NOTE: verified by newest_or_start
            logger.info("resuming from %s", found)
            framework.load(found)
            self.loaded_from = found
        return self.loaded_from

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``checkpoint_dir``, oldest first."""
        return complete_checkpoints(self.checkpoint_dir)

    def save(self) -> Path | None:
        """Checkpoint now (every rank): ``Framework.write`` into ``checkpoint_dir/step_<step>/``,
        sealed and renamed whole, copied to the remote; checkpoints beyond ``keep`` deleted. A
        failed write on any rank is agreed by all: logged naming the path and the cause, the
        previous checkpoints stay, ``None``."""
        framework, every = self.framework, self.every
        final = self.checkpoint_dir / f"step_{self.step:09d}"
        # NOTE: every collective before any write: a failed write cannot unpair them
        self._saving = self._gathered()
        try:
            written = write_sealed(
                final,
                framework.write,
                main=framework.is_main,
                agree=framework.any_rank,
                step=self.step,
                checksums=every.verify_checksums,
                keep=every.keep,
                copy=self.remote.upload if self.remote else None,
            )
        finally:
            self._saving = None
        if not written:
            self.failed_saves += 1
            return None
        logger.info("checkpoint written at step %d: %s", self.step, final)
        return final

    def close(self) -> None:
        """Signal handlers uninstalled, the directory and the remote copy let go (``hold`` takes
        them again)."""
        self.preemption.uninstall()
        for held in (self._lock, self.remote):
            if held is not None:
                held.release()
        self._lock, self._held = None, False

    # --- the checkpoint entry ---------------------------------------------------------------------
    def add(self, loader: ReportingDataLoader) -> None:
        """A loader of the loop, reporting to this session (its state saved after the ones added
        before it)."""
        self.loaders.append(loader)
        self._entry.apply(self.loaders)

    def entry(self, **fields: Any) -> dict[str, Any]:
        """The front-end's checkpoint entry now, with ``fields``: the step, the epoch, the world
        size, every rank's loader states (a loop's pass it left ends there) and generators. A
        collective (every rank), except inside ``save``, which gathered them before its write
        began."""
        gathered = self._saving if self._saving is not None else self._gathered()
        return new_entry(
            step=self.step,
            epoch=self.epoch,
            world_size=self.framework.world_size,
            **fields,
            **gathered,
        )

    def _gathered(self) -> dict[str, Any]:
        left = self.boundaries.left
        return {"loaders": [gather_states(loader, loader.resume_state(pass_ended=left(loader)))
                            for loader in self.loaders],
                "rng": gather_rng_states()}

    def take(self, saved: Any, where: str | Path) -> dict[str, Any]:
        """An entry found at ``where``, checked (``CheckpointError`` naming it): its step and epoch
        now the session's, its loader states and this rank's generators restored as soon as they can
        be."""
        entry = self._entry.read(saved, where, self.framework.rank)
        self.boundaries.reset(entry["step"])
        self.epoch = entry["epoch"]
        self._entry.apply(self.loaders)
        return entry

    # --- step boundaries (``BatchRequests``: the loaders report here) -----------------------------
    def before_batch(self, loader: ReportingDataLoader) -> None:
        """A loader is asked for a batch: a loaded checkpoint's generators go back; a step boundary
        is here."""
        self._entry.restore_rng()  # right before the first step after a load
        if self.boundaries.crossed(loader):
            self._boundary()

    def delivered(self, loader: ReportingDataLoader) -> None:
        """A loader handed a batch to the loop."""
        self.boundaries.delivered(loader)

    def ran_out(self, loader: ReportingDataLoader) -> None:
        """A loader's pass ran out (a shorter loader under ``zip`` ends the loop's pass of the
        others)."""
        self.boundaries.ran_out(loader)

    def _boundary(self) -> None:
        if not self.saving:
            return
        framework, every, boundaries = self.framework, self.every, self.boundaries
        preempted = boundaries.reached(every.check_every_n_steps) and framework.any_rank(
            self.preemption.received is not None)
        written = self.save() if preempted or boundaries.reached(every.save_every_n_steps) else None
        if not preempted:  # NOTE: a failed periodic save: training goes on
            return
        self.preempted_at = self.step
        self._requeue.decide(self.preemption.received, framework.any_rank)
        code = preemption_exit_code(
            written, self.step, every.exit_code, newest_complete(self.checkpoint_dir)
        )
        if written is not None:
            self._requeue.after_checkpoint(framework.is_main)
        self.preemption.uninstall()
        framework.leave(code)


class LoopHandle:
    """What the object a hand-written loop's front-end hands the user shows of its ``session``: the
    step and epoch the loop is at, what was loaded, the checkpoints, the preemption signals."""

    session: LoopSession

    @property
    def step(self) -> int:
        """Optimizer steps completed: every ``optimizer.step()`` that stepped (a loop that steps
        twice per batch counts two; a step skipped inside gradient accumulation none); restored on
        resume. Checkpoints are named after it (``step_N``) and ``save_every_n_steps`` counts it."""
        return self.session.step

    @property
    def epoch(self) -> int:
        """The epoch ``epochs()`` is in (restored on resume)."""
        return self.session.epoch

    @property
    def loaded_from(self) -> Path | None:
        """The checkpoint directory the resume loaded, if any."""
        return self.session.loaded_from

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go (``step_N`` directories)."""
        return self.session.checkpoint_dir

    @property
    def preemption(self) -> Preemption:
        """The preemption signals' handler (``received``: the signal, once one came)."""
        return self.session.preemption

    @property
    def loaders(self) -> list[ReportingDataLoader]:
        """The loop's loaders, in the order their states are saved."""
        return self.session.loaders

    @property
    def preempted_at(self) -> int | None:
        """The step of the preemption checkpoint, once taken."""
        return self.session.preempted_at

    @property
    def failed_saves(self) -> int:
        """Checkpoints that could not be written (each logged as an error)."""
        return self.session.failed_saves

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``checkpoint_dir``, oldest first."""
        return self.session.checkpoints()
