"""A real Lightning run for test_lightning.py: `python lightning_child.py OUT [--resume CKPT]
[options]` (`python lightning_child.py --batch PLAN`: several one-device runs in one process,
tests/support/batch.py).

Trains a small MLP with dropout on generated data whose items draw augmentation noise, with
ResumeCallback and ModelCheckpoint(every_n_train_steps=K, save_top_k=-1). Each rank writes
OUT/log-RANK.json: one entry per training step (global step, sample ids, fingerprint of the batch),
and OUT/weights-RANK.txt: a fingerprint of the final weights.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_resume import ResumeCallback
from loader_resume import Mixture
from loader_resume.distributed import init_process_group
from loader_resume.job.storage import local_path
from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.batch import run_each
from support.data import Noisy
from support.device import add_device_options
from support.mounts import fill


class NoisyStream(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """The same data as a stream without __len__, sharded over workers, with its position as
    state."""

    def __init__(self, n: int) -> None:
        self.data, self.i = Noisy(n), 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(worker, len(self.data), workers)
        while self.i < len(mine):
            self.i += 1
            yield self.data[mine[self.i - 1]]
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class EpochOrder(torch.utils.data.Sampler[int]):
    """A custom sampler (not torch's): its own order each epoch, no state."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(
            torch.randperm(
                self.n, generator=torch.Generator().manual_seed(1000 + self.epoch)
            ).tolist()
        )

    def __len__(self) -> int:
        return self.n


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, its FSDP (torch's first) placed on the CPU: Lightning passes
    FSDP no device there, which torch refuses ("FSDP needs a non-CPU accelerator device"), and
    refuses ``strategy="fsdp"`` with ``accelerator="cpu"`` (a subclass is let through). Everything
    else, saving and loading included, is Lightning's."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


def strategy_of(args: argparse.Namespace) -> Any:
    if args.strategy is None:
        return "ddp" if args.devices > 1 else "auto"
    on_cpu = args.device == "cpu"
    if args.strategy == "ddp":
        return DDPStrategy(process_group_backend="gloo" if on_cpu else None)
    if args.strategy.startswith("fsdp-"):  # on a GPU: Lightning's own strategy, untouched
        kind = CPUFSDPStrategy if on_cpu else FSDPStrategy
        return kind(
            state_dict_type=args.strategy[len("fsdp-") :],
            process_group_backend="gloo" if on_cpu else None,
        )
    if args.strategy == "model-parallel-auto":  # Lightning's default: tensor parallel within a node
        return ModelParallelStrategy()
    return ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)


class Model(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        self.log_rows: list[list[Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.log_rows.append([self.global_step, ids.tolist(), fingerprint([x, y])])
        # one line per step, as it happens (the chaos tests kill the process)
        if self.args.batch_log:
            row = {
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                "step": self.global_step + 1,
                "epoch": self.current_epoch,
                "ids": ids.tolist(),
                "batch": fingerprint([x, y]),
            }
            with (Path(self.args.batch_log) / f"log-{self.global_rank}.jsonl").open("a") as log:
                log.write(json.dumps(row) + "\n")
        if self.args.sleep:  # slow enough for a test to send a signal mid-epoch
            time.sleep(self.args.sleep)
            (Path(self.args.out) / f"progress-{self.global_rank}").write_text(str(self.global_step))
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_model(self) -> None:
        # FSDP2 over the data-parallel mesh
        if self.args.strategy in ("model-parallel", "model-parallel-auto"):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self) -> Any:
        # NOTE: with --strategy, an optimizer with state to shard (Lightning's FSDP loading fails on
        # an empty one)
        optimizer = torch.optim.SGD(
            self.parameters(), lr=0.1, momentum=0.9 if self.args.strategy else 0.0
        )
        if not self.args.onecycle:
            return optimizer
        # NOTE: estimated_stepping_batches loads the training loaders early (Lightning#20550).
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.2, total_steps=int(total)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Noisy(12), batch_size=4, shuffle=True, num_workers=self.args.workers)

    def train_dataloader(self) -> DataLoader[Any]:
        # HF's own per-rank split: the callback must refuse it, not split it again
        if self.args.split_per_rank:
            from datasets import Dataset as HFDataset
            from datasets.distributed import split_dataset_by_node

            whole = HFDataset.from_dict({"id": list(range(self.args.items))}).with_format("torch")
            return DataLoader(
                split_dataset_by_node(whole, self.global_rank, self.trainer.world_size),
                batch_size=4,
            )
        if self.args.stream:
            return DataLoader(
                NoisyStream(self.args.items), batch_size=4, num_workers=self.args.workers
            )
        # two sources, weights changed by MixtureSchedule; the mixture orders itself
        if self.args.mixture:
            self.mixture = Mixture(
                {"a": Noisy(self.args.items), "b": Noisy(9)}, {"a": 2, "b": 1}, block_size=6
            )
            return DataLoader(
                self.mixture, batch_size=4, shuffle=False, num_workers=self.args.workers
            )
        if self.args.custom_sampler:
            return DataLoader(
                Noisy(self.args.items),
                batch_size=4,
                sampler=EpochOrder(self.args.items),
                num_workers=self.args.workers,
            )
        return DataLoader(
            Noisy(self.args.items),
            batch_size=4,
            shuffle=True,
            num_workers=self.args.workers,
            persistent_workers=self.args.workers > 0,
            pin_memory=self.args.pin_memory,
        )

    def on_train_end(self) -> None:
        out = Path(self.args.out)
        name = f"log-{self.global_rank}.json"
        # a restarted job: keep the log of the first run
        if self.args.append and (out / name).exists():
            self.log_rows = json.loads((out / name).read_text()) + self.log_rows
        (out / name).write_text(json.dumps(self.log_rows))
        weights = fingerprint(
            [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in self.parameters()]
        )
        (out / f"weights-{self.global_rank}.txt").write_text(weights)


class MixtureSchedule(L.Callback):
    """A weight schedule by optimizer step, as a user's callback sets it: after steps 3 and 9."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, index: int
    ) -> None:
        if trainer.global_step in (3, 9):
            pl_module.mixture.set_weights(
                {"a": 1, "b": 2} if trainer.global_step == 3 else {"a": 1, "b": 0}
            )


class Faults(L.Callback):
    """After the step ``--fill-disk-at``, rank 0 fills the file system of the callback's directory;
    after the step ``--signal-at`` it sends itself ``--signal-name``; after the step ``--wait-at``
    it waits for the test."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, index: int
    ) -> None:
        if trainer.global_rank != 0:
            return
        if trainer.global_step == self.args.fill_disk_at:
            fill(Path(self.args.resume_dir) / "filler")
        if trainer.global_step == self.args.signal_at:
            os.kill(os.getpid(), signal.Signals[self.args.signal_name])
        # NOTE: the test changes the world meanwhile (cuts a link)
        if trainer.global_step == self.args.wait_at:
            (Path(self.args.out) / "waiting").write_text(str(trainer.global_step))
            while not (Path(self.args.out) / "go").exists():
                time.sleep(0.01)


class SlowIO(TorchCheckpointIO):
    """Lightning's own checkpoint IO, ``seconds`` slower per file, as a large checkpoint on slow
    storage: it writes OUT/writing (the file's name) first, so a test can kill the job while a write
    is in flight."""

    def __init__(self, out: str, seconds: float) -> None:
        super().__init__()
        self.out, self.seconds = Path(out), seconds

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        (self.out / "writing").write_text(os.path.basename(path))
        time.sleep(self.seconds)
        super().save_checkpoint(checkpoint, path, storage_options)


class OwnThreadIO(SlowIO):
    """A user's own checkpoint IO that writes each file from a thread of its own (a copy of the
    checkpoint taken first) and waits for them in ``teardown()``: no Lightning class involved."""

    def __init__(self, out: str, seconds: float) -> None:
        super().__init__(out, seconds)
        self.threads: list[threading.Thread] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        copied = copy.deepcopy(checkpoint)
        self.threads.append(
            threading.Thread(target=super().save_checkpoint, args=(copied, path, storage_options))
        )
        self.threads[-1].start()

    def teardown(self) -> None:
        while self.threads:
            self.threads.pop(0).join()


def plugins(args: argparse.Namespace) -> list[Any]:
    """``--async-io SECONDS``: Lightning's ``AsyncCheckpointIO`` over a writer that takes that long
    per file; ``--own-async-io SECONDS``: a user's own writer in threads (``OwnThreadIO``)."""
    if args.own_async_io is not None:
        return [OwnThreadIO(args.out, args.own_async_io)]
    return [] if args.async_io is None else [AsyncCheckpointIO(SlowIO(args.out, args.async_io))]


def resume_callbacks(args: argparse.Namespace) -> list[ResumeCallback]:
    if args.no_callback:
        return []
    # None: default_root_dir
    dirpath = None if args.no_dirpath or args.root else args.resume_dir or args.out
    callback = ResumeCallback(seed=7, dirpath=dirpath, check_every_n_steps=args.check_every)
    return [callback] * (2 if args.two_callbacks else 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--n-resume", type=int, help="dataset length after resume (bad-input test)")
    parser.add_argument("--no-callback", action="store_true")
    parser.add_argument("--two-callbacks", action="store_true")
    parser.add_argument(
        "--no-dirpath", action="store_true", help="ResumeCallback() without dirpath"
    )
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds per step, to be signalled mid-epoch"
    )
    parser.add_argument(
        "--append", action="store_true", help="append to an existing log (restarted job)"
    )
    parser.add_argument("--check-every", type=int, default=1)
    parser.add_argument(
        "--val-every", type=int, default=0, help="val_check_interval in steps (0: no validation)"
    )
    parser.add_argument(
        "--onecycle", action="store_true", help="OneCycleLR sized by estimated_stepping_batches"
    )
    parser.add_argument("--stream", action="store_true", help="an IterableDataset without __len__")
    parser.add_argument(
        "--custom-sampler", action="store_true", help="a sampler of our own, not torch's"
    )
    parser.add_argument(
        "--mixture", action="store_true", help="a Mixture whose weights change at steps 3 and 9"
    )
    parser.add_argument(
        "--split-per-rank",
        action="store_true",
        help="an HF dataset split with split_dataset_by_node",
    )
    parser.add_argument("--resume-dir", help="ResumeCallback(dirpath=...) (default: OUT)")
    parser.add_argument(
        "--fill-disk-at", type=int, help="fill the resume directory's file system after this step"
    )
    parser.add_argument("--signal-at", type=int, help="--signal-name to rank 0 after this step")
    parser.add_argument("--signal-name", default="SIGTERM")
    parser.add_argument(
        "--strategy",
        help="default: ddp on several devices, else auto",
        choices=["ddp", "fsdp-full", "fsdp-sharded", "model-parallel", "model-parallel-auto"],
    )
    parser.add_argument(
        "--batch-log", help="also append one JSON line per step to BATCH_LOG/log-RANK.jsonl"
    )
    parser.add_argument(
        "--root",
        help="Trainer(default_root_dir=ROOT) (a URL: s3://..., file://...), ResumeCallback() "
        "without dirpath and ModelCheckpoint(dirpath=ROOT/ckpt); logs stay in OUT",
    )
    parser.add_argument(
        "--no-save-last", action="store_true", help="ModelCheckpoint(save_last=False)"
    )
    parser.add_argument(
        "--async-io", type=float, help="AsyncCheckpointIO over a writer this many seconds slow"
    )
    parser.add_argument(
        "--own-async-io",
        type=float,
        help="a user's own CheckpointIO writing from threads, this many seconds slow",
    )
    parser.add_argument(
        "--wait-at", type=int, help="after this step, write OUT/waiting and wait for OUT/go"
    )
    add_device_options(parser)
    args = parser.parse_args(argv)
    if args.resume and args.n_resume:
        args.items = args.n_resume
    torch.manual_seed(123)
    # under torchrun: safe across restarts
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and args.device == "cpu":
        init_process_group("gloo")
    trainer = L.Trainer(
        accelerator=args.device,
        devices=args.devices,
        strategy=strategy_of(args),
        precision="bf16-mixed" if args.bf16 else "32-true",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.root or args.out,
        deterministic=True,
        plugins=plugins(args),
        limit_val_batches=1.0 if args.val_every else 0,
        val_check_interval=args.val_every or None,
        callbacks=[
            *resume_callbacks(args),
            *([MixtureSchedule()] if args.mixture else []),
            Faults(args),
            # NOTE: Lightning's ModelCheckpoint takes a file: URL's text for a relative local
            # path
            ModelCheckpoint(
                dirpath=f"{local_path(args.root)}/ckpt" if args.root else Path(args.out) / "ckpt",
                every_n_train_steps=args.every,
                save_top_k=-1,
                save_last=not args.no_save_last,
                filename="{step}",
            ),
        ],
    )
    assert trainer.world_size == args.devices
    trainer.fit(Model(args), ckpt_path=args.resume)
    if torch.distributed.is_initialized():
        # NOTE: a gloo group left to the interpreter's teardown aborts the process now and then
        # ("terminate called without an active exception", SIGABRT: a gloo thread frees the last
        # collective's tensors while the interpreter finalizes). Destroyed here, once nothing holds
        # it (fit unwrapped the DDP model; the collector frees the wrapper), its threads are joined
        # first (docs/troubleshooting.md#abort-at-exit).
        trainer.strategy.barrier()
        del trainer
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        run_each(main, sys.argv[2])
    else:
        main()
