"""``FabricResume``: exact mid-epoch resume for Lightning Fabric loops, with preemption checkpoints.

On one ``Fabric``, public APIs only: ``fabric.setup_dataloaders`` returns loaders sharded by us (``fabric_loader``);
``fabric.save``/``fabric.load`` carry every rank's loader and RNG state under ``checkpoint["loader_resume"]`` (one
copy, from rank 0; each rank takes its own part, at another world size too); a preemption signal leads, at the next
step boundary (``loader_resume.job.step_boundary``) the ranks agree on, to a sealed checkpoint directory and an exit
with ``exit_code``; ``FabricResume.restore`` loads the newest complete one. The docs' Fabric page has the loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from loader_resume import GENERATORS
from loader_resume.audit.log import audit_from_environment
from loader_resume.distributed import gather_rng_states, gather_states
from loader_resume.job.checkpoint import CHECKPOINT_FORMAT, complete_checkpoints, write_sealed
from loader_resume.job.checkpoint_dir import (
    DirectoryLock,
    claim,
    local_directory,
    newest_complete,
    preemption_exit_code,
)
from loader_resume.job.checkpoint_entry import PendingEntry
from loader_resume.job.fresh_start import newest_or_start
from loader_resume.job.preemption import Preemption
from loader_resume.job.remote_copy import RemoteCopy, fetch_newer
from loader_resume.job.remote_lease import RemoteLease
from loader_resume.job.slurm import Requeue
from loader_resume.job.step_boundary import ReportingDataLoader, StepBoundaries
from loader_resume.order.sampler import loader_seed

from .callback import CHECKPOINT_KEY
from .fabric_loader import FabricResumableDataLoader, convert, leave_launched_process, loaded_into, referenced
from .integrity import save_whole

__all__ = ["CHECKPOINT_FILE", "FabricResumableDataLoader", "FabricResume"]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.ckpt"
"""The file ``fabric.save`` writes inside a checkpoint directory of ``FabricResume``."""


class FabricResume:
    """Exact mid-epoch resume for a Lightning Fabric loop; see the module docstring for the whole picture.

    Args:
        fabric: the launched ``Fabric`` (one ``FabricResume`` per instance).
        seed: the data order and keyed augmentation seed (see ``ResumableDataLoader``).
        keying: ``"batch"``, ``"sample"`` or ``"off"`` (see ``ResumableDataLoader``).
        keyed_generators: which global generators are keyed inside data loading.
        signals: signals that request a preemption checkpoint (``()`` for none); handled once
            [`restore`][lightning_resume.FabricResume.restore] has the state to save.
        checkpoint_dir: where checkpoints go, a local path (a URL is refused); ``None``: ``./resume_checkpoints``.
        remote: an fsspec URL (``s3://bucket/run``) each sealed checkpoint is copied to, its manifest last; at
            ``restore`` the complete ones there newer than the local ones are downloaded first (one job holds it).
        save_every_n_steps: also checkpoint every N optimizer steps (0: only on preemption).
        check_every_n_steps: agree on signals every N optimizer steps (one tiny collective each time).
        keep: how many complete checkpoints to keep.
        exit_code: the exit status after a preemption checkpoint (143 = 128 + SIGTERM: a scheduler requeues).
        verify_checksums: seal checkpoints with SHA-256 checksums (else sizes only).
        slurm_requeue: inside a SLURM job, after a checkpoint requested by SIGUSR1 (``sbatch --signal=USR1@90``)
            the main process runs ``scontrol requeue`` (``loader_resume.job.slurm``); other signals stop without one.
        audit: a directory or URL each rank logs its batches to, for `loader-resume audit` (else $LOADER_RESUME_AUDIT).
    """

    def __init__(
        self,
        fabric: Fabric,
        *,
        seed: int = 0,
        keying: str = "batch",
        keyed_generators: Sequence[str] = GENERATORS,
        signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1"),
        checkpoint_dir: str | os.PathLike[str] | None = None,
        save_every_n_steps: int = 0,
        check_every_n_steps: int = 1,
        keep: int = 2,
        exit_code: int = 143,
        verify_checksums: bool = True,
        slurm_requeue: bool = False,
        remote: str | None = None,
        audit: str | os.PathLike[str] | None = None,
    ) -> None:
        for name, value, least in (("save_every_n_steps", save_every_n_steps, 0),
                                   ("check_every_n_steps", check_every_n_steps, 1), ("keep", keep, 1),
                                   ("exit_code", exit_code, 0)):
            if type(value) is not int or value < least:
                raise ValueError(f"FabricResume({name}={value!r}): expected an int >= {least}")
        if isinstance(getattr(fabric, "loader_resume", None), FabricResume):
            raise ValueError("FabricResume(fabric): this Fabric already has one; expected one per Fabric")
        self.fabric = fabric
        self.seed, self.keying, self.keyed_generators = seed, keying, tuple(keyed_generators)
        self.audit = audit_from_environment(audit)
        self.checkpoint_dir = local_directory(checkpoint_dir if checkpoint_dir is not None else "resume_checkpoints")
        self.save_every_n_steps, self.check_every_n_steps = save_every_n_steps, check_every_n_steps
        self.keep, self.exit_code, self.verify_checksums = keep, exit_code, verify_checksums
        self.preemption, self._requeue = Preemption(signals), Requeue(slurm_requeue)
        self.epoch = 0
        """The epoch [`epochs`][lightning_resume.FabricResume.epochs] is in (restored on resume)."""
        self.loaded_from: Path | None = None
        """The checkpoint directory [`restore`][lightning_resume.FabricResume.restore] loaded, if any."""
        self.loaders: list[FabricResumableDataLoader] = []
        """The loaders set up so far, in the order their states are saved."""
        self.preempted_at: int | None = None
        """The step of the preemption checkpoint, once taken."""
        self._boundaries, self._claimed, self._hooked = StepBoundaries(), False, set[int]()  # _claimed: see restore
        self._state: dict[str, Any] | None = None
        self._lock: DirectoryLock | RemoteLease | None = None
        self._remote = None if remote is None else RemoteCopy(remote, self.checkpoint_dir, keep=keep)
        self._entry = PendingEntry()  # a loaded checkpoint's generators and loader states, until they can go in
        self._fabric_save, self._fabric_load = fabric.save, fabric.load
        fabric.setup_dataloaders = self.setup_dataloaders  # type: ignore[method-assign]
        fabric.save, fabric.load = self.save_to, self.load_from  # type: ignore[method-assign]
        fabric.loader_resume = self  # type: ignore[attr-defined]

    # --- the user's API ----------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed, each ``optimizer.step()`` (two per batch count two); restored on resume."""
        return self._boundaries.step

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``range(num_epochs)``, starting at the resumed epoch."""
        while self.epoch < num_epochs:
            yield self.epoch
            self.epoch += 1
            self._boundaries.epoch_ended()

    def setup_dataloaders(self, *dataloaders: DataLoader[Any], use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """``fabric.setup_dataloaders``: each loader as a ``FabricResumableDataLoader`` sharded for this
        rank (``use_distributed_sampler`` is ignored: the loader shards itself); one loader or a list, as
        Fabric returns them. Every rank must call it (the ranks' datasets are compared)."""
        if not dataloaders:
            raise ValueError("setup_dataloaders(): expected at least one DataLoader")
        if self.fabric.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"setup_dataloaders(): Fabric has {self.fabric.world_size} processes but none is "
                               "started yet; call fabric.launch() first (each rank shards the data by its rank)")
        converted = [self._convert(loader, move_to_device) for loader in dataloaders]
        return converted[0] if len(converted) == 1 else converted

    def restore(self, state: dict[str, Any]) -> Path | None:
        """Start resuming (every rank calls it): ``state`` (the dict you pass to ``fabric.save``, with the model and
        optimizer(s) set up by Fabric) is what checkpoints save; the newest complete checkpoint in ``checkpoint_dir``
        that verifies is loaded into it. Holds the directory, installs the signal handlers. Returns what it loaded."""
        optimizers = [value for value in state.values() if isinstance(getattr(value, "optimizer", value),
                                                                          torch.optim.Optimizer)]
        if not optimizers:
            raise ValueError(f"FabricResume.restore(state): state (keys {sorted(state)}) holds no optimizer; "
                             "expected the dict you pass to fabric.save, with the optimizer(s) from fabric.setup "
                             "(its steps mark where checkpoints may be taken)")
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if id(inner) not in self._hooked:
                self._hooked.add(id(inner))
                self._boundaries.hook(inner)
        self._state = state
        if not self._claimed:  # NOTE: one job per directory, writable, from the first restore on (every rank)
            self._lock = claim(self.checkpoint_dir, main=self.fabric.is_global_zero, agree=self._any_rank)
            if self._remote is not None:
                self._remote.hold(main=self.fabric.is_global_zero, agree=self._any_rank)
            self._claimed = True
        self.preemption.install()
        fetch_newer(self._remote, main=self.fabric.is_global_zero, agree=self._any_rank)
        found = newest_or_start(self.checkpoints(), self._lock, self._any_rank)
        if found is not None:
            logger.info("resuming from %s", found)
            self.fabric.load(found / CHECKPOINT_FILE, state)
            self.loaded_from = found
        return self.loaded_from

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``checkpoint_dir``, oldest first."""
        return complete_checkpoints(self.checkpoint_dir)

    def save(self) -> Path | None:
        """Checkpoint now (every rank calls it): the state given to [`restore`][lightning_resume.FabricResume.restore],
        by ``fabric.save`` into ``checkpoint_dir/step_<step>/``, atomically; checkpoints beyond ``keep`` are deleted.
        A failed write on any rank is agreed by all: logged, the previous checkpoints stay, ``None`` is returned."""
        if self._state is None:
            raise RuntimeError("FabricResume.save(): no state to save; call resume.restore(state) first")
        state, fabric = self._state, self.fabric
        final = self.checkpoint_dir / f"step_{self.step:09d}"

        def write_into(directory: Path) -> None:
            save_whole(fabric, directory / CHECKPOINT_FILE, state)  # NOTE: a failed write: agreed by write_sealed

        if not write_sealed(final, write_into, main=fabric.is_global_zero, agree=self._any_rank, step=self.step,
                            checksums=self.verify_checksums, keep=self.keep,
                            copy=self._remote.upload if self._remote else None):
            return None
        logger.info("checkpoint written at step %d: %s", self.step, final)
        return final

    def close(self) -> None:
        """Undo ``FabricResume``: signal handlers, Fabric's methods, the directory lock (set-up loaders stay)."""
        self.preemption.uninstall()
        for held in (self._lock, self._remote):
            if held is not None:
                held.release()
        self._lock, self._claimed = None, False
        for name in ("setup_dataloaders", "save", "load", "loader_resume"):
            self.fabric.__dict__.pop(name, None)

    def save_to(self, path: str | Path, state: dict[str, Any],
                filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save``, with every rank's loader and RNG states under ``checkpoint["loader_resume"]``
        (a collective: every rank calls ``fabric.save``, as Fabric requires)."""
        if CHECKPOINT_KEY in state:
            raise ValueError(f"fabric.save(path, state): state has a key {CHECKPOINT_KEY!r}, which loader-resume "
                             "writes; expected another name")
        entry = {
            "format": CHECKPOINT_FORMAT, "step": self.step, "epoch": self.epoch, "world_size": self.fabric.world_size,
            "loaders": [gather_states(loader, loader.resume_state(pass_ended=self._boundaries.left(loader)))
                        for loader in self.loaders],
            "rng": gather_rng_states(),
        }
        self._fabric_save(path, {**referenced(state, self.loaders), CHECKPOINT_KEY: entry}, filter=filter)

    def load_from(self, path: str | Path, state: dict[str, Any] | None = None, strict: bool = True,
                  *, weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load``; a checkpoint's ``loader_resume`` entry goes into the loaders and this rank's RNG
        (restored right before the next batch is fetched)."""
        # NOTE: Fabric.load has weights_only from lightning 2.6.1: passed on only when given (as a stock call would)
        options = {} if weights_only is None else {"weights_only": weights_only}
        if not state:
            return self._fabric_load(path, state, strict, **options)  # type: ignore[no-any-return, unused-ignore]
        given = referenced(state, self.loaders)
        remainder: dict[str, Any] = self._fabric_load(path, given, strict, **options)
        loaded_into(state, given)
        saved = remainder.pop(CHECKPOINT_KEY, None)
        if saved is None:
            logger.warning("%s has no %s entry (saved without FabricResume?): loaders restart their epoch and the "
                           "RNG is not restored", path, CHECKPOINT_KEY)
        else:
            self._apply(saved, path)
        return remainder

    def _apply(self, saved: Any, path: str | Path) -> None:
        saved = self._entry.read(saved, path, self.fabric.global_rank)
        self._boundaries.reset(saved["step"])
        self.epoch = saved["epoch"]
        self._entry.apply(self.loaders)

    # --- loaders and step boundaries ----------------------------------------------------------------
    def _convert(self, loader: DataLoader[Any], move_to_device: bool) -> FabricResumableDataLoader:
        ours = convert(loader, self.fabric, seed=loader_seed(self.seed, len(self.loaders)), keying=self.keying,
                       keyed_generators=self.keyed_generators, signals=self.preemption.signals, audit=self.audit)
        ours.attach(self, self.fabric.to_device if move_to_device else None)
        self.loaders.append(ours)
        self._entry.apply(self.loaders)
        return ours

    def _any_rank(self, flag: bool) -> bool:
        return bool(self.fabric.strategy.reduce_boolean_decision(flag, all=False))

    def before_batch(self, loader: ReportingDataLoader) -> None:
        """A loader is asked for a batch: the RNG of a loaded checkpoint goes back here; a step boundary is here."""
        self._entry.restore_rng()  # right before the first step after a load
        if self._boundaries.crossed(loader):
            self._boundary()

    def delivered(self, loader: ReportingDataLoader) -> None:
        """A loader handed a batch to the loop."""
        self._boundaries.delivered(loader)

    def ran_out(self, loader: ReportingDataLoader) -> None:
        """A loader's pass ran out (a shorter loader under ``zip`` ends the loop's pass of the others)."""
        self._boundaries.ran_out(loader)

    def _boundary(self) -> None:
        if self._state is None:
            return  # restore(state) was not called: nothing to save
        signalled = self.preemption.received is not None
        preempted = self._boundaries.reached(self.check_every_n_steps) and self._any_rank(signalled)
        written = self.save() if preempted or self._boundaries.reached(self.save_every_n_steps) else None
        if preempted:
            self.preempted_at = self.step
            self._requeue.decide(self.preemption.received, self._any_rank)
            code = preemption_exit_code(written, self.step, self.exit_code, newest_complete(self.checkpoint_dir))
            if written is not None:
                self._requeue.after_checkpoint(self.fabric.is_global_zero)
            self.preemption.uninstall()
            leave_launched_process(self.fabric, code)
