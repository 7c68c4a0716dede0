"""Lightning overhead: steps/s with and without ResumeCallback (a small model, 1 device, 2 workers).

    python benchmarks/bench_lightning.py           # ~2 min; prints the table, updates docs/
    python benchmarks/bench_lightning.py --quick   # fewer rounds, docs untouched

The callback's work per step is a signal-flag check and a copy of torch's RNG state; its loaders add
keyed randomness. Rounds alternate (order reversed every other round); ratios are taken per round.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import tempfile
import time
import warnings
from typing import Any

import lightning as L
import torch
from common import interleaved, markdown, write_docs_section
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_resume import ResumeCallback

STEPS_PER_EPOCH, BATCH, WARMUP = 150, 32, 10


class Timed(L.Callback):
    """Steps/s from the WARMUP-th training step to the end (start-up and worker launch excluded)."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == WARMUP:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.rate = (trainer.global_step - WARMUP) / (time.perf_counter() - self.start)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))
        data = torch.randn(STEPS_PER_EPOCH * BATCH, 16)
        self.data = TensorDataset(data, (data.sum(1) > 0).long())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.data, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True
        )


def steps_per_second(with_callback: bool) -> float:
    timed = Timed()
    with tempfile.TemporaryDirectory() as root:
        callbacks: list[L.Callback] = [timed] + (
            [ResumeCallback(dirpath=root)] if with_callback else []
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=callbacks,
        )
        trainer.fit(Tiny())
    return float(timed.rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds; do not touch the docs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    rounds = 3 if args.quick else 11
    result = interleaved(
        {"without": lambda: steps_per_second(False), "with": lambda: steps_per_second(True)}, rounds
    )
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"Lightning {L.__version__}")
    text = (
        f"Measured by `python benchmarks/bench_lightning.py` ({machine}): a 16-32-2 MLP, batch "
        f"{BATCH}, {STEPS_PER_EPOCH} steps an epoch, `num_workers=2`; median over {rounds} "
        "interleaved rounds.\n\n"
        + markdown(
            ["Trainer", "steps/s", "ratio"],
            [
                ["plain DataLoader, no callback", f"{result['without']:,.0f}", "1.000"],
                [
                    "+ ResumeCallback (converted loader, keyed)",
                    f"{result['with'] * result['without']:,.0f}",
                    f"{result['with']:.3f}",
                ],
            ],
        )
    )
    print(text)
    if not args.quick:
        write_docs_section("lightning", text)


if __name__ == "__main__":
    main()
