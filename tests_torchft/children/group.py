"""One replica group (one process) of a TorchFT job, for the tests: trains a small model on
generated data with ``TorchFTResume`` and writes one JSON line per step to OUT/log-GROUP.jsonl.

    python group.py OUT GROUP LIGHTHOUSE [--epochs E] [--workers W] [--samples N] [--kill-at STEP]

``--kill-at STEP``: SIGKILL itself once STEP steps are committed (between steps).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchft import Manager, ProcessGroupGloo
from torchft.data import DistributedSampler

from torchft_resume import TorchFTResume

# the suite's data and digests (tests_torchft/accounting.py)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accounting import Noisy, digest


class Model(torch.nn.Module):
    """A linear layer, and a large parameter that keeps the gradient exchange in flight for a
    while (the loss adds zero times its sum: its gradient is zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.large = torch.nn.Parameter(torch.zeros(1 << 22))
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 0.0 * self.large.sum()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("group", type=int)
    parser.add_argument("lighthouse")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--audit", type=Path, help="TorchFTResume(audit=...)")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--step-seconds", type=float, default=0.25,
                        help="a step's least duration (a restarted group rejoins a running job)")
    parser.add_argument("--own-allreduce", action="store_true",
                        help="average the gradients with the script's own allreduce calls")
    parser.add_argument("--sampler", choices=["ours", "torchft"], default="ours",
                        help="torchft: TorchFT's own DistributedSampler and a plain loader")
    parser.add_argument("--die-in-exchange", type=int,
                        help="SIGKILL itself once the gradient exchange of this step has begun")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # NOTE: under torchrun (one process a group) the store is torchrun's, named by its MASTER_ADDR
    # and MASTER_PORT, and RANK and WORLD_SIZE are its; alone, the group makes its own
    alone = "TORCHELASTIC_RUN_ID" not in os.environ
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if alone else None
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
        load_state_dict=None, state_dict=None,
        use_async_quorum=False, lighthouse_addr=args.lighthouse, replica_id=f"group{args.group}",
        store_addr="127.0.0.1" if store else None, store_port=store.port if store else None,
        rank=0 if store else None, world_size=1 if store else None,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30),
    )
    log = (args.out / f"log-{args.group}.jsonl").open("a")

    def write(row: dict[str, object]) -> None:
        log.write(json.dumps({**row, "group": args.group, "pid": os.getpid(),
                              "time": time.time()}) + "\n")
        log.flush()

    def step(batch: dict[str, torch.Tensor], epoch: int, exchange: Callable[[], None],
             commit: Callable[[], bool]) -> None:
        before = manager.current_step()
        write({"t": "take", "step": before, "epoch": epoch, "quorum": manager._quorum_id,
               "participant": [manager.participating_rank(), manager.num_participants()],
               "ids": batch["id"].tolist(), "noise": [digest([x]) for x in batch["x"]]})
        time.sleep(args.step_seconds)
        loss = ((model(batch["x"]) - 1.0) ** 2).mean()
        loss.backward()
        if args.die_in_exchange == before + 1:
            # NOTE: the exchange begun (the large gradient in flight), then the process is gone
            manager.allreduce(model.large.grad)
            os.kill(os.getpid(), signal.SIGKILL)
        exchange()
        committed = commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        write({"t": "end", "step": before, "committed": committed,
               "weights": digest(list(model.parameters()))})
        marker = args.out / f"killed-{args.group}"  # NOTE: once (torchrun reruns the command)
        if (committed and args.kill_at is not None and manager.current_step() == args.kill_at
                and not marker.exists()):
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def own_allreduce() -> None:
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()

    dataset = Noisy(args.samples)
    if args.sampler == "torchft":
        # NOTE: TorchFT's own recipe, for the benchmark beside ours: its sampler, a plain loader
        sampler = DistributedSampler(dataset, replica_rank=args.group, num_replica_groups=3,
                                     group_rank=0, num_replicas=1, shuffle=True, seed=3)
        plain = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=args.workers)
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        manager.register_state_dict_fn("optimizer", optimizer.load_state_dict,
                                       optimizer.state_dict)
        write({"t": "start", "step": manager.current_step(), "loaded_from": "None",
               "weights": digest(list(model.parameters()))})

        epoch = 0
        while manager.batches_committed() * 4 < args.samples * args.epochs:
            sampler.set_epoch(epoch)
            for batch in plain:
                manager.start_quorum()
                if manager.batches_committed() * 4 >= args.samples * args.epochs:
                    break
                step(batch, epoch, own_allreduce, manager.should_commit)
            epoch += 1
        manager.shutdown(wait=False)
        return 0
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=args.workers)
    resume = TorchFTResume(manager, loader, seed=3, model=model, optimizer=optimizer,
                           checkpoint_dir=args.checkpoint_dir, save_every_n_steps=args.save_every,
                           audit=args.audit)
    write({"t": "start", "step": manager.current_step(), "loaded_from": str(resume.loaded_from),
           "weights": digest(list(model.parameters()))})
    for batch in resume.batches(args.epochs):
        exchange = (own_allreduce if args.own_allreduce
                    else lambda: resume.average_gradients(model.parameters()))
        step(batch, resume.epoch, exchange, resume.commit)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
