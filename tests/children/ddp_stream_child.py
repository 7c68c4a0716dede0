"""Run by test_iterable_ddp.py as a real 2-process gloo job: `python ddp_stream_child.py MODE OUTDIR
[VIA]`.

Each rank streams its own shard (split by rank, then by worker); MODE full | save | resume as in
ddp_child.py, but the checkpoint holds every rank's state (gather_states) and each rank loads its
part. VIA ``torch`` (default): rank 0 writes the gathered states with torch.save; ``dcp``: every
rank calls torch.distributed.checkpoint with a DCPLoaderState.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader
from loader_resume.distributed import DCPLoaderState, gather_states, load_rank_state


class RankShards(IterableDataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = dist.get_world_size() * workers
        mine = list(range(dist.get_rank() * workers + worker, self.n, shards))
        while self.i < len(mine):
            self.i += 1
            yield {"id": mine[self.i - 1], "noise": torch.rand(2)}
        self.i = 0

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    via = sys.argv[3] if len(sys.argv) > 3 else "torch"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    loader = ResumableDataLoader(RankShards(37), batch_size=2, num_workers=2)
    rows = []
    if mode == "full":
        rows = [[b["id"].tolist(), b["noise"].flatten().tolist()] for _ in range(2) for b in loader]
    elif mode == "save":
        iterator = iter(loader)  # held: a job killed mid-pass (a dropped iterator's pass is over)
        for _ in range(4):
            next(iterator)
        gathered = gather_states(loader)
        assert (
            gathered["ranks"][rank] == loader.state_dict()
            and gathered["ranks"][0] != gathered["ranks"][1]
        )
        if via == "dcp":
            dcp.save({"loader": DCPLoaderState(loader)}, checkpoint_id=str(out / "dcp"))
        elif rank == 0:
            torch.save(gathered, out / "state.pt")
        del iterator
    else:
        if via == "dcp":
            dcp.load({"loader": DCPLoaderState(loader)}, checkpoint_id=str(out / "dcp"))
        else:
            load_rank_state(loader, torch.load(out / "state.pt", weights_only=True))
        rows = [
            [b["id"].tolist(), b["noise"].flatten().tolist()]
            for _ in range(loader.epoch, 2)
            for b in loader
        ]
    (out / f"{mode}-{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
