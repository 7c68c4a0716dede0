"""A data mixture against the peers: ``Mixture`` + ``ResumableDataLoader``, ``ConcatDataset`` +
``WeightedRandomSampler`` in a plain ``DataLoader``, and torchdata's ``MultiNodeWeightedSampler``.

    python benchmarks/bench_mixture.py           # ~2 min on 2 cores; prints and updates its table
    python benchmarks/bench_mixture.py --quick   # fewer rounds, docs untouched

Three sources of Python ints (500,000, 300,000 and 200,000 items; ``__getitem__`` returns the
index), weights 5:3:2, batches of 64, ``num_workers=0``, an epoch of 10^6 samples. Throughput: whole
epochs, the loaders taking turns (order reversed every other round), each ratio taken to the plain
DataLoader of the same round, median over the rounds (``keying="off"``: the same without keyed
random streams, where the rest of the difference lies). State: the bytes of its JSON (torch.save for
torchdata's, whose state holds no JSON). Resume: the wall time from a state taken after 90 % of the
epoch to the first batch after it (the plain DataLoader has no state: it reads and drops the first
90 % of its batches, as a stock resume does).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import ConcatDataset, DataLoader, RandomSampler, WeightedRandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Ints, interleaved_epochs, markdown, write_docs_section

from loader_resume import Mixture, ResumableDataLoader

LENGTHS = {"a": 500_000, "b": 300_000, "c": 200_000}
WEIGHTS = {"a": 5.0, "b": 3.0, "c": 2.0}
SAMPLES, BATCH = 1_000_000, 64
BATCHES = SAMPLES // BATCH


def ours(keying: str = "batch") -> ResumableDataLoader[Any]:
    mixture = Mixture(
        {name: Ints(n) for name, n in LENGTHS.items()}, WEIGHTS, samples_per_epoch=SAMPLES
    )
    return ResumableDataLoader(
        mixture, batch_size=BATCH, shuffle=False, seed=0, drop_last=True, keying=keying
    )


def ours_unkeyed() -> ResumableDataLoader[Any]:
    return ours("off")


def plain() -> DataLoader[Any]:
    concat = ConcatDataset([Ints(n) for n in LENGTHS.values()])
    per_item = torch.cat(
        [torch.full((n,), WEIGHTS[name] / n, dtype=torch.float64) for name, n in LENGTHS.items()]
    )
    sampler = WeightedRandomSampler(
        per_item, SAMPLES, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    return DataLoader(concat, batch_size=BATCH, sampler=sampler, drop_last=True)


class Nodes:
    """torchdata.nodes: each source shuffled by a sampler and mapped through its dataset, mixed by
    ``MultiNodeWeightedSampler``, batched; one epoch = ``BATCHES`` batches of its endless mix."""

    def __init__(self) -> None:
        from torchdata.nodes import (
            Batcher,
            Loader,
            Mapper,
            MultiNodeWeightedSampler,
            SamplerWrapper,
        )

        sources = {
            name: Mapper(
                SamplerWrapper(RandomSampler(Ints(n), generator=torch.Generator().manual_seed(i))),
                Ints(n).__getitem__,
            )
            for i, (name, n) in enumerate(LENGTHS.items())
        }
        mixed = MultiNodeWeightedSampler(sources, WEIGHTS, stop_criteria="CYCLE_FOREVER", seed=0)
        self.loader = Loader(Batcher(mixed, batch_size=BATCH, drop_last=True))
        self.iterator: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.iterator is None:
            self.iterator = iter(self.loader)
        return itertools.islice(self.iterator, BATCHES)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


LOADERS: dict[str, Callable[[], Any]] = {
    "ConcatDataset + WeightedRandomSampler (plain DataLoader)": plain,
    "torchdata MultiNodeWeightedSampler": Nodes,
    "Mixture (ours)": ours,
    'Mixture (ours), keying="off"': ours_unkeyed,
}


def state_bytes(state: Any) -> int:
    try:
        return len(json.dumps(state))
    except TypeError:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return len(buffer.getvalue())


def resume_seconds(make: Callable[[], Any]) -> tuple[float, int]:
    """(seconds from a fresh loader to its first batch after 90 % of the epoch, the state's
    bytes)."""
    cut = BATCHES * 9 // 10
    if make is plain:
        start = time.perf_counter()
        iterator = iter(plain())
        for _ in range(cut):  # a stock resume: read and drop the batches already trained on
            next(iterator)
        next(iterator)
        return time.perf_counter() - start, 0
    running = make()
    iterator = iter(running)
    for _ in range(cut):
        next(iterator)
    state = running.state_dict()
    start = time.perf_counter()
    resumed = make()
    resumed.load_state_dict(state)
    next(iter(resumed))
    return time.perf_counter() - start, state_bytes(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 2 if args.quick else 5
    loaders = {name: make() for name, make in LOADERS.items()}
    ratios, micros = interleaved_epochs(loaders, rounds)
    rows = []
    for name, make in LOADERS.items():
        resume, size = resume_seconds(make)
        changes = {"torchdata MultiNodeWeightedSampler": "no (not saved)"}
        rows.append(
            [
                name,
                f"{statistics.median(micros[name]):.0f}",
                f"{ratios[name]:.2f}x",
                f"{size:,}" if size else "none",
                f"{resume * 1e3:,.1f} ms",
                "yes (in the state)"
                if name.startswith("Mixture")
                else changes.get(name, "no state"),
            ]
        )
    table = markdown(["loader", "µs a batch", "throughput vs plain", "state (bytes)",
                      "first batch after a resume at 90 %", "a weight change resumes"], rows)
    print(table)
    if not args.quick:
        method = (f"Measured by `python benchmarks/bench_mixture.py` ({rounds} rounds; method in "
                  "its docstring).")
        write_docs_section("mixture", f"{table}\n\n{method}")


if __name__ == "__main__":
    main()
