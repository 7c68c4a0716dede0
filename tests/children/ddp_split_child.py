"""Run by test_elastic.py as a real 2-process gloo job: ``python ddp_split_child.py MODE OUTDIR``
with RANK etc. set.

An HF map-style dataset, either whole on every rank (MODE whole) or pre-split per rank with HF's
``split_dataset_by_node`` (MODE split, then the escape hatch rank=0, world_size=1). Writes what
``check_same_dataset`` said and the ids each rank's loader delivered -> OUTDIR/MODE-RANK.json.

MODE plain-split: a plain loop, no check called: the loader over the split is iterated for two
epochs, and the error each rank's ``iter()`` raised is recorded with the epoch it came at. MODE
plain-partial: rank 0 alone builds and iterates a validation loader (another dataset), both iterate
the whole training set: nothing may hang or be refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node

from loader_resume import ResumableDataLoader
from loader_resume.distributed import check_same_dataset


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    whole = datasets.Dataset.from_dict({"id": list(range(24))}).with_format("torch")
    dataset = (
        whole if mode in ("whole", "plain-partial") else split_dataset_by_node(whole, rank, world)
    )
    if mode.startswith("plain"):
        plain(mode, out, rank, whole, dataset)
        return
    loader = ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=1)
    try:
        check_same_dataset(loader)
        error = ""
    except ValueError as exc:
        error = str(exc)
    if error:  # what the message tells the user to do: keep the split, shard nothing more
        loader = ResumableDataLoader(
            dataset, batch_size=4, shuffle=True, seed=1, rank=0, world_size=1
        )
        check_same_dataset(loader)
    delivered = [int(i) for batch in loader for i in batch["id"]]
    (out / f"{mode}-{rank}.json").write_text(json.dumps({"error": error, "ids": delivered}))
    dist.barrier()
    dist.destroy_process_group()


def plain(
    mode: str, out: Path, rank: int, whole: datasets.Dataset, dataset: datasets.Dataset
) -> None:
    result: dict[str, object] = {"error": "", "epoch": None, "ids": [], "validation": []}
    if mode == "plain-partial" and rank == 0:
        validation = ResumableDataLoader(whole.select(range(10)), batch_size=4)
        result["validation"] = [int(i) for batch in validation for i in batch["id"]]
    loader = ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=1)
    for epoch in range(2):
        try:
            ids = [int(i) for batch in loader for i in batch["id"]]
            result["ids"] += ids  # type: ignore[operator]
        except ValueError as exc:
            result["error"], result["epoch"] = str(exc), epoch
            break
    (out / f"{mode}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
