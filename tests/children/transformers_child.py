"""A real transformers Trainer run for test_transformers.py.

    python transformers_child.py OUT [options]                            # one process
    torchrun --nproc_per_node 2 transformers_child.py OUT --processes 2   # two (gloo, CPU)
    python transformers_child.py --batch PLAN   # one-process runs, one after another (batch.py)

A tiny model (dropout, returns ``{"loss": ...}``) on generated data whose items draw augmentation
noise from torch, numpy and random, and whose collator draws from numpy, trained by
``ResumableTrainer`` (``--stock``: ``Trainer``), checkpointing every step. Each process appends one
JSON line per training micro-batch to OUT/log-RANK.jsonl (the sample ids and a fingerprint of the
batch's values) and one per optimizer step to OUT/lr-RANK.jsonl (its learning rate), so a resumed
run's logs continue the first run's, and writes OUT/weights-RANK.txt (a fingerprint of the final
weights).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.batch import fresh_accelerate, run_each
from support.data import NoisyEverywhere, NoisyStream
from support.device import add_device_options
from support.mounts import fill
from transformers_resume import ResumableTrainer


class Items(NoisyEverywhere):
    """The shared data as dicts, the form Trainer's default collator stacks; counts its reads (in
    DataLoader workers too: they are forked and share the counter)."""

    reads = multiprocessing.Value("i", 0)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        with Items.reads.get_lock():
            Items.reads.value += 1
        x, y, i = super().__getitem__(index)
        return {"x": x, "labels": y, "idx": i}


class ItemsStream(NoisyStream):
    """The same data as a stream with its position as state (an iterable dataset: Trainer needs
    max_steps)."""

    def __iter__(self) -> Any:
        for x, y, i in super().__iter__():
            with Items.reads.get_lock():
                Items.reads.value += 1
            yield {"x": x, "labels": y, "idx": i}


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stacks the items and adds a per-batch augmentation drawn from numpy (as a collator may)."""
    batch = {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}
    batch["x"] = batch["x"] + float(np.random.rand()) * 0.01
    return batch


class Tiny(nn.Module):
    def __init__(self, log: Any, sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        self.log, self.sleep = log, sleep

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        if self.training:
            self.log.write(
                json.dumps({"ids": idx.tolist(), "batch": fingerprint([x, labels])}) + "\n"
            )
            self.log.flush()
            time.sleep(self.sleep)
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


class CrashAfterSave(TrainerCallback):
    """Ends the process right after the checkpoint of ``step`` is written: a crash, nothing else is
    saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            os._exit(0)


class LogLearningRate(TrainerCallback):
    """Appends the learning rate of each optimizer step, as it begins, to OUT/lr-RANK.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps({"step": state.global_step + 1,
                                   "lr": kwargs["optimizer"].param_groups[0]["lr"]}) + "\n")


class SignalAt(TrainerCallback):
    """Rank 0 sends itself ``signal_name`` at the end of optimizer step ``step`` (before the ranks
    agree on signals), as a scheduler signalling one task of a job would."""

    def __init__(self, step: int, signal_name: str) -> None:
        self.step, self.signal = step, signal.Signals[signal_name]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and int(os.environ.get("RANK", 0)) == 0:
            os.kill(os.getpid(), self.signal)


class FillDiskAt(TrainerCallback):
    """Rank 0 fills the file system of ``directory`` at the end of optimizer step ``step`` (before
    its save)."""

    def __init__(self, step: int, directory: Path) -> None:
        self.step, self.directory = step, directory

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and int(os.environ.get("RANK", 0)) == 0:
            fill(self.directory / "filler")


class SlowRankTrainer(ResumableTrainer):
    """One rank writes its last checkpoint file late (a slow disk on that node)."""

    slow_rank = 1

    def _save_rng_state(self, output_dir: str) -> None:
        if self.args.process_index == self.slow_rank:
            time.sleep(0.5)
        super()._save_rng_state(output_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--processes", type=int, default=1, help="the world size this run must have"
    )
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--crash-at", type=int, help="end the process right after the checkpoint of this step"
    )
    parser.add_argument(
        "--signal-at", type=int, help="rank 0 sends itself --signal-name at the end of this step"
    )
    parser.add_argument("--signal-name", default="SIGTERM")
    parser.add_argument(
        "--fill-disk-at",
        type=int,
        help="rank 0 fills OUT/run's file system at the end of this step",
    )
    parser.add_argument(
        "--slurm-requeue", action="store_true", help="ResumableTrainer(slurm_requeue=True)"
    )
    parser.add_argument("--remote", help="ResumableTrainer(remote=URL): checkpoints copied there")
    parser.add_argument(
        "--slow-rank", type=int, help="this rank writes its RNG file 0.5 s late at each checkpoint"
    )
    parser.add_argument("--stream", action="store_true", help="an iterable dataset (20 steps)")
    parser.add_argument("--save-steps", type=int, default=1)
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds each training micro-batch takes"
    )
    parser.add_argument(
        "--jit", action="store_true", help="TrainingArguments(enable_jit_checkpoint=True)"
    )
    parser.add_argument(
        "--resume",
        default=None,
        help="'true' or a checkpoint path for train(resume_from_checkpoint)",
    )
    parser.add_argument("--ignore-data-skip", action="store_true")
    parser.add_argument("--stock", action="store_true", help="a stock transformers Trainer")
    add_device_options(parser)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    log = (out / f"log-{rank}.jsonl").open("a")
    Items.reads.value = 0  # this run's reads (a batch makes several runs in one process)
    torch.manual_seed(123)
    model = Tiny(log, args.sleep)
    training = TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        ddp_backend="gloo" if args.processes > 1 and args.device == "cpu" else None,
        report_to=[],
        seed=7,
        max_steps=20 if args.stream else -1,
        ignore_data_skip=args.ignore_data_skip,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate,
        num_train_epochs=args.epochs,
        learning_rate=0.1,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_strategy="no",
        dataloader_num_workers=args.workers,
        disable_tqdm=True,
        **({"enable_jit_checkpoint": True} if args.jit else {}),
    )
    kind = (
        Trainer if args.stock else ResumableTrainer if args.slow_rank is None else SlowRankTrainer
    )
    if args.slow_rank is not None:
        SlowRankTrainer.slow_rank = args.slow_rank
    callbacks: list[Any] = [LogLearningRate(out / f"lr-{rank}.jsonl")]
    callbacks += [] if args.crash_at is None else [CrashAfterSave(args.crash_at)]
    callbacks += [] if args.signal_at is None else [SignalAt(args.signal_at, args.signal_name)]
    callbacks += [] if args.fill_disk_at is None else [FillDiskAt(args.fill_disk_at, out / "run")]
    data = ItemsStream(30, rank=0, world=1) if args.stream else Items(30)
    options = {} if args.stock else {"slurm_requeue": args.slurm_requeue, "remote": args.remote}
    trainer = kind(
        model=model,
        args=training,
        train_dataset=data,
        data_collator=collate,
        callbacks=callbacks,
        **options,
    )
    assert trainer.args.world_size == args.processes, (trainer.args.world_size, args.processes)
    resume: str | bool | None = True if args.resume == "true" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    (out / f"weights-{rank}.txt").write_text(fingerprint([p.detach() for p in model.parameters()]))
    (out / f"reads-{rank}.txt").write_text(str(Items.reads.value))
    trainer.accelerator.wait_for_everyone()
    # NOTE: gloo aborts a process (SIGABRT) whose process group is left to the interpreter's
    # teardown; the DDP wrapper holds the group (past destroy_process_group), so it goes first
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        run_each(main, sys.argv[2], fresh_accelerate)
    else:
        main()
