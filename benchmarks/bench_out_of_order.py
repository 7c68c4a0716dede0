"""``in_order=False`` against ``in_order=True`` when one item in 64 is slow, ours and a plain
``DataLoader``.

    python benchmarks/bench_out_of_order.py          # ~1 min on 2 cores; prints, updates its table
    python benchmarks/bench_out_of_order.py --quick  # fewer rounds, docs untouched

1,024 items of ~0.5 ms of CPU each, except every 64th, which sleeps 40 ms (a slow decode, a remote
read); batches of 8, ``num_workers=2``, ``prefetch_factor=2``. Whole epochs, the four loaders taking
turns (order reversed every other round), each ratio to the plain in-order DataLoader of the same
round, median over the rounds. With ``in_order=True`` a batch waiting for its slow item holds back
every batch after it; with ``in_order=False`` the other worker's batches go on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved_epochs, markdown, write_docs_section

from loader_resume import ResumableDataLoader

N, BATCH, SLOW_EVERY = 1024, 8, 64


class OneSlowIn64(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        if index % SLOW_EVERY == 0:
            time.sleep(0.04)
        else:
            end = time.perf_counter() + 0.0005
            while time.perf_counter() < end:
                pass
        return index


def loaders() -> dict[str, Any]:
    common = {"batch_size": BATCH, "shuffle": True, "num_workers": 2, "prefetch_factor": 2,
              "persistent_workers": True}
    return {
        "DataLoader, in_order=True": DataLoader(OneSlowIn64(), **common, in_order=True),
        "DataLoader, in_order=False": DataLoader(OneSlowIn64(), **common, in_order=False),
        "ours, in_order=True": ResumableDataLoader(OneSlowIn64(), **common, in_order=True, seed=0),
        "ours, in_order=False": ResumableDataLoader(
            OneSlowIn64(), **common, in_order=False, seed=0
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 2 if args.quick else 5
    ratios, micros = interleaved_epochs(loaders(), rounds)
    rows = [
        [name, f"{statistics.median(values) * (N // BATCH) / 1e6:.2f} s", f"{ratios[name]:.2f}x"]
        for name, values in micros.items()
    ]
    table = markdown(["loader", "epoch", "throughput vs DataLoader in order"], rows)
    print(table)
    if not args.quick:
        method = (f"Measured by `python benchmarks/bench_out_of_order.py` ({rounds} rounds; "
                  "method in its docstring).")
        write_docs_section("out_of_order", f"{table}\n\n{method}")


if __name__ == "__main__":
    main()
