"""A real LightningCLI program for test_lightning.py: ``python lightning_cli_child.py fit --config
CFG [...]``.

The callbacks come from the config or the command line (``trainer.callbacks``), as LightningCLI
users write them. Each training step appends one JSON line to ``OUT/log.jsonl`` (step, sample ids,
batch fingerprint); the end of fit writes ``OUT/weights.txt``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader

from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.data import Noisy


class CliModel(L.LightningModule):
    def __init__(self, out: str, items: int = 30, sleep: float = 0.0, workers: int = 0) -> None:
        super().__init__()
        self.out, self.items, self.sleep, self.workers = Path(out), items, sleep, workers
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        with (self.out / "log.jsonl").open("a") as log:
            log.write(json.dumps([self.global_step, ids.tolist(), fingerprint([x, y])]) + "\n")
        if self.sleep:
            time.sleep(self.sleep)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Noisy(self.items), batch_size=4, shuffle=True, num_workers=self.workers)

    def on_train_end(self) -> None:
        (self.out / "weights.txt").write_text(fingerprint([p.detach() for p in self.parameters()]))


if __name__ == "__main__":
    torch.manual_seed(123)
    LightningCLI(CliModel, save_config_kwargs={"overwrite": True})
