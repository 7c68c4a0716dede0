"""A real Accelerate training script for test_accelerate.py.

    python accelerate_child.py OUT [options]                                  # one process
    accelerate launch --multi_gpu --num_processes 2 accelerate_child.py OUT   # two (gloo, CPU)
    python accelerate_child.py --batch PLAN   # one-process runs, one after another (batch.py)

Trains a small MLP with dropout on generated data whose items draw augmentation noise from torch,
numpy and random, with ``enable_resume``. Each process appends one JSON line per micro-batch to
OUT/log-RANK.jsonl (epoch, optimizer steps done, sample ids, fingerprint of the batch) — so a
restarted job's log continues the first run's — and writes OUT/weights-RANK.txt (fingerprint of the
final weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType
from torch import nn
from torch.utils.data import DataLoader

from accelerate_resume import AcceleratedResumableDataLoader, enable_resume
from loader_resume import Mixture
from loader_resume.distributed import init_process_group
from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.batch import fresh_accelerate, run_each
from support.data import NoisyEverywhere as Noisy
from support.data import NoisyStream
from support.device import add_device_options
from support.mounts import fill


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--processes", type=int, default=1, help="the world size this run must have"
    )
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds per step, to be signalled mid-epoch"
    )
    parser.add_argument("--signal-at", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="SIGTERM to itself after these micro-batches (a repeated one: twice)")
    parser.add_argument("--signal-rank", type=int, default=0, help="the rank that signals itself")
    parser.add_argument("--signal-name", default="SIGTERM", help="the signal of --signal-at")
    parser.add_argument(
        "--signal-in-save",
        action="store_true",
        help="SIGTERM to itself while a checkpoint is saved",
    )
    parser.add_argument(
        "--signal-in-eval",
        action="store_true",
        help="SIGTERM to itself during the first evaluation",
    )
    parser.add_argument(
        "--disk-full-at", type=int, help="torch.save fails with ENOSPC in the save at this step"
    )
    parser.add_argument(
        "--fill-disk-at",
        type=int,
        help="fill the checkpoint directory's file system after this "
        "micro-batch (a real full disk: mount a small tmpfs there)",
    )
    parser.add_argument(
        "--vanish-at", type=int, help="the save at this step finds its directory deleted"
    )
    parser.add_argument(
        "--save-at", type=int, help="accelerator.save_state(OUT/explicit) at this step, then crash"
    )
    parser.add_argument(
        "--break-at",
        type=int,
        help="a stop flag: break out of the epoch after this step, then "
        "accelerator.save_state(OUT/explicit) after the loop, then end",
    )
    parser.add_argument(
        "--load", help="accelerator.load_state(DIR) after prepare (automatic resume off)"
    )
    parser.add_argument("--stream", action="store_true", help="an IterableDataset without __len__")
    parser.add_argument(
        "--mixture", action="store_true", help="a Mixture whose weights change after steps 3 and 9"
    )
    parser.add_argument(
        "--eval-n", type=int, default=0, help="evaluate on this many items after each epoch"
    )
    parser.add_argument(
        "--log-dir", default="", help="logs and weights go to OUT/LOG_DIR (default: OUT)"
    )
    parser.add_argument(
        "--momentum", type=float, default=0.0, help="SGD's momentum: optimizer state to restore"
    )
    parser.add_argument(
        "--fsdp",
        choices=["full", "sharded"],
        help="FSDP (on a GPU; under torchrun): the plugin's "
        "state_dict_type FULL_STATE_DICT or SHARDED_STATE_DICT",
    )
    add_device_options(parser)
    parser.add_argument(
        "overrides", nargs="*", help="resume config dotlist, e.g. save_every_n_steps=4"
    )
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(123)
    # torchrun / accelerate launch: safe
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and args.device == "cpu":
        init_process_group("gloo")  # across restarts
    # NOTE: use_orig_params=True, as configs/accelerate_fsdp.yaml: the optimizer is made before
    # prepare (as the examples do), and torch's first FSDP without it keeps only flattened
    # parameters, so Accelerate's save_state cannot name the optimizer's (a KeyError in
    # FSDP.optim_state_dict, stock Accelerate's own behaviour).
    fsdp = None if args.fsdp is None else FullyShardedDataParallelPlugin(
        state_dict_type=f"{args.fsdp.upper()}_STATE_DICT", use_orig_params=True)
    accelerator = Accelerator(cpu=args.device == "cpu", project_dir=str(out), fsdp_plugin=fsdp,
                              gradient_accumulation_steps=args.accumulate,
                              mixed_precision="bf16" if args.bf16 else "no")
    assert (accelerator.distributed_type == DistributedType.FSDP) == (fsdp is not None), (
        accelerator.distributed_type
    )
    assert accelerator.num_processes == args.processes, (accelerator.num_processes, args.processes)
    rank = accelerator.process_index
    config = {"seed": 7, "auto_resume": args.load is None}
    resume = enable_resume(accelerator, config, overrides=args.overrides)

    def signal_self() -> None:
        if rank == args.signal_rank:
            os.kill(os.getpid(), signal.Signals[args.signal_name])

    if args.signal_in_save:
        accelerator.register_save_state_pre_hook(lambda *_: signal_self())
    if args.disk_full_at is not None:
        real_save = torch.save

        def full_disk(obj: Any, f: Any, *a: Any, **k: Any) -> None:
            if resume.step == args.disk_full_at and rank == 0 and isinstance(f, (str, os.PathLike)):
                raise OSError(28, "No space left on device (simulated)")
            real_save(obj, f, *a, **k)

        torch.save = full_disk  # type: ignore[assignment]
    if args.vanish_at is not None:
        def vanish(models: Any, weights: Any, output_dir: str) -> None:
            if resume.step == args.vanish_at and rank == 0:
                shutil.rmtree(output_dir)  # as another process deleting it would

        accelerator.register_save_state_pre_hook(vanish)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=args.momentum)
    data: Any = NoisyStream(args.items, rank, args.processes) if args.stream else Noisy(args.items)
    if args.mixture:
        data = Mixture({"a": data, "b": Noisy(9)}, {"a": 2, "b": 1}, block_size=6)
    train = DataLoader(
        data,
        batch_size=4,
        shuffle=not (args.stream or args.mixture),
        num_workers=args.workers,
        pin_memory=args.pin_memory,
    )
    evaluation = DataLoader(Noisy(max(args.eval_n, 1)), batch_size=4, num_workers=0)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    assert isinstance(train, AcceleratedResumableDataLoader) and train.world_size == args.processes
    if args.load:
        accelerator.load_state(args.load)

    logs = out / args.log_dir
    logs.mkdir(parents=True, exist_ok=True)
    log = (logs / f"log-{rank}.jsonl").open("a")
    # torchrun's restarts (chaos tests)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    micro = 0
    for epoch in resume.epochs(args.epochs):
        model.train()
        for x, y, ids in train:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            # a schedule by step
            if args.mixture and accelerator.sync_gradients and resume.step in (3, 9):
                data.set_weights({"a": 1, "b": 2} if resume.step == 3 else {"a": 1, "b": 0})
            micro += 1
            row = {
                "attempt": attempt,
                "epoch": epoch,
                "step": resume.step,
                "sync": accelerator.sync_gradients,
                "ids": ids.tolist(),
                "batch": fingerprint([x, y]),
            }
            log.write(json.dumps(row) + "\n")
            log.flush()
            if args.sleep:
                time.sleep(args.sleep)
                (out / f"progress-{rank}").write_text(str(resume.step))
            if args.fill_disk_at == micro and rank == 0:
                fill(resume.checkpoint_dir / "filler")
            for _ in range(args.signal_at.count(micro)):
                signal_self()
            if args.save_at == resume.step and accelerator.sync_gradients:
                accelerator.save_state(str(out / "explicit"))
                accelerator.wait_for_everyone()
                # NOTE: gloo aborts a process whose peer vanished mid-connection
                accelerator.end_training()
                os._exit(0)  # a crash right after the save: nothing else is written
            if args.break_at == resume.step and accelerator.sync_gradients:
                break
        # NOTE: the save after the loop it left
        if args.break_at is not None and args.break_at == resume.step:
            accelerator.save_state(str(out / "explicit"))
            accelerator.wait_for_everyone()
            accelerator.end_training()
            os._exit(0)
        if args.eval_n:
            model.eval()
            seen = []
            for _, _, ids in evaluation:
                seen += accelerator.gather_for_metrics(ids).tolist()
                if args.signal_in_eval and epoch == 0:
                    signal_self()
            if rank == 0:
                log.write(json.dumps({"epoch": epoch, "eval": seen}) + "\n")
                log.flush()
    weights = fingerprint([p.detach() for p in model.parameters()])
    (logs / f"weights-{rank}.txt").write_text(weights)
    accelerator.wait_for_everyone()
    # NOTE: the DDP wrapper freed before the group is torn down, as enable_resume does before its
    # own teardown: gloo aborts a rank whose threads still hold a collective's tensors at exit
    # ("terminate called ...", -6)
    del model, optimizer
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    # NOTE: not for --disk-full-at, which replaces torch.save for the process
    if sys.argv[1] == "--batch":
        run_each(main, sys.argv[2], fresh_accelerate)
    else:
        main()
