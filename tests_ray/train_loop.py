"""A real Ray Train job for the Ray suite: ``TorchTrainer`` over 2 CPU workers (gloo) with
``RayResume``.

Every worker appends one JSON line per optimizer step to ``LOGS/log-RANK-ATTEMPT.jsonl`` (step,
epoch, sample ids, a fingerprint of the batch with its augmentation values drawn from torch, numpy
and random) and rank 0 writes ``LOGS/weights.txt`` at the end. A scheduler steps after each epoch's
loop (its learning rate is in the log). ``crash_at``: the given rank ends its process
(``os._exit(1)``) right after that step, once per job (a marker file), and Ray restarts the workers
from the last registered checkpoint. ``limit``: each epoch leaves its pass after that many steps.
Each line also names the node the worker ran on. ``gate`` (step, file): after that step every worker
waits for the file (the test writes it once it has acted on the cluster); ``notice_at`` (step):
after it every worker waits for Ray's preemption notice.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

ITEMS = 40


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Items whose values draw noise from torch, numpy and random, as augmentations do."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        base = torch.arange(8, dtype=torch.float32) * (index + 1) / ITEMS
        noise = torch.rand(8) + float(np.random.rand()) + random.random()
        return base + 0.1 * noise, torch.tensor(index % 2), index


def train_func(config: dict[str, Any]) -> None:
    import ray
    import ray.train
    import ray.train.torch

    from loader_resume import ResumableDataLoader
    from loader_resume.testing import fingerprint
    from ray_resume import RayResume, to_device

    context = ray.train.get_context()
    rank, logs = context.get_world_rank(), Path(config["logs"])
    attempt = time.time_ns()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # stepped after each epoch
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = ResumableDataLoader(
        Augmented(), batch_size=4, shuffle=True, seed=7, num_workers=config["workers"]
    )
    assert loader.world_size == context.get_world_size()
    iterated = loader
    # the user's loader through Ray's prepare_data_loader: never exact
    if config.get("prepare") is not None:
        iterated = ray.train.torch.prepare_data_loader(
            loader, add_dist_sampler=config["prepare"] == "default"
        )
    given = iterated if config.get("give_prepared") else loader
    resume = RayResume(
        given,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        every_n_steps=config["every"],
        check_every_n_steps=config.get("check_every", 10),
    )
    node = ray.get_runtime_context().get_node_id()
    log = (logs / f"log-{rank}-{attempt}.jsonl").open("a")
    for epoch in resume.epochs(config["epochs"]):
        for x, y, ids in iterated:
            if config.get("limit") and resume.step >= (epoch + 1) * config["limit"]:
                # a loop that leaves its passes early counts from the restored step, never from
                # enumerate
                break
            x, y = to_device((x, y))
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            resume.step_end({"loss": loss.item()})
            log.write(json.dumps({"step": resume.step, "epoch": epoch, "ids": ids.tolist(),
                                  "batch": fingerprint([x, y]), "lr": scheduler.get_last_lr()[0],
                                  "node": node}) + "\n")
            log.flush()
            crash = config.get("crash_at")
            if crash is not None and rank == crash[0] and resume.step == crash[1]:
                marker = logs / "crashed"
                if not marker.exists():
                    marker.write_text(str(resume.step))
                    time.sleep(config.get("crash_delay", 0.0))
                    os._exit(1)
            # the test acts on the cluster meanwhile
            if resume.step == config.get("gate", [None])[0]:
                while not Path(config["gate"][1]).exists():
                    time.sleep(0.05)
            # every worker asks as often: rank 0's answer is theirs
            if resume.step == config.get("notice_at"):
                while ray.train.get_preemption_info() is None:
                    time.sleep(0.2)
            time.sleep(config.get("sleep", 0.0))
        # the epoch's own code, after its loop: a checkpoint due at its last step comes after it
        scheduler.step()
    if rank == 0:
        weights = [
            p.detach() for p in (model.module if hasattr(model, "module") else model).parameters()
        ]
        (logs / "weights.txt").write_text(fingerprint(weights))


def fit(
    logs: Path,
    storage: Path,
    *,
    workers: int = 0,
    num_workers: Any = 2,
    epochs: int = 2,
    every: int = 2,
    max_failures: int = 0,
    name: str = "run",
    **extra: Any,
) -> str | None:
    """One ``TorchTrainer.fit()`` in this process's Ray cluster: ``None``, or the text of the error
    it failed with."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    logs.mkdir(parents=True, exist_ok=True)
    config = {"logs": str(logs), "workers": workers, "epochs": epochs, "every": every, **extra}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as error:
        return str(error)
    return None


def steps(logs: Path, rank: int) -> dict[int, list[Any]]:
    """Each step's batch on ``rank``, over every attempt; a step replayed after a restart must be
    the same batch as the first time (else ``AssertionError``)."""
    seen: dict[int, list[Any]] = {}
    for path in sorted(logs.glob(f"log-{rank}-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            value = [row["epoch"], row["ids"], row["batch"], row["lr"]]
            assert seen.setdefault(row["step"], value) == value, (
                f"step {row['step']} replayed differently"
            )
    return seen


def rows(logs: Path, rank: int) -> list[list[dict[str, Any]]]:
    """Each attempt's log lines on ``rank``, oldest attempt first (a file per attempt, named by its
    start); a line still being written is left out."""
    return [[json.loads(line) for line in path.read_text().split("\n")[:-1]]
            for path in sorted(logs.glob(f"log-{rank}-*.jsonl"))]


def when(logs: Path, rank: int, step: int, then: Callable[[str], None]) -> threading.Thread:
    """A thread that waits until ``rank`` logged ``step``, then calls ``then`` with the node it ran
    on."""
    def watch() -> None:
        while True:
            seen = [row for attempt in rows(logs, rank) for row in attempt if row["step"] >= step]
            if seen:
                then(seen[0]["node"])
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
