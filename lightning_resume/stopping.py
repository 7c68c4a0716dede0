"""How a preempted ``fit`` stops, seen from ``ResumeCallback``: Lightning's own SIGTERM bookkeeping, the
validation it runs at the step that stops ``fit``, and SLURM's requeue."""

from __future__ import annotations

import signal

from lightning.pytorch import Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment

from loader_resume.preemption import Preemption
from loader_resume.slurm import Requeue

__all__ = ["slurm_requeue", "adopt_lightnings_sigterm", "stop_validating_as_planned"]


def adopt_lightnings_sigterm(trainer: Trainer, preemption: Preemption) -> None:
    """A SIGTERM that reached Lightning's handler before ours was installed (Lightning registers it right before
    the sanity check) becomes ours: else Lightning raises ``SIGTERMException`` at its next step or validation
    batch, and ``fit`` ends with exit 0 and no checkpoint."""
    if trainer.received_sigterm and signal.SIGTERM in preemption.signals:
        trainer._signal_connector.received_sigterm = False  # NOTE: Lightning 2.6 has no public setter
        preemption.received = signal.SIGTERM


def stop_validating_as_planned(trainer: Trainer) -> None:
    """``trainer.should_stop``, at a step whose checkpoint is written: the validation due at this step runs (after
    the save), and no other. NOTE: Lightning validates after any step that stops ``fit``
    (``_should_check_val_fx``), and a resumed fit takes the validation due at its checkpoint's step as done."""
    epoch_loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    due = fetcher is not None and epoch_loop._should_check_val_fx(fetcher)
    trainer.should_stop = True
    epoch_loop._skip_next_val = not due


def slurm_requeue(trainer: Trainer, preemption: Preemption) -> Requeue:
    """SLURM's requeue kept: under Lightning's ``SLURMEnvironment`` with ``auto_requeue`` on (Lightning's default in
    a SLURM job), its ``requeue_signal`` (SIGUSR1) requests a preemption checkpoint too, and once the checkpoint that
    signal led to is written the global-zero rank runs ``scontrol requeue`` (``loader_resume.slurm.Requeue``), as
    Lightning's own handler does. Other signals (SIGTERM: ``scancel``, the time limit) stop without a requeue."""
    environment = trainer._accelerator_connector.cluster_environment  # NOTE: as Lightning's signal connector
    on = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
    requeue = Requeue(on, environment.requeue_signal if on else signal.SIGUSR1)  # type: ignore[attr-defined]
    if requeue.signal is not None and requeue.signal not in preemption.signals:
        preemption.signals = (*preemption.signals, requeue.signal)
    return requeue
