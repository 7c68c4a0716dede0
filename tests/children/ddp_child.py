"""Run by test_elastic.py as a real 2-process gloo job: `python ddp_child.py MODE OUTDIR` with RANK
etc. set.

MODE full: 2 uninterrupted epochs -> OUTDIR/full-RANK.json
MODE save: stop after 3 batches of epoch 1, rank 0 writes the state -> OUTDIR/state.pt
MODE resume: fresh processes load OUTDIR/state.pt and finish -> OUTDIR/resume-RANK.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.data import make


def record(batch: dict[str, torch.Tensor]) -> list[list[float]]:
    return [batch["id"].tolist(), batch["torch"].flatten().tolist()]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    loader = make(21, batch_size=2, shuffle=True, num_workers=int(os.environ.get("WORKERS", "0")))
    if mode == "full":
        rows = [record(b) for _ in range(2) for b in loader]
        (out / f"full-{rank}.json").write_text(json.dumps(rows))
    elif mode == "save":
        for _ in loader:
            pass
        for i, _ in enumerate(loader):
            if i == 2:
                # a job killed here: inside the pass (after `break` it is over)
                state = loader.state_dict()
                break
        states: list[object] = [None, None]
        dist.all_gather_object(states, state)
        assert states[0] == states[1], "map-style states must agree across ranks"
        if rank == 0:
            torch.save(state, out / "state.pt")
    else:
        loader.load_state_dict(torch.load(out / "state.pt", weights_only=True))
        rows = [record(b) for _ in range(loader.epoch, 2) for b in loader]
        (out / f"resume-{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
