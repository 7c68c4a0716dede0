"""Lightning integration of loader-resume: ``Trainer(callbacks=[ResumeCallback()])``, and
``FabricResume(fabric)`` for Lightning Fabric loops."""

from .callback import CHECKPOINT_KEY, ResumeCallback
from .fabric import FabricResume
from .fabric_loader import FabricResumableDataLoader

__all__ = ["CHECKPOINT_KEY", "FabricResumableDataLoader", "FabricResume", "ResumeCallback"]
