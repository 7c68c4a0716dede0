"""``enable_resume(accelerator)``: exact mid-epoch resume, automatic resume and preemption
checkpoints.

How it hooks in, with public Accelerate APIs only:
- ``accelerator.prepare`` is wrapped (on this instance): DataLoaders become
  ``AcceleratedResumableDataLoader``s sharded by us; everything else goes to Accelerate's own
  ``prepare`` unchanged. Optimizers get a step post-hook (torch's public
  ``register_step_post_hook``), which fires only on real steps — not on skipped accumulation steps.
- A *step boundary* is a request for the next batch, after an optimizer step, from a loader that
  delivered a batch before that step: an evaluation loader iterated after the step is no boundary,
  and gradient accumulation is never split. Without an optimizer passed to ``prepare`` there are no
  boundaries (nothing is saved by itself; ``Resume.save()`` still works).
- ``accelerator.load_state`` is wrapped too: see ``accelerate_resume.fsdp`` (torch's first FSDP,
  sharded).
- ``save_state``/``load_state`` pre-hooks put every rank's loader state and RNG states in
  ``loader_resume.pt`` of the checkpoint directory, so the user's own ``save_state`` calls carry
  them too.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from loader_resume.convert import sharded_resumable
from loader_resume.distributed import any_rank
from loader_resume.job.checkpoint import verify
from loader_resume.job.checkpoint_dir import local_directory
from loader_resume.job.loop_session import LoopHandle, LoopSession, SaveEvery
from loader_resume.job.remote_copy import RemoteCopy
from loader_resume.job.step_boundary import ReportingDataLoader
from loader_resume.order.sampler import loader_seed
from loader_resume.thirdparty import accelerator_mode, mark_accelerator

from .config import ResumeConfig, load_config
from .fsdp import filling_load_state
from .loader import AcceleratedResumableDataLoader, placed
from .saving import STATE_FILE, read_state, save_state_to

__all__ = ["STATE_FILE", "Resume", "enable_resume"]

logger = logging.getLogger(__name__)


def enable_resume(accelerator: Accelerator,
                  config: str | os.PathLike[str] | Mapping[str, Any] | DictConfig | None = None,
                  overrides: Sequence[str] = ()) -> Resume:
    """Arm ``accelerator`` for exact resume; call it before ``accelerator.prepare``.

    Args:
        config: a YAML file, dict or DictConfig of [`ResumeConfig`][accelerate_resume.ResumeConfig]
            keys; ``None``: the
            defaults (``configs/accelerate_resume.yaml``): SIGTERM and SIGUSR1 handled, checkpoints
                under
            ``project_dir``, automatic resume on. Either way ``$LOADER_RESUME_CONFIG`` (a YAML file,
            when ``config`` is no path) and ``LOADER_RESUME_<FIELD>`` variables are read on every
            process (see [`load_config`][accelerate_resume.load_config]: argument > variable > YAML
            > default); ``LOADER_RESUME_ENABLED=0`` switches it all off without a code change.
        overrides: an omegaconf dotlist applied last, e.g. the ``key=value`` words of ``sys.argv``.
    """
    return Resume(accelerator, load_config(config, overrides))


class Resume(LoopHandle):
    """The handle ``enable_resume`` returns: ``epochs()``, ``step``, ``epoch``, ``restore()``,
    ``save()``, ``checkpoints()``, ``close()``."""

    def __init__(self, accelerator: Accelerator, config: ResumeConfig) -> None:
        if accelerator_mode(accelerator) == "resume":
            raise ValueError(
                "enable_resume(accelerator) was already called for this Accelerator; expected once"
            )
        if accelerator.split_batches:
            raise ValueError(
                "enable_resume: Accelerator(split_batches=True) is not supported; expected "
                "per-process batch sizes (the default)"
            )
        self.accelerator, self.config = accelerator, config
        root = config.checkpoint_dir or os.path.join(
            accelerator.project_dir or os.getcwd(), "resume_checkpoints"
        )
        every = SaveEvery(None, save_every_n_steps=config.save_every_n_steps,
                          check_every_n_steps=config.check_every_n_steps, keep=config.keep,
                          exit_code=config.exit_code, verify_checksums=config.verify_checksums)
        # NOTE: the settings are checked by ResumeConfig; Accelerate's save_state writes local
        # directories
        self.session = LoopSession(_AccelerateWays(accelerator), local_directory(root), every,
                                   signals=config.signals, slurm_requeue=config.slurm_requeue)
        self._started = False
        self._prepare = accelerator.prepare
        if not config.enabled:
            self._started = True  # nothing to resume from
            self._handles = []
            mark_accelerator(accelerator, "stock")  # see refuse_stock_accelerate
            logger.warning(
                "loader-resume is switched off (enabled=False, e.g. LOADER_RESUME_ENABLED=0): "
                "Accelerate's own loaders, no preemption checkpoints, no automatic resume"
            )
            return
        accelerator.prepare = self._prepare_hooked  # type: ignore[method-assign]
        accelerator.load_state = filling_load_state(accelerator)  # type: ignore[method-assign]
        self._handles = [accelerator.register_save_state_pre_hook(self._on_save_state),
                         accelerator.register_load_state_pre_hook(self._on_load_state)]
        mark_accelerator(accelerator, "resume")
        try:
            if config.remote is not None:
                self.session.remote = RemoteCopy(
                    config.remote, self.session.checkpoint_dir, keep=config.keep
                )
            self.session.hold()
        except Exception:
            self.close()
            # NOTE: every process is here; gloo aborts a process leaving a live group
            accelerator.end_training()
            raise
        self.session.preemption.install()

    # --- the user's API ---------------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """``range(num_epochs)``, starting at the resumed epoch (resuming first, if configured)."""
        # NOTE: at the first next(), as a generator: after prepare() has registered the model
        self.restore()
        yield from self.session.epochs(num_epochs)

    def close(self) -> None:
        """Undo ``enable_resume``: signal handlers, ``prepare``, hooks, directory lock (prepared
        loaders stay)."""
        if not self.config.enabled:
            # not one another enable_resume has made since
            if accelerator_mode(self.accelerator) == "stock":
                mark_accelerator(self.accelerator, None)
            return
        self.session.close()
        self.session.remote = None  # NOTE: saves after close() stay local (its lease is let go)
        for handle in self._handles:
            handle.remove()
        accelerator = self.accelerator
        del accelerator.prepare
        del accelerator.load_state
        mark_accelerator(accelerator, None)

    def save(self) -> Path | None:
        """Checkpoint now (all processes call it): ``save_state`` into a temporary directory, seal
        it with a manifest, rename it to ``step_<step>``, delete checkpoints beyond ``keep``.

        A failed write (a full disk, a lost mount) on any process is agreed by all: the partial
        directory is removed, the error is logged naming the path and the cause, the previous
        checkpoints stay and ``None`` is returned (a periodic save: training goes on; at preemption:
        exit 74). Switched off (``enabled=False``): nothing is written, ``None``.
        """
        if not self.config.enabled:
            logger.warning(
                "Resume.save(): loader-resume is switched off (enabled=False); nothing written"
            )
            return None
        return self.session.save()

    def load(self, directory: str | os.PathLike[str]) -> None:
        """``accelerator.load_state(directory)`` after verifying its manifest (all processes call
        it)."""
        verify(Path(directory))
        self.accelerator.load_state(os.fspath(directory))
        self.session.loaded_from = Path(directory)

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
                    self.session.boundaries.hook(obj)
        return results[0] if len(results) == 1 else tuple(results)

    def _convert(
        self, loader: DataLoader[Any], placement: bool | None
    ) -> AcceleratedResumableDataLoader:
        config, accelerator, session = self.config, self.accelerator, self.session
        ours = sharded_resumable(
            loader,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            loader_class=AcceleratedResumableDataLoader,
            keying=config.keying,
            audit=config.audit,
            # each loader its own values
            seed=loader_seed(config.seed, len(session.loaders)),
            keyed_generators=config.keyed_generators,
            ignore_signals=session.preemption.signals,
        )
        ours.attach_accelerate(self, *placed(self.accelerator, placement))
        session.add(ours)
        return ours

    # --- step boundaries (the loaders report here) ------------------------------------------------
    def delivered(self, loader: ReportingDataLoader) -> None:
        """A loader handed a batch to the loop."""
        self.session.delivered(loader)

    def ran_out(self, loader: ReportingDataLoader) -> None:
        """A loader's pass ran out (a shorter loader under ``zip`` ends the loop's pass of the
        others)."""
        self.session.ran_out(loader)

    def before_batch(self, loader: ReportingDataLoader) -> None:
        """A loader is asked for a batch: automatic resume, the RNG of a loaded checkpoint and step
        boundaries happen here."""
        self.restore()
        self.session.before_batch(loader)

    def restore(self) -> Path | None:
        """Load the newest complete checkpoint that verifies now, if ``auto_resume`` (all processes
        call it; only the first call acts; else at the first ``epochs()`` or batch). Returns the
        checkpoint loaded, if any."""
        if not self._started:
            self._started = True
            if self.config.auto_resume:
                self.session.resume()
        return self.session.loaded_from

    # --- save_state / load_state ------------------------------------------------------------------
    def _on_save_state(self, models: Any, weights: Any, output_dir: str) -> None:
        # NOTE: every process runs this (the entry is a collective), ours and the user's own
        # save_state alike
        entry = self.session.entry(accelerator_step=self.accelerator.step)
        if self.accelerator.is_main_process:
            torch.save(entry, os.path.join(output_dir, STATE_FILE))

    def _on_load_state(self, models: Any, input_dir: str) -> None:
        path = os.path.join(input_dir, STATE_FILE)
        if (state := read_state(path)) is None:
            return
        state = self.session.take(state, path)
        self.accelerator.step = state["accelerator_step"]


class _AccelerateWays:
    """Accelerate's own ways for the loop's session: ``torch.distributed`` collectives,
    ``save_state`` / ``load_state`` of a checkpoint directory, ``end_training`` before the exit."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def rank(self) -> int:
        return int(self.accelerator.process_index)

    @property
    def world_size(self) -> int:
        return int(self.accelerator.num_processes)

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag)

    def write(self, directory: Path) -> None:
        save_state_to(self.accelerator, directory)

    def load(self, directory: Path) -> None:
        self.accelerator.load_state(os.fspath(directory))

    def leave(self, code: int) -> NoReturn:
        # NOTE: every process is here. Tear the process group down before the interpreter does: gloo
        # aborts a process (SIGABRT) whose worker threads still hold collectives' tensors at exit.
        self.accelerator.wait_for_everyone()
        gc.collect()
        self.accelerator.end_training()
        raise SystemExit(code)
