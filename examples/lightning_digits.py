"""Lightning + ResumeCallback on scikit-learn's digits: stopped and rerun, it continues.

    python lightning_digits.py        # Ctrl-C or `kill -TERM <pid>` mid-run...
    python lightning_digits.py        # ...and the same command continues
    python lightning_digits.py --devices 2   # DDP on two CPU processes
    python lightning_digits.py data.num_workers=0 trainer.max_epochs=5

Settings live in lightning_digits.yaml beside this file, overridden by omegaconf
dotlist words (``--devices N`` is ``trainer.devices=N``). On a signal the run
checkpoints at the next step and exits with `resume.exit_code`; the next run resumes
from that checkpoint automatically. The last line printed is a digest of the final
weights: an interrupted-and-rerun job prints the same one as an uninterrupted job.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from lightning_resume import ResumeCallback
from loader_resume.job.storage import local_path
from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits

CONFIG = Path(__file__).resolve().with_name("lightning_digits.yaml")  # beside this file


class DigitsModule(L.LightningModule):
    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.net = nn.Sequential(nn.Linear(64, cfg.model.hidden), nn.ReLU(),
                                 nn.Dropout(cfg.model.dropout),
                                 nn.Linear(cfg.model.hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.global_step % 20 == 0 and self.global_rank == 0:
            print(f"epoch {self.current_epoch} step {self.global_step} "
                  f"loss {loss.item():.3f}", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.cfg.model.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        # a plain DataLoader: the callback makes it resumable
        return DataLoader(NoisyDigits(), batch_size=self.cfg.data.batch_size,
                          shuffle=True, num_workers=self.cfg.data.num_workers)


def load_config(overrides: list[str]) -> DictConfig:
    """lightning_digits.yaml with omegaconf dotlist overrides; a key that is not in it
    is an error."""
    base = OmegaConf.load(CONFIG)
    OmegaConf.set_struct(base, True)
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    assert isinstance(cfg, DictConfig)
    return cfg


# --8<-- [start:trainer]
def main(overrides: list[str]) -> None:
    cfg = load_config(overrides)
    torch.manual_seed(0)
    # a local path or a URL (s3://bucket/run): kept a string
    root = str(cfg.trainer.default_root_dir)
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy="ddp" if cfg.trainer.devices * cfg.trainer.num_nodes > 1 else "auto",
        max_epochs=cfg.trainer.max_epochs, default_root_dir=root, logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        callbacks=[
            ResumeCallback(dirpath=root,  # type: ignore[arg-type]
                           **OmegaConf.to_container(cfg.resume)),
            # NOTE: Lightning's ModelCheckpoint reads a file: URL as a relative local
            # path: give it the path
            ModelCheckpoint(dirpath=f"{local_path(root)}/checkpoints",
                            every_n_train_steps=cfg.trainer.every_n_train_steps,
                            save_top_k=-1, save_last=True),
        ],
    )
    model = DigitsModule(cfg)
    # no ckpt_path: a rerun finds the preemption (or last) checkpoint by itself
    trainer.fit(model)
# --8<-- [end:trainer]
    if trainer.is_global_zero:
        print("final weights digest: "
              f"{fingerprint([p.detach() for p in model.parameters()])}", flush=True)
    # DDP on CPU: gloo's group ends before the interpreter's teardown
    # (docs/troubleshooting.md#abort-at-exit)
    if torch.distributed.is_initialized():
        trainer.strategy.barrier()
        del trainer, model
        gc.collect()
        torch.distributed.destroy_process_group()


def _overrides(argv: list[str]) -> list[str]:
    """``--devices N`` is accepted as a shorthand for ``trainer.devices=N``; the rest
    are dotlist overrides."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--devices":
            out.append(f"trainer.devices={next(args)}")
        elif arg.startswith("--devices="):
            out.append(f"trainer.devices={arg.split('=', 1)[1]}")
        else:
            out.append(arg)
    return out


if __name__ == "__main__":
    main(_overrides(sys.argv[1:]))
