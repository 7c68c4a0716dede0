"""The ranks' agreement on a preemption signal, at the end of each optimizer step of
``ResumableTrainer``."""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import TrainerCallback

from loader_resume.distributed import any_rank

__all__ = ["AgreeOnSignals"]


class AgreeOnSignals(TrainerCallback):
    """At the end of each optimizer step (every ``check_every_n_steps``), the ranks agree on a
    preemption signal; if any rank got one, Trainer saves a checkpoint now and stops."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if state.global_step % trainer.check_every_n_steps == 0 and trainer.preemption.agreed():
            trainer.preempted_at = state.global_step
            trainer.requeue.decide(trainer.preemption.received, any_rank)
            control.should_save = True
            control.should_training_stop = True
