"""How a preempted job stops: for ``ResumeCallback``, Lightning's own SIGTERM bookkeeping, the
validation it runs at the step that stops ``fit`` and SLURM's requeue; for it and ``FabricResume``,
the process's exit (``leave_process``)."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment

from loader_resume.job.preemption import Preemption
from loader_resume.job.slurm import Requeue

__all__ = [
    "adopt_lightnings_sigterm",
    "leave_process",
    "slurm_requeue",
    "stop_validating_as_planned",
]


def adopt_lightnings_sigterm(trainer: Trainer, preemption: Preemption) -> None:
    """A SIGTERM that reached Lightning's handler before ours was installed (Lightning registers it
    right before the sanity check) becomes ours: else Lightning raises ``SIGTERMException`` at its
    next step or validation batch, and ``fit`` ends with exit 0 and no checkpoint."""
    if trainer.received_sigterm and signal.SIGTERM in preemption.signals:
        # NOTE: Lightning 2.6 has no public setter
        trainer._signal_connector.received_sigterm = False
        preemption.received = signal.SIGTERM


def stop_validating_as_planned(trainer: Trainer) -> None:
    """``trainer.should_stop``, at a step whose checkpoint is written: the validation due at this
    step runs (after the save), and no other. NOTE: Lightning validates after any step that stops
    ``fit`` (``_should_check_val_fx``), and a resumed fit takes the validation due at its
    checkpoint's step as done."""
    epoch_loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    due = fetcher is not None and epoch_loop._should_check_val_fx(fetcher)
    trainer.should_stop = True
    epoch_loop._skip_next_val = not due


def slurm_requeue(trainer: Trainer, preemption: Preemption) -> Requeue:
    """SLURM's requeue kept: under Lightning's ``SLURMEnvironment`` with ``auto_requeue`` on
    (Lightning's default in a SLURM job), its ``requeue_signal`` (SIGUSR1) requests a preemption
    checkpoint too, and once the checkpoint that signal led to is written the global-zero rank runs
    ``scontrol requeue`` (``loader_resume.job.slurm.Requeue``), as Lightning's own handler does.
    Other signals (SIGTERM: ``scancel``, the time limit) stop without a requeue."""
    # NOTE: as Lightning's signal connector
    environment = trainer._accelerator_connector.cluster_environment
    on = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
    if on:
        requeue = Requeue(on, environment.requeue_signal)  # type: ignore[attr-defined]
    else:
        requeue = Requeue(on, signal.SIGUSR1)
    if requeue.signal is not None and requeue.signal not in preemption.signals:
        preemption.signals = (*preemption.signals, requeue.signal)
    return requeue


def leave_process(barrier: Callable[[], None] | None, rank: int, exit_code: int) -> None:
    """End this process with ``exit_code`` after ``barrier()`` (every rank calls it): the process
    group is torn down first (gloo aborts, SIGABRT, a process that exits with its group alive), and
    a rank that Lightning's or Fabric's launcher started waits for rank 0 to leave."""
    if barrier is not None:
        barrier()
    # NOTE: gloo aborts a process whose worker threads still hold collectives' tensors at exit
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        _outlive_launching_rank()
    raise SystemExit(exit_code)


def _outlive_launching_rank(timeout: float = 60.0) -> None:
    """Wait for the process that launched this one to end, if it is rank 0 running this same
    command.

    NOTE: Fabric's own launcher runs rank 0 as the main process and the other ranks as its children,
    and a thread of rank 0 SIGKILLs everything once a child ends with a non-zero status: a child
    leaving first with ``exit_code`` could get rank 0 killed before it leaves with its own. Under
    torchrun (a parent that is not this command) there is nothing to wait for.
    """
    parent = os.getppid()
    try:
        theirs = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
        mine = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    # NOTE: Fabric starts the other ranks as [sys.executable, abspath(script), *args]: compare the
    # script's name and the arguments, not the paths
    same = len(theirs) == len(mine) > 1 and theirs[2:] == mine[2:] and \
        os.path.basename(theirs[1]) == os.path.basename(mine[1])
    deadline = time.monotonic() + timeout
    while same and os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
