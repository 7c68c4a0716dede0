"""``FabricResume``: exact mid-epoch resume for Lightning Fabric loops, with preemption checkpoints.

On one ``Fabric``, public APIs only: ``fabric.setup_dataloaders`` returns loaders sharded by us
(``fabric_loader``); ``fabric.save``/``fabric.load`` carry every rank's loader and RNG state under
``checkpoint["loader_resume"]`` (one copy, from rank 0; each rank takes its own part, at another
world size too); a preemption signal leads, at the next step boundary
(``loader_resume.job.step_boundary``) the ranks agree on, to a sealed checkpoint directory and an
exit with ``exit_code``; ``FabricResume.restore`` loads the newest complete one. The docs' Fabric
page has the loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from loader_resume import GENERATORS
from loader_resume.audit.log import audit_from_environment
from loader_resume.job.checkpoint_dir import local_directory
from loader_resume.job.loop_session import LoopHandle, LoopSession, SaveEvery
from loader_resume.job.remote_copy import RemoteCopy
from loader_resume.order.sampler import loader_seed

from .callback import CHECKPOINT_KEY
from .fabric_loader import (
    FabricResumableDataLoader,
    convert,
    leave_launched_process,
    loaded_into,
    referenced,
)
from .integrity import save_whole

__all__ = ["CHECKPOINT_FILE", "FabricResumableDataLoader", "FabricResume"]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.ckpt"
"""The file ``fabric.save`` writes inside a checkpoint directory of ``FabricResume``."""


class FabricResume(LoopHandle):
    """Exact mid-epoch resume for a Lightning Fabric loop; see the module docstring for the whole
    picture.

    Args:
        fabric: the launched ``Fabric`` (one ``FabricResume`` per instance).
        seed: the data order and keyed augmentation seed (see ``ResumableDataLoader``).
        keying: ``"batch"``, ``"sample"`` or ``"off"`` (see ``ResumableDataLoader``).
        keyed_generators: which global generators are keyed inside data loading.
        signals: signals that request a preemption checkpoint (``()`` for none); handled once
            [`restore`][lightning_resume.FabricResume.restore] has the state to save.
        checkpoint_dir: where checkpoints go, a local path (a URL is refused); ``None``:
            ``./resume_checkpoints``.
        remote: an fsspec URL (``s3://bucket/run``) each sealed checkpoint is copied to, its
            manifest last; at ``restore`` the complete ones there newer than the local ones are
            downloaded first (one job holds it).
        save_every_n_steps: also checkpoint every N optimizer steps (0: only on preemption).
        check_every_n_steps: agree on signals every N optimizer steps (one tiny collective each
            time).
        keep: how many complete checkpoints to keep.
        exit_code: the exit status after a preemption checkpoint (143 = 128 + SIGTERM: a scheduler
            requeues).
        verify_checksums: seal checkpoints with SHA-256 checksums (else sizes only).
        slurm_requeue: inside a SLURM job, after a checkpoint requested by SIGUSR1 (``sbatch
            --signal=USR1@90``) the main process runs ``scontrol requeue``
            (``loader_resume.job.slurm``); other signals stop without one.
        audit: a directory or URL each rank logs its batches to, for `loader-resume audit` (else
            $LOADER_RESUME_AUDIT).
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
        every = SaveEvery("FabricResume", save_every_n_steps=save_every_n_steps,
                          check_every_n_steps=check_every_n_steps, keep=keep, exit_code=exit_code,
                          verify_checksums=verify_checksums)
        if isinstance(getattr(fabric, "loader_resume", None), FabricResume):
            raise ValueError(
                "FabricResume(fabric): this Fabric already has one; expected one per Fabric"
            )
        self.fabric = fabric
        self.seed, self.keying, self.keyed_generators = seed, keying, tuple(keyed_generators)
        self.audit = audit_from_environment(audit)
        self._ways = _FabricWays(fabric)
        self.session = LoopSession(
            self._ways,
            local_directory(checkpoint_dir if checkpoint_dir is not None else "resume_checkpoints"),
            every,
            signals=signals,
            slurm_requeue=slurm_requeue,
        )
        self.session.remote = (
            None if remote is None else RemoteCopy(remote, self.checkpoint_dir, keep=keep)
        )
        self.session.saving = False  # NOTE: until restore(state) gives the state to save
        self._hooked = set[int]()
        self._fabric_save, self._fabric_load = fabric.save, fabric.load
        fabric.setup_dataloaders = self.setup_dataloaders  # type: ignore[method-assign]
        fabric.save, fabric.load = self.save_to, self.load_from  # type: ignore[method-assign]
        fabric.loader_resume = self  # type: ignore[attr-defined]

    # --- the user's API ---------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``range(num_epochs)``, starting at the resumed epoch."""
        return self.session.epochs(num_epochs)

    def setup_dataloaders(self, *dataloaders: DataLoader[Any], use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """``fabric.setup_dataloaders``: each loader as a ``FabricResumableDataLoader`` sharded for
        this rank (``use_distributed_sampler`` is ignored: the loader shards itself); one loader or
        a list, as Fabric returns them. Every rank must call it (the ranks' datasets are
        compared)."""
        if not dataloaders:
            raise ValueError("setup_dataloaders(): expected at least one DataLoader")
        if self.fabric.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"setup_dataloaders(): Fabric has {self.fabric.world_size} processes but none is "
                "started yet; call fabric.launch() first (each rank shards the data by its rank)"
            )
        converted = [self._convert(loader, move_to_device) for loader in dataloaders]
        return converted[0] if len(converted) == 1 else converted

    def restore(self, state: dict[str, Any]) -> Path | None:
        """Start resuming (every rank calls it): ``state`` (the dict you pass to ``fabric.save``,
        with the model and optimizer(s) set up by Fabric) is what checkpoints save; the newest
        complete checkpoint in ``checkpoint_dir`` that verifies is loaded into it. Holds the
        directory, installs the signal handlers. Returns what it loaded."""
        optimizers = [
            value
            for value in state.values()
            if isinstance(getattr(value, "optimizer", value), torch.optim.Optimizer)
        ]
        if not optimizers:
            raise ValueError(
                f"FabricResume.restore(state): state (keys {sorted(state)}) holds no optimizer; "
                "expected the dict you pass to fabric.save, with the optimizer(s) from "
                "fabric.setup (its steps mark where checkpoints may be taken)"
            )
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if id(inner) not in self._hooked:
                self._hooked.add(id(inner))
                self.session.boundaries.hook(inner)
        self._ways.state = state
        self.session.saving = True
        # NOTE: one job per directory, writable, from the first restore on (every rank)
        self.session.hold()
        self.session.preemption.install()
        return self.session.resume()

    def save(self) -> Path | None:
        """Checkpoint now (every rank calls it): the state given to
        [`restore`][lightning_resume.FabricResume.restore], by ``fabric.save`` into
        ``checkpoint_dir/step_<step>/``, atomically; checkpoints beyond ``keep`` are deleted. A
        failed write on any rank is agreed by all: logged, the previous checkpoints stay, ``None``
        is returned."""
        if self._ways.state is None:
            raise RuntimeError(
                "FabricResume.save(): no state to save; call resume.restore(state) first"
            )
        return self.session.save()

    def close(self) -> None:
        """Undo ``FabricResume``: signal handlers, Fabric's methods, the directory lock (set-up
        loaders stay)."""
        self.session.close()
        for name in ("setup_dataloaders", "save", "load", "loader_resume"):
            self.fabric.__dict__.pop(name, None)

    def save_to(self, path: str | Path, state: dict[str, Any],
                filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save``, with every rank's loader and RNG states under
        ``checkpoint["loader_resume"]`` (a collective: every rank calls ``fabric.save``, as Fabric
        requires)."""
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"fabric.save(path, state): state has a key {CHECKPOINT_KEY!r}, which "
                "loader-resume writes; expected another name"
            )
        entry = self.session.entry()
        self._fabric_save(
            path, {**referenced(state, self.loaders), CHECKPOINT_KEY: entry}, filter=filter
        )

    def load_from(self, path: str | Path, state: dict[str, Any] | None = None, strict: bool = True,
                  *, weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load``; a checkpoint's ``loader_resume`` entry goes into the loaders and this
        rank's RNG (restored right before the next batch is fetched)."""
        # NOTE: Fabric.load has weights_only from lightning 2.6.1: passed on only when given (as a
        # stock call would)
        options = {} if weights_only is None else {"weights_only": weights_only}
        if not state:
            loaded = self._fabric_load(path, state, strict, **options)
            return loaded  # type: ignore[no-any-return, unused-ignore]
        given = referenced(state, self.loaders)
        remainder: dict[str, Any] = self._fabric_load(path, given, strict, **options)
        loaded_into(state, given)
        saved = remainder.pop(CHECKPOINT_KEY, None)
        if saved is None:
            logger.warning(
                "%s has no %s entry (saved without FabricResume?): loaders restart their epoch and "
                "the RNG is not restored",
                path,
                CHECKPOINT_KEY,
            )
        else:
            self.session.take(saved, path)
        return remainder

    def _convert(self, loader: DataLoader[Any], move_to_device: bool) -> FabricResumableDataLoader:
        ours = convert(
            loader,
            self.fabric,
            seed=loader_seed(self.seed, len(self.loaders)),
            keying=self.keying,
            keyed_generators=self.keyed_generators,
            signals=self.preemption.signals,
            audit=self.audit,
        )
        ours.attach(self.session, self.fabric.to_device if move_to_device else None)
        self.session.add(ours)
        return ours


class _FabricWays:
    """Fabric's own ways for the loop's session: its collectives, ``fabric.save``/``fabric.load`` of
    the state given to ``FabricResume.restore``, and its launched processes' exit."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        # what checkpoints save (FabricResume.restore's state)
        self.state: dict[str, Any] | None = None

    @property
    def is_main(self) -> bool:
        return bool(self.fabric.is_global_zero)

    @property
    def rank(self) -> int:
        return int(self.fabric.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.fabric.world_size)

    def any_rank(self, flag: bool) -> bool:
        return bool(self.fabric.strategy.reduce_boolean_decision(flag, all=False))

    def write(self, directory: Path) -> None:
        assert self.state is not None  # NOTE: the session saves only once restore(state) was called
        # NOTE: a failed write: agreed by the session
        save_whole(self.fabric, directory / CHECKPOINT_FILE, self.state)

    def load(self, directory: Path) -> None:
        assert self.state is not None
        self.fabric.load(directory / CHECKPOINT_FILE, self.state)

    def leave(self, code: int) -> NoReturn:
        leave_launched_process(self.fabric, code)
        raise AssertionError("leave_launched_process returned")  # NOTE: it raises SystemExit
