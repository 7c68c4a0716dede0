"""The cost of ``audit=DIR``: whole epochs of tiny items, ``num_workers=0`` and 2, audit off and on
(a local directory), with plain ``DataLoader`` and torchdata's ``StatefulDataLoader`` in the same
rounds.

    python benchmarks/bench_audit.py           # ~3 min on 2 cores; prints the table, updates docs/
    python benchmarks/bench_audit.py --quick   # fewer rounds, docs untouched

Tiny items (a 4-float tensor, no work per item) are the worst case for a per-batch cost: every other
cost of a step is as small as it gets. Loaders take turns epoch by epoch (``interleaved_epochs``);
ratios are medians of each round's ratio to ``DataLoader``. The audit's own cost is the ratio of
"ours" to "ours, audit on".
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from common import Tiny, interleaved_epochs, markdown, write_docs_section
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader_resume import ResumableDataLoader

BATCH = 64
N = 50_000


def loaders(workers: int, audit: Path) -> dict[str, Any]:
    dataset = Tiny(N)
    common: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "num_workers": workers,
                              "persistent_workers": workers > 0}
    return {
        "DataLoader": DataLoader(dataset, **common),
        "StatefulDataLoader": StatefulDataLoader(dataset, **common),
        "ours": ResumableDataLoader(dataset, seed=0, **common),
        "ours, audit on": ResumableDataLoader(dataset, seed=0, audit=audit, **common),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 3 if args.quick else 9
    rows: list[list[str]] = []
    # NOTE: left for the logs' last writes at exit
    directory = Path(tempfile.mkdtemp(prefix="bench-audit-"))
    for workers in (0, 2):
        ratios, micros = interleaved_epochs(loaders(workers, directory / str(workers)), rounds)
        ours = ratios["ours"] / ratios["ours, audit on"]
        for name, ratio in ratios.items():
            median = sorted(micros[name])[len(micros[name]) // 2]
            extra = f"{(ours - 1) * 100:+.1f} % a batch vs ours" if name == "ours, audit on" else ""
            rows.append([str(workers), name, f"{median:.0f} µs", f"{ratio:.2f}x", extra])
    logged = sum(path.stat().st_size for path in directory.rglob("*.jsonl"))
    batches = sum(
        1
        for path in directory.rglob("*.jsonl")
        for line in path.open()
        if line.startswith('{"t":"b"')
    )
    table = markdown(
        [
            "num_workers",
            "loader",
            "a batch (median epoch)",
            "throughput vs DataLoader",
            "audit's cost",
        ],
        rows,
    )
    text = (
        f"{table}\n\nTiny items (n = {N:,}, batches of {BATCH}), whole epochs, {rounds} rounds; "
        f"the log took {logged / max(batches, 1):.0f} bytes a batch. Measured by `python "
        "benchmarks/bench_audit.py`."
    )
    print(text)
    if not args.quick:
        write_docs_section("audit", text)


if __name__ == "__main__":
    main()
