"""``enable_resume(accelerator)``: exact mid-epoch resume, automatic resume and preemption checkpoints.

How it hooks in, with public Accelerate APIs only:
- ``accelerator.prepare`` is wrapped (on this instance): DataLoaders become
  ``AcceleratedResumableDataLoader``s sharded by us; everything else goes to Accelerate's own
  ``prepare`` unchanged. Optimizers get a step post-hook (torch's public
  ``register_step_post_hook``), which fires only on real steps — not on skipped accumulation steps.
- A *step boundary* is a request for the next batch, after an optimizer step, from a loader that
  delivered a batch before that step: an evaluation loader iterated after the step is no boundary,
  and gradient accumulation is never split. Without an optimizer passed to ``prepare`` there are no
  boundaries (nothing is saved by itself; ``Resume.save()`` still works).
- ``accelerator.load_state`` is wrapped too: see ``accelerate_resume.fsdp`` (torch's first FSDP, sharded).
- ``save_state``/``load_state`` pre-hooks put every rank's loader state and RNG states in
  ``loader_resume.pt`` of the checkpoint directory, so the user's own ``save_state`` calls carry them too.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from loader_resume.convert import sharded_resumable
from loader_resume.distributed import any_rank, gather_rng_states, gather_states
from loader_resume.job.checkpoint import (
    CHECKPOINT_FORMAT,
    complete_checkpoints,
    verify,
)
from loader_resume.job.checkpoint_dir import (
    claim,
    local_directory,
    newest_complete,
    preemption_exit_code,
)
from loader_resume.job.checkpoint_entry import PendingEntry
from loader_resume.job.fresh_start import newest_or_start
from loader_resume.job.preemption import Preemption
from loader_resume.job.remote_copy import fetch_newer, start_remote_copy
from loader_resume.job.slurm import Requeue
from loader_resume.job.step_boundary import ReportingDataLoader, StepBoundaries
from loader_resume.order.sampler import loader_seed
from loader_resume.thirdparty import accelerator_mode, mark_accelerator

from .config import ResumeConfig, load_config
from .fsdp import filling_load_state
from .loader import AcceleratedResumableDataLoader, placed
from .saving import STATE_FILE, read_state, write_checkpoint

__all__ = ["STATE_FILE", "Resume", "enable_resume"]

logger = logging.getLogger(__name__)


def enable_resume(accelerator: Accelerator,
                  config: str | os.PathLike[str] | Mapping[str, Any] | DictConfig | None = None,
                  overrides: Sequence[str] = ()) -> Resume:
    """Arm ``accelerator`` for exact resume; call it before ``accelerator.prepare``.

    Args:
        config: a YAML file, dict or DictConfig of [`ResumeConfig`][accelerate_resume.ResumeConfig] keys; ``None``: the
            defaults (``configs/accelerate_resume.yaml``): SIGTERM and SIGUSR1 handled, checkpoints under
            ``project_dir``, automatic resume on. Either way ``$LOADER_RESUME_CONFIG`` (a YAML file, when
            ``config`` is no path) and ``LOADER_RESUME_<FIELD>`` variables are read on every process
            (see [`load_config`][accelerate_resume.load_config]: argument > variable > YAML > default);
            ``LOADER_RESUME_ENABLED=0`` switches it all off without a code change.
        overrides: an omegaconf dotlist applied last, e.g. the ``key=value`` words of ``sys.argv``.
    """
    return Resume(accelerator, load_config(config, overrides))


class Resume:
    """The handle ``enable_resume`` returns: ``epochs()``, ``step``, ``epoch``, ``restore()``, ``save()``,
    ``checkpoints()``, ``close()``."""

    def __init__(self, accelerator: Accelerator, config: ResumeConfig) -> None:
        if accelerator_mode(accelerator) == "resume":
            raise ValueError("enable_resume(accelerator) was already called for this Accelerator; expected once")
        if accelerator.split_batches:
            raise ValueError("enable_resume: Accelerator(split_batches=True) is not supported; expected per-process "
                             "batch sizes (the default)")
        self.accelerator, self.config = accelerator, config
        root = config.checkpoint_dir or os.path.join(accelerator.project_dir or os.getcwd(), "resume_checkpoints")
        self.checkpoint_dir = local_directory(root)  # NOTE: Accelerate's save_state writes local directories
        self._boundaries = StepBoundaries()
        self.epoch = 0
        """The epoch ``epochs()`` is in (restored on resume)."""
        self.preemption = Preemption(config.signals)
        self._requeue = Requeue(config.slurm_requeue)
        self.loaded_from: Path | None = None
        self.failed_saves = 0
        """Checkpoints that could not be written (each logged as an error)."""
        self._collected: dict[str, Any] | None = None  # gathered before our own save_state (see save)
        self._loaders: list[AcceleratedResumableDataLoader] = []
        self._entry = PendingEntry()  # a loaded checkpoint's generators and loader states, until they can go in
        self._started = False
        self._prepare = accelerator.prepare
        if not config.enabled:
            self._started = True  # nothing to resume from
            self._handles = []
            mark_accelerator(accelerator, "stock")  # see refuse_stock_accelerate
            logger.warning("loader-resume is switched off (enabled=False, e.g. LOADER_RESUME_ENABLED=0): "
                           "Accelerate's own loaders, no preemption checkpoints, no automatic resume")
            return
        accelerator.prepare = self._prepare_hooked  # type: ignore[method-assign]
        accelerator.load_state = filling_load_state(accelerator)  # type: ignore[method-assign]
        self._handles = [accelerator.register_save_state_pre_hook(self._on_save_state),
                         accelerator.register_load_state_pre_hook(self._on_load_state)]
        mark_accelerator(accelerator, "resume")
        self._lock, self._remote = None, None
        try:
            self._lock = claim(self.checkpoint_dir, main=accelerator.is_main_process, agree=any_rank)
            self._remote = start_remote_copy(config.remote, self.checkpoint_dir, keep=config.keep,
                                             main=accelerator.is_main_process, agree=any_rank)
        except Exception:
            self.close()
            accelerator.end_training()  # NOTE: every process is here; gloo aborts a process leaving a live group
            raise
        self.preemption.install()

    # --- the user's API ----------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps completed, every ``optimizer.step()`` that stepped (a loop that steps twice per batch
        counts two; a step skipped inside ``accumulate`` none); restored on resume. Checkpoints are named after
        it (``step_N``) and ``save_every_n_steps`` counts it."""
        return self._boundaries.step

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``range(num_epochs)``, starting at the resumed epoch (resuming first, if configured)."""
        self.restore()
        while self.epoch < num_epochs:
            yield self.epoch
            self.epoch += 1
            self._boundaries.epoch_ended()

    def close(self) -> None:
        """Undo ``enable_resume``: signal handlers, ``prepare``, hooks, directory lock (prepared loaders stay)."""
        if not self.config.enabled:
            if accelerator_mode(self.accelerator) == "stock":  # not one another enable_resume has made since
                mark_accelerator(self.accelerator, None)
            return
        self.preemption.uninstall()
        for held in (self._lock, self._remote):
            if held is not None:
                held.release()
        self._lock = self._remote = None
        for handle in self._handles:
            handle.remove()
        accelerator = self.accelerator
        del accelerator.prepare
        del accelerator.load_state
        mark_accelerator(accelerator, None)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints in ``checkpoint_dir``, oldest first."""
        return complete_checkpoints(self.checkpoint_dir)

    def save(self) -> Path | None:
        """Checkpoint now (all processes call it): ``save_state`` into a temporary directory, seal it
        with a manifest, rename it to ``step_<step>``, delete checkpoints beyond ``keep``.

        A failed write (a full disk, a lost mount) on any process is agreed by all: the partial
        directory is removed, the error is logged naming the path and the cause, the previous checkpoints
        stay and ``None`` is returned (a periodic save: training goes on; at preemption: exit 74). Switched
        off (``enabled=False``): nothing is written, ``None``.
        """
        if not self.config.enabled:
            logger.warning("Resume.save(): loader-resume is switched off (enabled=False); nothing written")
            return None
        final = self.checkpoint_dir / f"step_{self.step:09d}"
        self._collected = self._collect()  # every collective before any write: a failed write cannot unpair them
        try:
            written = write_checkpoint(self.accelerator, final, step=self.step, checksums=self.config.verify_checksums,
                                       keep=self.config.keep, copy=self._remote.upload if self._remote else None)
        finally:
            self._collected = None
        if not written:
            self.failed_saves += 1
            return None
        logger.info("checkpoint written at step %d: %s", self.step, final)
        return final

    def load(self, directory: str | os.PathLike[str]) -> None:
        """``accelerator.load_state(directory)`` after verifying its manifest (all processes call it)."""
        verify(Path(directory))
        self.accelerator.load_state(os.fspath(directory))
        self.loaded_from = Path(directory)

    # --- prepare ----------------------------------------------------------------------------------
    def _prepare_hooked(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        placements = device_placement or [None] * len(args)
        results: list[Any] = list(args)
        others: list[int] = []
        for i, (obj, placement) in enumerate(zip(args, placements, strict=True)):
            if isinstance(obj, DataLoader):
                results[i] = self._convert(obj, placement)
            else:
                others.append(i)
        if others:
            chosen = None if device_placement is None else [placements[i] for i in others]
            prepared = self._prepare(*[args[i] for i in others], device_placement=chosen)
            for i, obj in zip(others, prepared if len(others) > 1 else (prepared,), strict=True):
                results[i] = obj
                if isinstance(obj, torch.optim.Optimizer):
                    self._boundaries.hook(obj)
        return results[0] if len(results) == 1 else tuple(results)

    def _convert(self, loader: DataLoader[Any], placement: bool | None) -> AcceleratedResumableDataLoader:
        config, accelerator = self.config, self.accelerator
        ours = sharded_resumable(loader, rank=accelerator.process_index, world_size=accelerator.num_processes,
                                 loader_class=AcceleratedResumableDataLoader, keying=config.keying, audit=config.audit,
                                 seed=loader_seed(config.seed, len(self._loaders)),  # each loader its own values
                                 keyed_generators=config.keyed_generators, ignore_signals=self.preemption.signals)
        ours.attach_accelerate(self, *placed(self.accelerator, placement))
        self._loaders.append(ours)
        self._entry.apply(self._loaders)
        return ours

    # --- step boundaries (the loaders report here) ---------------------------------------------------
    def delivered(self, loader: ReportingDataLoader) -> None:
        """A loader handed a batch to the loop."""
        self._boundaries.delivered(loader)

    def ran_out(self, loader: ReportingDataLoader) -> None:
        """A loader's pass ran out (a shorter loader under ``zip`` ends the loop's pass of the others)."""
        self._boundaries.ran_out(loader)

    def before_batch(self, loader: ReportingDataLoader) -> None:
        """A loader is asked for a batch: automatic resume, the RNG of a loaded checkpoint and step boundaries
        happen here."""
        self.restore()
        self._entry.restore_rng()  # right before the first step after a load
        if self._boundaries.crossed(loader):
            self._boundary()

    def _boundary(self) -> None:
        config = self.config
        periodic = self._boundaries.reached(config.save_every_n_steps)
        preempted = self._boundaries.reached(config.check_every_n_steps) and self.preemption.agreed()
        written = self.save() if periodic or preempted else None  # NOTE: a failed periodic save: training goes on
        if preempted:
            self._requeue.decide(self.preemption.received, any_rank)
            code = preemption_exit_code(written, self.step, config.exit_code, newest_complete(self.checkpoint_dir))
            if written is not None:
                self._requeue.after_checkpoint(self.accelerator.is_main_process)
            self.preemption.uninstall()
            # NOTE: every process is here. Tear the process group down before the interpreter does: gloo
            # aborts a process (SIGABRT) whose worker threads still hold collectives' tensors at exit.
            self.accelerator.wait_for_everyone()
            gc.collect()
            self.accelerator.end_training()
            raise SystemExit(code)

    def restore(self) -> Path | None:
        """Load the newest complete checkpoint that verifies now, if ``auto_resume`` (all processes call it; only
        the first call acts; else at the first ``epochs()`` or batch). Returns the checkpoint loaded, if any."""
        if not self._started:
            self._started = True
            if self.config.auto_resume:
                fetch_newer(self._remote, main=self.accelerator.is_main_process, agree=any_rank)
            found = newest_or_start(self.checkpoints(), self._lock, any_rank) if self.config.auto_resume else None
            if found is not None:  # NOTE: verified above
                logger.info("resuming from %s", found)
                self.accelerator.load_state(os.fspath(found))
                self.loaded_from = found
        return self.loaded_from

    # --- save_state / load_state ------------------------------------------------------------------
    def _collect(self) -> dict[str, Any]:
        """What goes into ``loader_resume.pt``; gathers from every process (a collective)."""
        return {"format": CHECKPOINT_FORMAT, "step": self.step, "epoch": self.epoch,
                "accelerator_step": self.accelerator.step, "world_size": self.accelerator.num_processes,
                "loaders": [gather_states(loader, loader.resume_state(pass_ended=self._boundaries.left(loader)))
                            for loader in self._loaders],
                "rng": gather_rng_states()}

    def _on_save_state(self, models: Any, weights: Any, output_dir: str) -> None:
        # NOTE: every process runs this; the gather: here for the user's own save_state, before it for ours (see save)
        state = self._collected if self._collected is not None else self._collect()
        if self.accelerator.is_main_process:
            torch.save(state, os.path.join(output_dir, STATE_FILE))

    def _on_load_state(self, models: Any, input_dir: str) -> None:
        path = os.path.join(input_dir, STATE_FILE)
        if (state := read_state(path)) is None:
            return
        state = self._entry.read(state, path, self.accelerator.process_index)
        self._boundaries.reset(state["step"])
        self.epoch = state["epoch"]
        self.accelerator.step = state["accelerator_step"]
        self._entry.apply(self._loaders)
