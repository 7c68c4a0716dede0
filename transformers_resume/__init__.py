"""Exact mid-epoch resume for the HF transformers ``Trainer``: ``ResumableTrainer`` in place of
``Trainer``.

    trainer = ResumableTrainer(model=model, args=args, train_dataset=data)  # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)  # continues with the very next batch

Own ``Trainer`` subclasses (TRL's ``SFTTrainer``, ...) take ``ResumeTrainerMixin`` first:
``class MyTrainer(ResumeTrainerMixin, SFTTrainer)``.
"""

from .trainer import LOADER_STATE_FILE, ResumableTrainer, ResumeTrainerMixin

__all__ = ["LOADER_STATE_FILE", "ResumableTrainer", "ResumeTrainerMixin"]
