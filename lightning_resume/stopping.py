"""How a preempted ``fit`` stops, seen from ``ResumeCallback``: Lightning's own SIGTERM bookkeeping, the
validation it runs at the step that stops ``fit``, and SLURM's requeue."""

from __future__ import annotations

import signal

from lightning.pytorch import Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment

from loader_resume.preemption import Preemption
from loader_resume.slurm import requeue_job

__all__ = ["SlurmRequeue", "adopt_lightnings_sigterm", "stop_validating_as_planned"]


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


class SlurmRequeue:
    """SLURM's requeue kept: under Lightning's ``SLURMEnvironment`` with ``auto_requeue`` on (Lightning's default in
    a SLURM job), its ``requeue_signal`` (SIGUSR1) requests a preemption checkpoint too, and once the checkpoint that
    signal led to is written the global-zero rank runs ``scontrol requeue`` (``loader_resume.slurm.requeue_job``), as
    Lightning's own handler does. Other signals (SIGTERM: ``scancel``, the time limit) stop without a requeue."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.asked = False

    def setup(self, trainer: Trainer, preemption: Preemption) -> None:
        environment = trainer._accelerator_connector.cluster_environment  # NOTE: as Lightning's signal connector
        on = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        self.signal = int(environment.requeue_signal) if on else None  # type: ignore[attr-defined]
        if self.signal is not None and self.signal not in preemption.signals:
            preemption.signals = (*preemption.signals, self.signal)

    def decide(self, trainer: Trainer, preemption: Preemption) -> None:
        """At the agreed stop, on every rank (a collective when requeueing is on): whether any rank got the signal."""
        if self.signal is not None:
            self.asked = trainer.strategy.reduce_boolean_decision(preemption.received == self.signal, all=False)

    def after_checkpoint(self, trainer: Trainer) -> None:
        """Once the checkpoint is written and the fit wound down."""
        if self.asked and trainer.is_global_zero:
            requeue_job()
