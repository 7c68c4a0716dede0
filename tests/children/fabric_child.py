"""A real Lightning Fabric training script for test_fabric.py.

    python fabric_child.py OUT --devices 2    # Fabric's own launcher starts rank 1 (gloo, CPU)

Trains a small MLP with dropout and a step LR schedule on generated data whose items draw
augmentation noise from torch, numpy and random, under ``FabricResume``. Each rank appends one JSON
line per micro-batch to OUT/log-RANK.jsonl (epoch, optimizer steps done, sample ids, fingerprint of
the batch), so a rerun's log continues the first run's, and writes OUT/weights-RANK.txt (fingerprint
of the final weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.plugins import AsyncCheckpointIO
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_resume import FabricResumableDataLoader, FabricResume
from loader_resume import Mixture
from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.data import NoisyEverywhere, NoisyStream
from support.device import add_device_options
from support.mounts import fill


class SlowIO(TorchCheckpointIO):
    """Lightning's own checkpoint IO, ``seconds`` slower per file."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        time.sleep(self.seconds)
        super().save_checkpoint(checkpoint, path, storage_options)


class CPUFSDPStrategy(FSDPStrategy):
    """Fabric's ``FSDPStrategy``, its FSDP (torch's first) placed on the CPU: Fabric passes FSDP no
    device there, which torch refuses, and refuses the strategy with ``accelerator="cpu"`` (a
    subclass is let through)."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=module,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self._fsdp_kwargs,
        )


def shard_fsdp2(model: nn.Module, mesh: Any) -> nn.Module:
    """``ModelParallelStrategy``'s ``parallelize_fn``: FSDP2 over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def strategy_of(args: argparse.Namespace) -> Any:
    # Fabric's own strategy
    if args.strategy and args.strategy.startswith("fsdp-") and args.device == "cuda":
        return FSDPStrategy(state_dict_type=args.strategy[len("fsdp-"):])
    # NOTE: "full" on the CPU: FSDP1 crashes there
    if args.strategy and args.strategy.startswith("fsdp-"):
        return CPUFSDPStrategy(
            state_dict_type=args.strategy[len("fsdp-") :], process_group_backend="gloo"
        )
    if args.strategy == "model-parallel":
        return ModelParallelStrategy(parallelize_fn=shard_fsdp2, data_parallel_size=args.devices,
                                     tensor_parallel_size=1)
    return "ddp" if args.devices > 1 else "auto"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1, help="the world size this run must have")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="an IterableDataset without __len__")
    parser.add_argument(
        "--mixture", action="store_true", help="a Mixture whose weights change after steps 3 and 9"
    )
    parser.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        help="seconds per micro-batch, to be signalled mid-epoch",
    )
    parser.add_argument(
        "--signal-at", type=int, help="rank 0 sends itself SIGTERM after this micro-batch"
    )
    parser.add_argument(
        "--save-at",
        type=int,
        help="fabric.save(OUT/explicit.ckpt) with the loader in the state at "
        "this optimizer step, then end the process at once",
    )
    parser.add_argument("--signal-name", default="SIGTERM", help="the signal of --signal-at")
    parser.add_argument(
        "--slurm-requeue", action="store_true", help="FabricResume(slurm_requeue=True)"
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="FabricResume(save_every_n_steps=...)"
    )
    parser.add_argument("--keep", type=int, default=2, help="FabricResume(keep=...)")
    parser.add_argument(
        "--remote", help="FabricResume(remote=URL): checkpoints copied to object storage"
    )
    parser.add_argument(
        "--fill-disk-at",
        type=int,
        help="rank 0 fills the checkpoint directory's file system after "
        "this micro-batch (a real full disk: mount a small tmpfs there)",
    )
    parser.add_argument("--strategy", choices=["fsdp-sharded", "fsdp-full", "model-parallel"],
                        help="default: ddp on several devices, else auto")
    parser.add_argument(
        "--async-io",
        type=float,
        help="Lightning's AsyncCheckpointIO over a writer this many seconds "
        "slower per file (a large checkpoint on slow storage)",
    )
    parser.add_argument(
        "--load", help="fabric.load(PATH) with the loader in the state, after restore()"
    )
    add_device_options(parser)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    fabric = Fabric(
        accelerator=args.device,
        devices=args.devices,
        strategy=strategy_of(args),
        precision="bf16-mixed" if args.bf16 else "32-true",
        plugins=None if args.async_io is None else [AsyncCheckpointIO(SlowIO(args.async_io))],
    )
    fabric.launch()
    assert fabric.world_size == args.devices, (fabric.world_size, args.devices)
    rank = fabric.global_rank
    resume = FabricResume(
        fabric,
        seed=7,
        checkpoint_dir=out / "resume_checkpoints",
        slurm_requeue=args.slurm_requeue,
        save_every_n_steps=args.save_every,
        keep=args.keep,
        remote=args.remote,
    )
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    # NOTE: a sharded model first, then its optimizer (with state to shard) over its parameters
    if args.strategy:
        model = fabric.setup_module(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        model, optimizer = fabric.setup(model, optimizer)
    data: Any = (
        NoisyStream(args.items, rank, args.devices) if args.stream else NoisyEverywhere(args.items)
    )
    if args.mixture:
        data = Mixture({"a": data, "b": NoisyEverywhere(9)}, {"a": 2, "b": 1}, block_size=6)
    train = fabric.setup_dataloaders(
        DataLoader(
            data,
            batch_size=4,
            shuffle=not (args.stream or args.mixture),
            num_workers=args.workers,
            pin_memory=args.pin_memory,
        )
    )
    assert isinstance(train, FabricResumableDataLoader) and train.world_size == args.devices
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    resume.restore(state)
    if args.load:
        fabric.load(args.load, {**state, "loader": train})

    log = (out / f"log-{rank}.jsonl").open("a")
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    micro = 0
    for epoch in resume.epochs(args.epochs):
        for x, y, ids in train:
            model.train()
            loss = nn.functional.cross_entropy(model(x), y) / args.accumulate
            micro += 1
            stepping = micro % args.accumulate == 0 or train.end_of_dataloader
            with fabric.no_backward_sync(model, enabled=not stepping):
                fabric.backward(loss)
            if stepping:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                if args.mixture and resume.step in (3, 9):  # a weight schedule by optimizer step
                    data.set_weights({"a": 1, "b": 2} if resume.step == 3 else {"a": 1, "b": 0})
            row = {
                "epoch": epoch,
                "step": resume.step,
                "ids": ids.tolist(),
                "batch": fingerprint([x, y]),
                "lr": scheduler.get_last_lr()[0],
            }
            log.write(json.dumps(row) + "\n")
            log.flush()
            if args.sleep:
                time.sleep(args.sleep)
                (out / f"progress-{rank}").write_text(str(resume.step))
            if args.fill_disk_at == micro and rank == 0:
                fill(out / "resume_checkpoints" / "filler")
            if args.signal_at == micro and rank == 0:
                os.kill(os.getpid(), signal.Signals[args.signal_name])
            if args.save_at is not None and args.save_at == resume.step and stepping:
                fabric.save(out / "explicit.ckpt", {**state, "loader": train})
                fabric.barrier()
                os._exit(0)  # a crash right after the save: nothing else is written
    weights = fingerprint(
        [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
    )
    (out / f"weights-{rank}.txt").write_text(weights)
    fabric.barrier()
    # NOTE: gloo aborts a process (SIGABRT, "terminate called without an active exception") whose
    # process group is left to the interpreter's teardown; the DDP wrapper holds the group, so it
    # goes first
    del model, optimizer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
