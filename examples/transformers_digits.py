"""The transformers Trainer on scikit-learn's digits with ResumableTrainer: stop it, run it again, it continues.

    python examples/transformers_digits.py max_steps=25        # stops after step 25 (checkpoint-25)...
    python examples/transformers_digits.py max_steps=60        # ...and continues mid-epoch with the next batch
    python examples/transformers_digits.py max_steps=60 output_dir=/tmp/fresh   # the same job uninterrupted
    torchrun --nproc_per_node 2 examples/transformers_digits.py                 # two CPU processes

A constant learning rate, so that a job stopped and extended is the same job as one run at once. The last
line printed is a digest of the final weights: the continued job prints the uninterrupted job's.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import TrainingArguments

from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits
from transformers_resume import ResumableTrainer

OWN = {"max_steps": "60", "workers": "2", "batch_size": "32", "output_dir": "runs/transformers_digits"}


class Digits(NoisyDigits):
    """The digits as dicts, the form Trainer's default collator stacks."""

    def __getitem__(self, index: int) -> dict[str, object]:  # type: ignore[override]
        x, y, _ = super().__getitem__(index)
        return {"x": x, "labels": y}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


def settings(argv: list[str]) -> dict[str, str]:
    own = dict(OWN)
    for word in argv:
        key, _, value = word.partition("=")
        if key not in own:
            sys.exit(f"transformers_digits.py: unknown setting {word!r}; expected key=value, a key of {sorted(own)}")
        own[key] = value
    return own


def main(argv: list[str]) -> None:
    own = settings(argv)
    torch.manual_seed(0)
    model = Classifier()
    args = TrainingArguments(
        output_dir=own["output_dir"], use_cpu=True, report_to=[], seed=0, max_steps=int(own["max_steps"]),
        per_device_train_batch_size=int(own["batch_size"]), learning_rate=0.05, lr_scheduler_type="constant",
        save_strategy="steps", save_steps=5, save_total_limit=2, logging_steps=20,
        dataloader_num_workers=int(own["workers"]), disable_tqdm=True,
    )
    trainer = ResumableTrainer(model=model, args=args, train_dataset=Digits())
    has_checkpoint = trainer.resumable_checkpoint() is not None
    trainer.train(resume_from_checkpoint=has_checkpoint)  # the newest complete checkpoint, if there is one
    if args.process_index == 0:
        print(f"final weights digest: {fingerprint([p.detach() for p in model.parameters()])}", flush=True)
    # NOTE: as at the end of any multi-process script: a process whose peer has already left can be aborted by
    # gloo (SIGABRT) while the interpreter tears an open process group down
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
