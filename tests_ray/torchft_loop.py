"""A real Ray Train job in TorchFT mode for the Ray suite: ``TorchTrainer`` with Ray's
``TorchftConfig`` (Ray starts the lighthouse and runs each worker as a replica group of one
process, replacing a group whose worker dies) and ``TorchFTResume`` in the training function.

Each worker appends one JSON line per step to ``OUT/log-GROUP.jsonl`` in the rows of
``tests_torchft/children/group.py`` (``take``: the quorum, the participant's rank and count, the
sample ids and each sample's augmentation digest; ``end``: whether the step committed and a digest
of the weights), so ``tests_torchft/accounting.py`` checks them; ``TorchFTResume`` keeps its audit
in ``OUT/audit``. ``kill_at`` (group, step): that
group's worker SIGKILLs itself once that many steps are committed, once per job (a marker file).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accounting import Noisy, digest
from torch.utils.data import DataLoader


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    from torchft import Manager, ProcessGroupGloo

    from torchft_resume import TorchFTResume

    group = ray.train.get_context().get_world_rank()  # one worker a replica group
    out = Path(config["out"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Ray's backend sets TORCHFT_LIGHTHOUSE, MASTER_ADDR and MASTER_PORT (the group's store)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
        load_state_dict=None, state_dict=None, use_async_quorum=False,
        replica_id=f"group{group}", rank=0, world_size=1,
        timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=60),
    )
    loader = DataLoader(Noisy(config["n"]), batch_size=4, shuffle=True,
                        num_workers=config["workers"])
    resume = TorchFTResume(manager, loader, seed=3, model=model, optimizer=optimizer,
                           audit=out / "audit")
    log = (out / f"log-{group}.jsonl").open("a")

    def write(row: dict[str, object]) -> None:
        log.write(json.dumps({**row, "group": group, "pid": os.getpid(), "time": time.time()})
                  + "\n")
        log.flush()

    for batch in resume.batches(config["epochs"]):
        before = manager.current_step()
        write({"t": "take", "step": before, "epoch": resume.epoch, "quorum": manager._quorum_id,
               "participant": [manager.participating_rank(), manager.num_participants()],
               "ids": batch["id"].tolist(), "noise": [digest([x]) for x in batch["x"]]})
        time.sleep(config["step_seconds"])
        ((model(batch["x"]) - 1.0) ** 2).mean().backward()
        resume.average_gradients(model.parameters())
        committed = resume.commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        write({"t": "end", "step": before, "committed": committed,
               "weights": digest(list(model.parameters()))})
        marker = out / "killed"
        if (committed and config["kill_at"] == [group, manager.current_step()]
                and not marker.exists()):
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    manager.shutdown(wait=False)


def fit(out: Path, *, n: int, epochs: int, workers: int = 0, kill_at: tuple[int, int] | None = None,
        groups: int = 3, step_seconds: float = 0.25) -> str | None:
    """One ``TorchTrainer.fit()`` in TorchFT mode in this process's Ray cluster: ``None``, or the
    text of the error it failed with."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    out.mkdir(parents=True, exist_ok=True)
    config = {"out": str(out), "n": n, "epochs": epochs, "workers": workers,
              "kill_at": list(kill_at) if kill_at else None, "step_seconds": step_seconds}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=groups),
        torch_config=TorchftConfig(
            lighthouse_kwargs={"min_replicas": 2, "join_timeout_ms": 5000, "quorum_tick_ms": 50,
                               "heartbeat_timeout_ms": 1500},
            backend="gloo"),
        run_config=RunConfig(name="torchft", storage_path=str(out / "storage"),
                             failure_config=FailureConfig(max_failures=2)),
    )
    try:
        trainer.fit()
    except TrainingFailedError as error:
        return str(error)
    return None
