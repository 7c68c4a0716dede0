"""One attempt of a small job with ``audit=DIR``, as a real process: the tests of ``loader-resume
audit`` run two or three in a row (a rank each, side by side, for a world of 2), with a crash, a
``break`` or a state of their choosing.

    python tests/children/audit_child.py AUDIT_DIR OUT.json [--rank R --world W] [--load STATE]
        [--save-at K STATE] [--steps S] [--kill-at S] [--epochs E]
        [--break-at B STATE [--pass-ended]] [--limit K] [--regression] [--stream --workers N]
        [--free-after K PATH] [--n N] [--drop-last] [--as-one] [--sleep SECONDS]

Each batch holds the samples' ids (and a keyed random draw); every delivered ``(epoch, ids)`` is
written to OUT.json, the test's own record of what the attempt saw. ``--steps S``: the attempt stops
(exit 3, a crash) after S batches; ``--kill-at S``: it SIGKILLs itself after S batches (its buffered
records are lost). ``--free-after K PATH``: after K batches, PATH is removed (room made on a full
disk). ``--as-one``: under ``torchrun``, the process group is set up, and then every process builds
its loader as ``rank=0, world_size=1`` (a mistake: each reads everything); RANK in OUT and STATE
paths is replaced by the process's rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader

N = 100


class Ids(Dataset[dict[str, Any]]):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "noise": torch.rand(())}


class Lines(IterableDataset[dict[str, Any]]):
    """A stream of ids, split between workers, that knows how far it got (``state_dict``)."""

    def __init__(self) -> None:
        self.done = 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(worker, N, workers))
        while self.done < len(mine):
            self.done += 1
            yield {"id": mine[self.done - 1], "noise": torch.rand(())}

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]

    def set_epoch(self, epoch: int) -> None:
        self.done = 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("audit")
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--load")
    parser.add_argument("--save-at", nargs=2, action="append", default=[])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--break-at", nargs=2)
    parser.add_argument("--pass-ended", action="store_true")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument(
        "--limit", type=int, help="leave every pass after so many batches (limit_train_batches)"
    )
    parser.add_argument(
        "--regression", action="store_true", help="a library whose states skip the pass in flight"
    )
    parser.add_argument("--free-after", nargs=2)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--n", type=int, default=N)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--as-one", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds a step takes")
    args = parser.parse_args()
    if args.as_one:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
        mine = os.environ["RANK"]
        args.out = args.out.replace("RANK", mine)
        args.save_at = [[step, path.replace("RANK", mine)] for step, path in args.save_at]
        args.load = args.load.replace("RANK", mine) if args.load else None
    # NOTE: a wrong library on purpose: every state describes the next pass's start
    if args.regression:
        from loader_resume.order.map_position import MapPosition

        position_state = MapPosition.state
        MapPosition.state = (  # type: ignore[method-assign]
            lambda self, ago=0, pass_ended=False: position_state(self, ago, True)
        )
    dataset = Lines() if args.stream else Ids(args.n)
    loader = ResumableDataLoader(
        dataset,
        batch_size=8,
        shuffle=not args.stream,
        seed=11,
        rank=args.rank,
        world_size=args.world,
        num_workers=args.workers,
        drop_last=args.drop_last,
        audit=args.audit,
    )
    if args.load:
        loader.load_state_dict(torch.load(args.load, weights_only=True))
    saves = {int(step): path for step, path in args.save_at}
    seen: list[Any] = []
    step = 0
    try:
        for epoch in range(loader.epoch, args.epochs):
            for batch in loader:
                seen.append([epoch, batch["id"].tolist()])
                step += 1
                time.sleep(args.sleep)
                if step in saves:
                    torch.save(loader.state_dict(), saves[step])
                if args.free_after is not None and step == int(args.free_after[0]):
                    os.unlink(args.free_after[1])
                if args.steps is not None and step == args.steps:
                    return 3
                if args.kill_at is not None and step == args.kill_at:
                    with open(args.out, "w") as file:
                        json.dump(seen, file)
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.break_at is not None and step == int(args.break_at[0]):
                    break
                if args.limit is not None and step % args.limit == 0:
                    break
            # a loop that leaves the pass, then saves
            if args.break_at is not None and step == int(args.break_at[0]):
                torch.save(loader.state_dict(pass_ended=args.pass_ended or None), args.break_at[1])
                return 0
        return 0
    finally:
        with open(args.out, "w") as file:
            json.dump(seen, file)


if __name__ == "__main__":
    sys.exit(main())
