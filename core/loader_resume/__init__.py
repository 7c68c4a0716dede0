"""loader-resume: exact, elastic mid-epoch resume for PyTorch data loading.

``ResumableDataLoader`` is a drop-in ``DataLoader`` whose ``state_dict()`` resumes the batch
sequence bit-identically — sample ids and the random numbers drawn while loading them — with another
``num_workers``, batch size or world size if need be. ``global_rng_state`` and
``set_global_rng_state`` save and restore every generator a training step draws from (torch's CPU
generator, each CUDA device's, numpy's and ``random``'s) for a checkpoint of your own.
``LoaderResumeError`` is the base of every error it raises on purpose.
"""

from loader_resume.errors import LoaderResumeError
from loader_resume.job.checkpoint import global_rng_state, set_global_rng_state
from loader_resume.keyed.keyed_rng import GENERATORS
from loader_resume.loader import ResumableDataLoader
from loader_resume.order.mixture import Mixture
from loader_resume.order.sampler import ShardedSampler
from loader_resume.state import STATE_VERSION, StateError

__all__ = [
    "GENERATORS",
    "STATE_VERSION",
    "LoaderResumeError",
    "Mixture",
    "ResumableDataLoader",
    "ShardedSampler",
    "StateError",
    "__version__",
    "global_rng_state",
    "set_global_rng_state",
]
__version__ = "0.1.0"
"""This release (the version in ``pyproject.toml``)."""
