"""Fabric + FabricResume on scikit-learn's digits: stopped and rerun, it continues.

    python fabric_digits.py              # `kill -TERM <pid>` mid-run...
    python fabric_digits.py              # ...and the same command continues
    python fabric_digits.py --devices 2  # two CPU processes
    python fabric_digits.py checkpoint_dir=/tmp/x epochs=5

On a signal the run checkpoints at the next optimizer step and exits with code 143; the
next run resumes from the newest complete checkpoint by itself. The last line printed is
a digest of the final weights: an interrupted-and-rerun job prints the same one as an
uninterrupted job.
"""

from __future__ import annotations

import sys

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume import FabricResume
from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits

OWN = {"epochs": "3", "workers": "2", "batch_size": "32",
       "checkpoint_dir": "runs/fabric_digits", "devices": "1"}


def settings(argv: list[str]) -> dict[str, str]:
    """``key=value`` words (and ``--devices N``) over the defaults; an unknown key fails
    naming the valid ones."""
    own = dict(OWN)
    words = iter(argv)
    for word in words:
        key, _, value = word.partition("=")
        if word == "--devices":
            key, value = "devices", next(words)
        if key not in own:
            sys.exit(f"fabric_digits.py: unknown setting {word!r}; "
                     f"expected key=value with a key of {sorted(own)}")
        own[key] = value
    return own


def main(argv: list[str]) -> None:
    own = settings(argv)
    devices = int(own["devices"])
    fabric = Fabric(accelerator="cpu", devices=devices,
                    strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    # before setup_dataloaders
    resume = FabricResume(fabric, seed=0, checkpoint_dir=own["checkpoint_dir"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    train = fabric.setup_dataloaders(  # resumable, sharded per rank
        DataLoader(NoisyDigits(), batch_size=int(own["batch_size"]), shuffle=True,
                   num_workers=int(own["workers"])))
    state = {"model": model, "optimizer": optimizer}
    fabric.print(f"training on {fabric.world_size} process(es)")
    # what the checkpoints save; the newest one is loaded into it
    if resume.restore(state) is not None:
        fabric.print(f"resumed from {resume.loaded_from} at epoch {resume.epoch}, "
                     f"step {resume.step}")
    # after a resume: the saved epoch, from the very next batch
    for epoch in resume.epochs(int(own["epochs"])):
        model.train()
        for x, y, _ in train:
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if resume.step % 20 == 0:
                fabric.print(f"epoch {epoch} step {resume.step} loss {loss.item():.3f}",
                             flush=True)
    fabric.barrier()
    fabric.print("final weights digest: "
                 f"{fingerprint([p.detach().cpu() for p in model.parameters()])}",
                 flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
