"""Accelerate + enable_resume on scikit-learn's digits: stopped and rerun, it continues.

    python accelerate_digits.py       # `kill -TERM <pid>` mid-run...
    python accelerate_digits.py       # ...and the same command continues
    accelerate launch --multi_gpu --num_processes 2 \
        accelerate_digits.py --cpu    # two CPU processes
    python accelerate_digits.py save_every_n_steps=50 epochs=5   # overrides

Resume settings are enable_resume's defaults (configs/accelerate_resume.yaml shows
them); override any as ``key=value``. ``epochs``, ``workers``, ``batch_size`` and
``project_dir`` are this script's own. On a signal the run checkpoints at the next
optimizer step and exits with code 143; the next run resumes from the newest complete
checkpoint automatically. The last line printed is a digest of the final weights: an
interrupted-and-rerun job prints the same one as an uninterrupted job.
"""

from __future__ import annotations

import gc
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from accelerate_resume import enable_resume
from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits

OWN = {"epochs": 3, "workers": 2, "batch_size": 32,
       "project_dir": "runs/accelerate_digits"}


def split(argv: list[str]) -> tuple[dict[str, str], list[str], bool]:
    """This script's own ``key=value`` settings, the resume config overrides, and
    ``--cpu``."""
    own = {key: str(value) for key, value in OWN.items()}
    overrides = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key in own:
            own[key] = arg.split("=", 1)[1]
        elif arg != "--cpu":
            overrides.append(arg)
    return own, overrides, "--cpu" in argv or not torch.cuda.is_available()


def main(argv: list[str]) -> None:
    own, overrides, cpu = split(argv)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=cpu, project_dir=own["project_dir"])
    resume = enable_resume(accelerator, overrides=overrides)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # a plain DataLoader: prepare makes it resumable
    train = DataLoader(NoisyDigits(), batch_size=int(own["batch_size"]), shuffle=True,
                       num_workers=int(own["workers"]))
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    accelerator.print(f"training on {accelerator.num_processes} process(es)")
    if resume.restore() is not None:
        accelerator.print(f"resumed from {resume.loaded_from} at epoch {resume.epoch}, "
                          f"step {resume.step}")
    # after a resume: the saved epoch, from the very next batch
    for epoch in resume.epochs(int(own["epochs"])):
        model.train()
        for x, y, _ in train:
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if resume.step % 20 == 0:
                accelerator.print(f"epoch {epoch} step {resume.step} "
                                  f"loss {loss.item():.3f}", flush=True)
    accelerator.wait_for_everyone()
    digest = fingerprint([p.detach().cpu()
                          for p in accelerator.unwrap_model(model).parameters()])
    accelerator.print(f"final weights digest: {digest}", flush=True)
    # before the process group goes: gloo aborts a process whose threads still hold
    # tensors
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
