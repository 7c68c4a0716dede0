"""A data mixture whose weights follow a schedule, under Accelerate: interrupt it, run it again, it
continues.

    python examples/mixture_digits.py                        # `kill -TERM <pid>` mid-run...
    python examples/mixture_digits.py                        # ...and the same command continues
    python examples/mixture_digits.py epochs=4 workers=0     # this script's settings, as key=value

Three sources (scikit-learn's digits 0-3, 4-6 and 7-9, each item augmented with random noise) are
drawn by a ``Mixture`` whose weights move from the first group to the last as training goes on: a
curriculum, set at each step from a schedule of the step. On SIGTERM the run checkpoints at the next
optimizer step (the mixture's weights and changes inside the loader's state) and exits with 143; the
next run resumes from the newest complete checkpoint, makes the same calls at the same steps, and
ends with the same final weights (the last line, a digest) as an uninterrupted run.
"""

from __future__ import annotations

import gc
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Subset

from accelerate_resume import enable_resume
from loader_resume import Mixture
from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits

SETTINGS = {"epochs": 3, "workers": 2, "batch_size": 32, "project_dir": "runs/mixture_digits"}
SCHEDULE = [(0, {"low": 0.6, "mid": 0.3, "high": 0.1}),  # (from this optimizer step, the weights)
            (15, {"low": 0.3, "mid": 0.4, "high": 0.3}),
            (90, {"low": 0.1, "mid": 0.3, "high": 0.6})]


def weights_at(step: int) -> dict[str, float]:
    return [weights for start, weights in SCHEDULE if start <= step][-1]


def sources() -> dict[str, Subset[tuple[torch.Tensor, int, int]]]:
    digits = NoisyDigits()
    groups = {"low": range(0, 4), "mid": range(4, 7), "high": range(7, 10)}
    return {name: Subset(digits, [i for i, y in enumerate(digits.y.tolist()) if y in labels])
            for name, labels in groups.items()}


def main(argv: list[str]) -> None:
    settings = {key: str(value) for key, value in SETTINGS.items()}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in settings or not value:
            raise SystemExit(f"{arg!r}: expected key=value with a key among {sorted(settings)}")
        settings[key] = value
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_dir=settings["project_dir"])
    resume = enable_resume(accelerator)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mixture = Mixture(sources(), weights_at(0), samples_per_epoch=1600)
    # the mixture orders itself
    train = DataLoader(mixture, batch_size=int(settings["batch_size"]), shuffle=False,
                       num_workers=int(settings["workers"]))
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    if resume.restore() is not None:
        accelerator.print(
            f"resumed from {resume.loaded_from} at epoch {resume.epoch}, step {resume.step}"
        )
    for epoch in resume.epochs(int(settings["epochs"])):
        model.train()
        for x, y, _ in train:
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            # the same call at the same step in every run
            mixture.set_weights(weights_at(resume.step))
            if resume.step % 20 == 0:
                accelerator.print(f"epoch {epoch} step {resume.step} loss {loss.item():.3f} "
                                  f"weights {mixture.weights}", flush=True)
    digest = fingerprint([p.detach().cpu() for p in accelerator.unwrap_model(model).parameters()])
    accelerator.print(f"final weights digest: {digest}", flush=True)
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
