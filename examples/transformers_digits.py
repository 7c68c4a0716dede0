"""The transformers Trainer + ResumableTrainer on scikit-learn's digits: stopped, rerun.

    python transformers_digits.py   # kill -TERM it: it checkpoints, exits 143
    python transformers_digits.py   # the same command continues
    torchrun --nproc_per_node 2 transformers_digits.py     # two CPU processes

Settings are ``key=value`` words (``max_steps=60 workers=2 batch_size=32
output_dir=...``). SIGTERM or SIGUSR1 makes every process checkpoint at the next
optimizer step and exit with 143; ``resume_from_checkpoint=True`` continues from the
newest complete checkpoint (and starts from the beginning where there is none). The last
line printed is a digest of the final weights: an interrupted-and-rerun job prints the
uninterrupted job's.
"""

from __future__ import annotations

import gc
import sys

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits
from transformers_resume import ResumableTrainer

OWN = {"max_steps": "60", "workers": "2", "batch_size": "32",
       "output_dir": "runs/transformers_digits"}


class Digits(NoisyDigits):
    """The digits as dicts, the form Trainer's default collator stacks."""

    def __getitem__(self, index: int) -> dict[str, object]:  # type: ignore[override]
        x, y, _ = super().__getitem__(index)
        return {"x": x, "labels": y}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


class PrintProgress(TrainerCallback):
    """Prints ``epoch E step S of N`` every 10 optimizer steps on the first process."""

    def on_step_end(self, args: TrainingArguments, state: object, control: object,
                    **kwargs: object) -> None:
        step, epoch = state.global_step, state.epoch  # type: ignore[attr-defined]
        if step % 10 == 0 and args.process_index == 0:
            print(f"epoch {int(epoch)} step {step} "  # type: ignore[attr-defined]
                  f"of {state.max_steps}", flush=True)


def settings(argv: list[str]) -> dict[str, str]:
    own = dict(OWN)
    for word in argv:
        key, _, value = word.partition("=")
        if key not in own:
            sys.exit(f"transformers_digits.py: unknown setting {word!r}; "
                     f"expected key=value, a key of {sorted(own)}")
        own[key] = value
    return own


def main(argv: list[str]) -> None:
    own = settings(argv)
    torch.manual_seed(0)
    model = Classifier()
    args = TrainingArguments(
        output_dir=own["output_dir"], use_cpu=True, report_to=[], seed=0,
        max_steps=int(own["max_steps"]),
        per_device_train_batch_size=int(own["batch_size"]),
        learning_rate=0.05, lr_scheduler_type="constant", save_strategy="steps",
        save_steps=50, save_total_limit=2, logging_strategy="no",
        dataloader_num_workers=int(own["workers"]), disable_tqdm=True,
    )
    trainer = ResumableTrainer(model=model, args=args, train_dataset=Digits(),
                               callbacks=[PrintProgress()])
    # the newest complete checkpoint; from the beginning if none
    trainer.train(resume_from_checkpoint=True)
    if args.process_index == 0:
        print("final weights digest: "
              f"{fingerprint([p.detach() for p in model.parameters()])}", flush=True)
    # NOTE: as at the end of any multi-process CPU script: gloo can abort a process
    # (SIGABRT) whose process group is left to the interpreter's teardown, and the DDP
    # wrapper Trainer made holds the group; free it, then end it
    trainer.accelerator.wait_for_everyone()
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
