"""Real Lightning runs whose epochs leave passes early, for test_loop_edges_frameworks.py.

    python lightning_loops_child.py OUT --shape SHAPE [--workers W] [--signal-at STEP]

SHAPE: ``limit-0.5`` / ``limit-3`` (``limit_train_batches``), or ``min_size`` / ``max_size_cycle`` /
``max_size`` (a dict of two training loaders of 6 and 10 batches in a ``CombinedLoader``). Without
``--signal-at``: an uninterrupted fit with ``ModelCheckpoint(every_n_train_steps=1)``, then a fresh
fit from each checkpoint (``fit(ckpt_path=...)``), each writing OUT/<name>.json: one row per step
(step, and per loader the ids and a fingerprint of the noise its items drew) and the final weights.
Then a resumed run (from step 7, or the last but one) checkpoints at every step in turn, and
OUT/again.json resumes from its next step's file. ``--signal-at``: SIGTERM to the whole process
group at that step of a first run; rerunning the same command continues (OUT/job.json gathers both
runs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume import ResumeCallback
from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.data import Noisy

EPOCHS = 2


class Model(L.LightningModule):
    def __init__(self, args: argparse.Namespace, data: dict[str, Noisy]) -> None:
        super().__init__()
        self.args, self.data = args, data
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        self.rows: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        parts = batch if isinstance(batch, dict) else {"a": batch}
        row: dict[str, Any] = {"step": self.global_step}
        loss = torch.zeros(())
        for name, part in sorted(parts.items()):
            if part is None:  # max_size: an exhausted loader
                continue
            x, y, ids = part
            noise = x - self.data[name].x[ids]  # what the items drew (keyed)
            row[name] = [ids.tolist(), fingerprint([noise])]
            loss = loss + nn.functional.cross_entropy(self.net(x), y)
        self.rows.append(row)
        if (
            self.args.signal_at == self.global_step
            and not (Path(self.args.out) / "preempted.ckpt").exists()
        ):
            os.killpg(os.getpgid(0), signal.SIGTERM)
        return loss

    # NOTE: before ResumeCallback's teardown, which exits a preempted run
    def on_train_end(self) -> None:
        path = Path(self.args.out) / f"{self.args.name}.json"
        before = json.loads(path.read_text())["rows"] if path.exists() else []
        weights = fingerprint([p.detach() for p in self.parameters()])
        path.write_text(json.dumps({"rows": before + self.rows, "weights": weights}))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        def loader(name: str) -> DataLoader[Any]:
            return DataLoader(
                self.data[name], batch_size=4, shuffle=True, num_workers=self.args.workers
            )

        if self.args.shape.startswith("limit"):
            return loader("a")
        return CombinedLoader({"a": loader("a"), "b": loader("b")}, mode=self.args.shape)


def fit(args: argparse.Namespace, name: str, ckpt_path: str | None = None, every: str = "") -> None:
    torch.manual_seed(123)
    limit: float | int = 1.0
    if args.shape.startswith("limit"):
        text = args.shape.split("-")[1]
        limit = float(text) if "." in text else int(text)
    out = Path(args.out)
    callbacks: list[Any] = [ResumeCallback(seed=7, dirpath=out)]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=out / every, every_n_train_steps=1, save_top_k=-1,
                                         filename="{step}"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        limit_train_batches=limit,
        default_root_dir=out,
        deterministic=True,
        callbacks=callbacks,
    )
    args.name = name
    trainer.fit(Model(args, {"a": Noisy(24), "b": Noisy(40)}), ckpt_path=ckpt_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--signal-at", type=int)
    args = parser.parse_args()
    if args.signal_at is not None:
        fit(args, "job")  # the first run is signalled; the same command again continues
        return
    fit(args, "full", every="ckpt")
    checkpoints = sorted((Path(args.out) / "ckpt").glob("step=*.ckpt"))
    for ckpt in checkpoints:
        fit(args, f"from-{ckpt.stem.split('=')[1]}", str(ckpt))
    # a resumed run checkpointing again, resumed in turn (max_size: a loader done mid-epoch stays
    # done)
    first = min(7, len(checkpoints) - 2)
    fit(args, "resumed", str(Path(args.out) / "ckpt" / f"step={first}.ckpt"), every="ckpt2")
    fit(args, "again", str(Path(args.out) / "ckpt2" / f"step={first + 1}.ckpt"))
    (Path(args.out) / "again-from.txt").write_text(str(first + 1))


if __name__ == "__main__":
    main()
