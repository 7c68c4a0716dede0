"""A training job with evaluations inside it, for test_eval_preemption.py: one per front door.

    python eval_preemption_child.py OUT --front FRONT [--eval-workers W] [--signal-in-eval K]
    python eval_preemption_child.py --batch PLAN   # runs one after another (support/batch.py)

FRONT: ``lightning`` (Trainer, ``val_check_interval=2``, a sanity check of 1 batch), ``fabric``,
``accelerate`` or ``transformers`` (an evaluation every 2 optimizer steps). 24 training items in
batches of 4 (6 steps an epoch, 2 epochs, ``num_workers=2``; transformers: ``--eval-workers``,
Trainer's one count), 40 evaluation items in batches of 4 (``--eval-workers``), a model with
dropout. OUT/log.json gathers every run's training rows (optimizer steps done, ids, a fingerprint of
the batch), its evaluations (the step after which each ran, its losses) and the final weights.
``--signal-in-eval K``: the first run sends SIGTERM to its whole process group (itself and every
DataLoader worker) during its K-th evaluation (K = 0: Lightning's sanity check); ``--signal-in-step
S``: in training step S (an evaluation due after it: the checkpoint comes first). The same command
again continues.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.batch import fresh_accelerate, run_each
from support.data import NoisyEverywhere

EPOCHS, EVERY = 2, 2


class Job:
    """What every front door shares: the data, the log, and the signal during an evaluation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "log.json"
        saved = (
            json.loads(self.path.read_text()) if self.path.exists() else {"rows": [], "evals": []}
        )
        self.rows, self.evals = saved["rows"], saved["evals"]
        self.first_run = not (self.out / "started").exists()
        (self.out / "started").write_text("")
        self.evaluations = 0
        self.losses: list[float] = []

    def train_loader(self) -> DataLoader[Any]:
        return DataLoader(NoisyEverywhere(24), batch_size=4, shuffle=True, num_workers=2)

    def eval_loader(self) -> DataLoader[Any]:
        return DataLoader(NoisyEverywhere(40), batch_size=4, num_workers=self.args.eval_workers)

    def trained(self, step: int, x: torch.Tensor, ids: torch.Tensor) -> None:
        self.rows.append({"step": step, "ids": ids.tolist(), "batch": fingerprint([x])})
        self.flush()
        if self.first_run and step == self.args.signal_in_step:
            os.killpg(os.getpgid(0), signal.SIGTERM)

    def evaluating(self, loss: torch.Tensor) -> None:
        """One evaluation batch: slow enough to be signalled in; the signal at the first batch of
        the K-th."""
        if not self.losses and self.first_run and self.evaluations == self.args.signal_in_eval:
            os.killpg(os.getpgid(0), signal.SIGTERM)
        self.losses.append(round(float(loss), 6))
        time.sleep(0.02)

    def evaluated(self, step: int, sanity: bool = False) -> None:
        if not sanity:  # Lightning's sanity check (first runs only) is not logged
            self.evals.append({"after": step, "losses": self.losses})
        self.evaluations += 1
        self.losses = []
        self.flush()

    def finished(self, model: nn.Module) -> None:
        self.flush(fingerprint([p.detach() for p in model.parameters()]))

    def flush(self, weights: str | None = None) -> None:
        self.path.write_text(
            json.dumps({"rows": self.rows, "evals": self.evals, "weights": weights})
        )


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def evaluate(job: Job, model: nn.Module, loader: Any, step: int) -> None:
    model.eval()
    with torch.no_grad():
        for x, y, _ in loader:
            job.evaluating(nn.functional.cross_entropy(model(x), y))
    job.evaluated(step)
    model.train()


def hand_written(job: Job, front: str) -> None:
    """Fabric and Accelerate: the loop written by hand, its evaluation loader set up by the
    front-end."""
    model, optimizer = model_and_optimizer()
    if front == "fabric":
        from lightning.fabric import Fabric

        from lightning_resume import FabricResume

        fabric = Fabric(accelerator="cpu", devices=1)
        fabric.launch()
        resume: Any = FabricResume(fabric, seed=7, checkpoint_dir=job.out / "resume_checkpoints")
        model, optimizer = fabric.setup(model, optimizer)
        train, evaluation = fabric.setup_dataloaders(job.train_loader(), job.eval_loader())
        resume.restore({"model": model, "optimizer": optimizer})
        backward = fabric.backward
    else:
        from accelerate import Accelerator

        from accelerate_resume import enable_resume

        accelerator = Accelerator(cpu=True, project_dir=str(job.out))
        resume = enable_resume(accelerator, {"seed": 7})
        model, optimizer, train, evaluation = accelerator.prepare(
            model, optimizer, job.train_loader(), job.eval_loader()
        )
        backward = accelerator.backward
    for _ in resume.epochs(EPOCHS):
        for x, y, ids in train:
            backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            job.trained(resume.step, x, ids)
            if resume.step % EVERY == 0:
                evaluate(job, model, evaluation, resume.step)
    job.finished(model)


def lightning(job: Job) -> None:
    import lightning as L

    from lightning_resume import ResumeCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_and_optimizer()[0]

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y, ids = batch
            job.trained(self.global_step + 1, x, ids)
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, index: int) -> None:
            x, y, _ = batch
            job.evaluating(nn.functional.cross_entropy(self.net(x), y))

        def on_validation_epoch_end(self) -> None:
            job.evaluated(self.global_step, sanity=self.trainer.sanity_checking)

        def on_train_end(self) -> None:
            job.finished(self.net)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[Any]:
            return job.train_loader()

        def val_dataloader(self) -> DataLoader[Any]:
            return job.eval_loader()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        val_check_interval=EVERY,
        default_root_dir=job.out,
        deterministic=True,
        enable_checkpointing=True,
        callbacks=[ResumeCallback(seed=7)],
    )
    trainer.fit(Module())


def transformers(job: Job) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from transformers_resume import ResumableTrainer

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_and_optimizer()[0]

        def forward(
            self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor
        ) -> dict[str, torch.Tensor]:
            loss = nn.functional.cross_entropy(self.net(x), labels)
            if self.training:
                self.batch = (x, idx)
            else:
                job.evaluating(loss)
            return {"loss": loss}

    class Log(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            job.trained(state.global_step, *model.batch)

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            job.evaluated(state.global_step)

    class Items(NoisyEverywhere):
        def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
            x, y, i = super().__getitem__(index)
            return {"x": x, "labels": y, "idx": i}

    model = Tiny()
    training = TrainingArguments(
        output_dir=str(job.out / "run"),
        use_cpu=True,
        report_to=[],
        seed=7,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=EPOCHS,
        learning_rate=0.1,
        save_strategy="steps",
        save_steps=100,
        logging_strategy="no",
        eval_strategy="steps",
        eval_steps=EVERY,
        disable_tqdm=True,
        # NOTE: Trainer's one count, for training and evaluation
        dataloader_num_workers=job.args.eval_workers,
    )
    trainer = ResumableTrainer(
        model=model,
        args=training,
        train_dataset=Items(24),
        eval_dataset=Items(40),
        callbacks=[Log()],
    )
    trainer.train(resume_from_checkpoint=True)
    job.finished(model.net)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--front", required=True, choices=["lightning", "fabric", "accelerate", "transformers"]
    )
    parser.add_argument("--eval-workers", type=int, default=2)
    parser.add_argument("--signal-in-eval", type=int, default=-1)
    parser.add_argument(
        "--signal-in-step", type=int, default=-1, help="SIGTERM to the group in this training step"
    )
    args = parser.parse_args(argv)
    # NOTE: as seed_everything: an evaluation loader without workers draws from these
    np.random.seed(0)
    random.seed(0)
    job = Job(args)
    if args.front in ("fabric", "accelerate"):
        hand_written(job, args.front)
    elif args.front == "lightning":
        lightning(job)
    else:
        transformers(job)


def fresh() -> None:
    """Before each run of a batch: Accelerate's shared state forgotten, and torch's deterministic
    mode (a Lightning run's ``deterministic=True`` sets it for the process) off, as in a fresh
    process."""
    fresh_accelerate()
    torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        run_each(main, sys.argv[2], fresh)
    else:
        main()
