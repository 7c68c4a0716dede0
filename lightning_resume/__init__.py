"""Lightning integration of loader-resume: ``Trainer(callbacks=[ResumeCallback()])``."""

from .callback import CHECKPOINT_KEY, ResumeCallback

__all__ = ["CHECKPOINT_KEY", "ResumeCallback"]
