"""Ray Train + RayResume on scikit-learn's digits: stopped and rerun, the same digest.

    python ray_digits.py --out runs/ray_digits   # 2 CPU workers, a local Ray

``TorchTrainer`` with 2 workers (gloo); every worker's ``ResumableDataLoader`` takes its
share of each epoch, and ``RayResume`` reports a checkpoint every ``--every`` steps into
``OUT/storage/digits``. Interrupt the command (Ctrl-C, SIGTERM) and run it again: Ray
finds the run's last checkpoint under the same ``RunConfig(name, storage_path)`` and
training continues with the very next batch. The last line printed is a digest of the
final weights, the same for an interrupted-and-resumed job as for an uninterrupted one.
``--batch-log DIR`` writes one JSON line per step and worker.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn


def train_func(config: dict[str, Any]) -> None:
    import ray.train.torch

    from loader_resume import ResumableDataLoader
    from loader_resume.testing import fingerprint
    from loader_resume.tools.demo import NoisyDigits
    from ray_resume import RayResume, to_device

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
                        nn.Linear(64, 10))
    model = ray.train.torch.prepare_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # shards itself across Ray's workers
    loader = ResumableDataLoader(NoisyDigits(), batch_size=config["batch_size"],
                                 shuffle=True, seed=0, num_workers=config["workers"],
                                 audit=config["audit"])  # None: no audit log
    resume = RayResume(loader, model=model, optimizer=optimizer,
                       every_n_steps=config["every"])
    log = (Path(config["batch_log"], f"log-{rank}.jsonl").open("a")
           if config["batch_log"] else None)
    for epoch in resume.epochs(config["epochs"]):
        for x, y, ids in loader:
            x, y = to_device((x, y))
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            resume.step_end({"loss": loss.item(), "epoch": epoch})
            if log is not None:
                log.write(json.dumps({"step": resume.step, "epoch": epoch,
                                      "ids": ids.tolist(),
                                      "batch": fingerprint([x, y])}) + "\n")
                log.flush()
            time.sleep(config["sleep"])
    if rank == 0:
        Path(config["out"], "digest.txt").write_text(
            fingerprint([p.detach() for p in net.parameters()]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="runs/ray_digits")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=5,
                        help="report a checkpoint every N optimizer steps")
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader workers inside each Ray worker")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds per step (to interrupt it by hand)")
    parser.add_argument("--audit",
                        help="a directory each rank logs the batches it is handed to, "
                        "for `loader-resume audit DIR`")
    parser.add_argument("--batch-log",
                        help="write one JSON line per step to DIR/log-RANK.jsonl")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # a cluster of its own
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = {"out": str(out), "epochs": args.epochs, "every": args.every,
              "workers": args.workers, "batch_size": args.batch_size,
              "sleep": args.sleep,
              "audit": str(Path(args.audit).resolve()) if args.audit else None,
              "batch_log": (str(Path(args.batch_log).resolve()) if args.batch_log
                            else None)}
    trainer = TorchTrainer(train_func, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="digits",
                                                storage_path=str(out / "storage"),
                                                failure_config=FailureConfig(
                                                    max_failures=3)))
    trainer.fit()
    print(f"final weights digest: {(out / 'digest.txt').read_text()}", flush=True)


if __name__ == "__main__":
    main()
