"""Exact mid-epoch resume for Accelerate training loops: ``enable_resume(accelerator)``.

accelerator = Accelerator(project_dir="runs/x")
resume = enable_resume(accelerator, "configs/accelerate_resume.yaml")   # or a dict, or nothing
model, opt, train_dl = accelerator.prepare(model, opt, train_dl)        # plain DataLoader in
for epoch in resume.epochs(num_epochs):                                 # continues the right epoch
    for batch in train_dl:                                              # continues the right batch
        ...
"""

from .config import ResumeConfig, load_config
from .hook import STATE_FILE, Resume, enable_resume
from .loader import AcceleratedResumableDataLoader

__all__ = [
    "STATE_FILE",
    "AcceleratedResumableDataLoader",
    "Resume",
    "ResumeConfig",
    "enable_resume",
    "load_config",
]
