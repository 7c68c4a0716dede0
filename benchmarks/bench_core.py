"""Core benchmark: ResumableDataLoader vs DataLoader vs torchdata's StatefulDataLoader.

    python benchmarks/bench_core.py           # ~15 min on 2 cores; prints the table, updates docs/
    python benchmarks/bench_core.py --quick   # fewer rounds, docs untouched

Loaders take turns (interleaved rounds, medians), so machine drift affects all of them alike.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
from common import (
    Blob,
    Busy,
    Drawing,
    Ints,
    Tiny,
    TinyStream,
    batches_per_second,
    interleaved,
    interleaved_epochs,
    markdown,
    median_micros,
    pipeline_cpu_clock,
    write_docs_section,
)
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from loader_resume import ResumableDataLoader
from loader_resume.keyed.keyed_rng import CallerRng, derive_key, generator_mask, seed_generators
from loader_resume.keyed.rng_memory import generator_states
from loader_resume.keyed.worker_fetch import KeySpec, keyed_indices

BATCH = 64


# (label, dataset): whole epochs of ~80 to ~800 batches, lengths that are not powers of two
ROWS = (
    ("Python ints, n = 50,000", lambda: Ints(50_000)),
    ("tiny tensors (`Tiny`), n = 50,000", lambda: Tiny(50_000)),
    ("tiny tensors drawing torch + numpy + `random` per item, n = 5,000", lambda: Drawing(5_000)),
    ("50 µs items (`Busy`), n = 5,000", lambda: Busy(5_000)),
)
COLUMNS = (
    "DataLoader again (A/A)",
    "StatefulDataLoader",
    "ours, keying off",
    "ours, default keying",
    "ours, keying torch only",
)
SHARED = "ours, default keying, `by_value_bytes=0`"
"""At 2 workers: every tensor back through shared memory, as DataLoader sends it (keying's cost on
its transport)."""


def throughput(
    dataset: Any, workers: int, rounds: int
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Whole epochs of each loader over ``dataset`` (shuffled, batch 64), interleaved; see
    ``interleaved_epochs``."""
    common = {
        "batch_size": BATCH,
        "shuffle": True,
        "num_workers": workers,
        "persistent_workers": workers > 0,
    }
    loaders: dict[str, Any] = dict(
        zip(
            ("DataLoader", *COLUMNS),
            (
                DataLoader(dataset, **common),
                DataLoader(dataset, **common),
                StatefulDataLoader(dataset, **common),
                ResumableDataLoader(dataset, keying="off", **common),
                ResumableDataLoader(dataset, **common),
                ResumableDataLoader(dataset, keyed_generators=("torch",), **common),
            ),
            strict=True,
        )
    )
    if workers:
        loaders[SHARED] = ResumableDataLoader(dataset, by_value_bytes=0, **common)
    # NOTE: CPU time, which leaves out what a shared VM's other tenants take (wall time moved rows
    # by ±10 % between rounds here, and an A/A pair by as much): at num_workers=0 this process's,
    # where all the work is; at 2 workers that of this process and of the loader's worker processes,
    # all their threads (the pipeline fills both cores of this machine, so its CPU time is what an
    # epoch costs).
    if workers == 0:
        return interleaved_epochs(loaders, rounds, time.process_time)
    return interleaved_epochs(
        loaders, rounds, lambda loader: pipeline_cpu_clock(loader, workers), per_loader=True
    )


def state_dict_micros(workers: int, calls: int = 400) -> float:
    """Median µs of ``state_dict()`` between ``next()`` calls of a running shuffled loader."""
    loader = ResumableDataLoader(Tiny(1 << 20), batch_size=BATCH, shuffle=True, num_workers=workers)
    iterator, samples = iter(loader), []
    for _ in range(calls):
        next(iterator)
        start = time.perf_counter()
        loader.state_dict()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def stream_throughput(workers: int, batches: int, rounds: int) -> dict[str, float]:
    """An iterable dataset whose state is a few ints: the cost of shipping worker state with
    batches."""
    dataset = TinyStream(1 << 22)
    common = {"batch_size": BATCH, "num_workers": workers}
    loaders = {
        "DataLoader": DataLoader(dataset, **common),
        "DataLoader again (noise control)": DataLoader(dataset, **common),
        "StatefulDataLoader": StatefulDataLoader(dataset, snapshot_every_n_steps=1, **common),
        "ours, keying off": ResumableDataLoader(dataset, keying="off", **common),
        "ours, per-batch keying": ResumableDataLoader(dataset, **common),
    }
    if workers:
        loaders[SHARED] = ResumableDataLoader(dataset, by_value_bytes=0, **common)
    return interleaved({name: (lambda loader=loader: batches_per_second(loader, batches))
                        for name, loader in loaders.items()}, rounds)


def transport_rows(rounds: int) -> list[list[str]]:
    """Batches of one tensor of 4 KiB to 4 MiB at 2 workers: DataLoader's shared memory against ours
    by value up to the default limit, and by value whatever the size (where the default's limit
    comes from)."""
    rows = []
    for kib in (4, 64, 256, 1024, 4096):
        dataset = Blob(BATCH * 40, kib * 1024 // 4 // BATCH)
        common = {"batch_size": BATCH, "num_workers": 2, "persistent_workers": True}
        loaders = {
            "DataLoader": DataLoader(dataset, **common),
            "ours": ResumableDataLoader(dataset, keying="off", **common),
            "always": ResumableDataLoader(dataset, keying="off", by_value_bytes=1 << 30, **common),
        }
        ratios, micros = interleaved_epochs(
            loaders, rounds, lambda loader: pipeline_cpu_clock(loader, 2), per_loader=True
        )
        rows.append(
            [
                f"{kib:,} KiB",
                f"{statistics.median(micros['DataLoader']):.0f}",
                f"{ratios['ours']:.2f}x",
                f"{ratios['always']:.2f}x",
            ]
        )
        del loaders
    return rows


def keying_costs() -> dict[str, float]:
    mask = generator_mask(("torch", "numpy", "random"))
    key = derive_key(1, 2)
    per_sample = keyed_indices(list(range(BATCH)), KeySpec(key, derive_key(3, 4), mask))
    guard = CallerRng(mask)

    # num_workers=0, a dataset that draws from all three generators
    def main_process_batch() -> None:
        guard.save()
        seed_generators(key, mask)
        guard.restore()

    states = generator_states()

    # num_workers=0, a dataset that draws nothing: a copy before, a comparison after
    def draws_nothing() -> None:
        states.changed(states.take(), mask)

    def profiler_range() -> None:
        with torch.autograd.profiler.record_function(
            "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
        ):
            pass

    return {
        "worker, per batch (seeding one key; done ahead by the helper thread)": median_micros(
            lambda: seed_generators(key, mask)
        ),
        "worker, per batch, inside a running 2-worker loader, `Drawing` (draws from all three; "
        "cold caches; done by the helper thread)": in_loader_seed_micros("Drawing"),
        "worker, per batch, inside a running 2-worker loader, `Tiny` (draws nothing: torch's "
        "generator alone is seeded, for `torch.initial_seed()`)": in_loader_seed_micros("Tiny"),
        "worker, per sample": (
            median_micros(lambda: list(iter(per_sample)))
            - median_micros(lambda: list(per_sample[:]))
        )
        / BATCH,
        "main process, per batch, a dataset that draws from all three (seeding + caller RNG save "
        "and restore)": median_micros(main_process_batch),
        "main process, per batch, a dataset that draws nothing (RNG states copied and "
        "compared)": median_micros(draws_nothing),
        "caller RNG save+restore": median_micros(lambda: guard.save().restore()),
        "numpy get_state+set_state (for comparison)": median_micros(
            lambda: np.random.set_state(np.random.get_state()), repeat=500
        ),
        "random getstate+setstate (for comparison)": median_micros(
            lambda: random.setstate(random.getstate()), repeat=500
        ),
        "torch's per-batch profiler range (record_function), skipped by ours while no profiler "
        "records": median_micros(
            profiler_range
        ),
    }


def _probe(script: str, what: str, **fields: Any) -> str:
    """Run ``script`` (formatted with ``fields`` and this folder as ``bench``) in a fresh
    interpreter; its stdout."""
    code = script.format(bench=os.path.dirname(os.path.abspath(__file__)), **fields)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode or not done.stdout.strip():
        raise RuntimeError(f"{what} failed: {done.stderr[-2000:]}")
    return done.stdout


_IN_LOADER = """
import os, statistics, sys, time
sys.path.insert(0, {bench!r})
import loader_resume.keyed.worker_fetch as worker_fetch
from common import {dataset}
from loader_resume import ResumableDataLoader

seed, times = worker_fetch.seed_generators, []

def timed(key, mask):  # runs in the workers, which fork with this module patched
    start = time.perf_counter_ns()
    seed(key, mask)
    times.append(time.perf_counter_ns() - start)
    if len(times) == 1000:  # one write: two workers' lines must not interleave on the shared pipe
        os.write(1, f"{{statistics.median(times) / 1000}}\\n".encode())

worker_fetch.seed_generators = timed  # where workers seed (the batch's arrival, the helper thread)
iterator = iter(ResumableDataLoader({dataset}(1 << 20), batch_size=64, shuffle=True, num_workers=2))
for _ in range(2001):
    next(iterator)
"""


def in_loader_seed_micros(dataset: str) -> float:
    """Median µs of a worker's seeding a batch while the pipeline runs (caches are cold there): the
    generators the dataset (a class of ``common``) draws from, and torch's."""
    return statistics.median(float(line) for line in _probe(_IN_LOADER, "in-loader keying probe",
                                                            dataset=dataset).split())


_WAKE_CONTROL = """
import json, sys
sys.path.insert(0, {bench!r})
import loader_resume.keyed.worker_fetch as worker_fetch
# forked workers inherit it: the helper seeds nothing
worker_fetch.seed_generators = lambda key, mask: None
from common import Tiny, batches_per_second, interleaved
from torch.utils.data import DataLoader
from loader_resume import ResumableDataLoader

dataset = Tiny(1 << 20)
common = dict(batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)
# DataLoader's transport for all three: the helper's wake alone differs
shared = dict(common, by_value_bytes=0)
loaders = dict(plain=DataLoader(dataset, **common),
               off=ResumableDataLoader(dataset, keying="off", **shared),
               empty_helper=ResumableDataLoader(dataset, **shared))
print(json.dumps(interleaved(dict((name, lambda loader=loader: batches_per_second(loader, 400))
                                  for name, loader in loaders.items()), {rounds})))
"""


def helper_wake_control(rounds: int) -> dict[str, float]:
    """Tiny items, nw=2, with every seeding stubbed out: what the seed-ahead helper's wake alone
    does (every loader sending tensors through shared memory)."""
    result: dict[str, float] = json.loads(
        _probe(_WAKE_CONTROL, "helper wake control", rounds=rounds).splitlines()[-1]
    )
    return result


def _saved_bytes(state: Any) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return len(buffer.getvalue())


def state_costs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in (10**3, 10**9):
        loader = ResumableDataLoader(Tiny(n), batch_size=BATCH, shuffle=True)
        iterator = iter(loader)
        next(iterator)
        out[f"ours: state_dict() µs, n={n:.0e}"] = median_micros(loader.state_dict)
        out[f"ours: torch.save bytes (JSON bytes), n={n:.0e}"] = (
            f"{_saved_bytes(loader.state_dict())} ({len(json.dumps(loader.state_dict()))})")
    for workers in (0, 2):
        out[
            f"ours: state_dict() µs between next() calls of a running loader, num_workers={workers}"
        ] = state_dict_micros(workers)
    sdl = StatefulDataLoader(Tiny(10**3), batch_size=BATCH, shuffle=True)
    iterator = iter(sdl)
    next(iterator)
    out["StatefulDataLoader: state_dict() µs, n=1e+03"] = median_micros(sdl.state_dict, repeat=500)
    out["StatefulDataLoader: torch.save bytes, n=1e+03"] = _saved_bytes(sdl.state_dict())
    return out


def resume_latency(n: int = 10**7) -> dict[str, dict[float, float]]:
    """Seconds from ``load_state_dict`` to the first batch, resuming at a fraction of the epoch.

    Each state is real: taken by iterating the loader to that point (nw=0).
    """
    builders = {
        "ours": lambda: ResumableDataLoader(Tiny(n), batch_size=BATCH, shuffle=True),
        "StatefulDataLoader": lambda: StatefulDataLoader(Tiny(n), batch_size=BATCH, shuffle=True),
    }
    out: dict[str, dict[float, float]] = {name: {} for name in builders}
    for name, build in builders.items():
        loader = build()
        iterator = iter(loader)
        done = 0
        for fraction in (0.1, 0.5, 0.9):
            while done < int(n * fraction) // BATCH:
                next(iterator)
                done += 1
            state = loader.state_dict()
            fresh = build()
            start = time.perf_counter()
            fresh.load_state_dict(state)
            next(iter(fresh))
            out[name][fraction] = time.perf_counter() - start
    return out


_PEAK = """
import sys, tracemalloc
sys.path.insert(0, {bench!r})
from common import Tiny
from loader_resume import ResumableDataLoader

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = rss()
tracemalloc.start()
it = iter(ResumableDataLoader(Tiny({n}), batch_size=64, shuffle=True))
for _ in range(10):
    next(it)
print(rss() - before, tracemalloc.get_traced_memory()[1])
"""


def peak_memory_mib(n: int) -> tuple[float, float]:
    """(resident-set growth, tracemalloc peak) in MiB for a shuffled loader over ``n`` samples."""
    rss, peak = _probe(_PEAK, "peak-memory probe", n=n).split()[-2:]
    return int(rss) / 2**20, int(peak) / 2**20


def report(args: argparse.Namespace) -> str:
    rounds = 3 if args.quick else 21
    # NOTE: num_workers=0 epochs are cheap and its rows' ratios lie within 0.3 % of 1 (50 µs items):
    # more rounds
    main_rounds = 3 if args.quick else 61
    sections = []
    rows = []
    for label, factory in ROWS:
        dataset = factory()
        for workers in (0, 2):
            ratios, micros = throughput(dataset, workers, rounds if workers else main_rounds)
            keying = statistics.median(
                d - o
                for d, o in zip(
                    micros["ours, default keying"], micros["ours, keying off"], strict=True
                )
            )
            shared = f"{ratios[SHARED]:.3f}x" if SHARED in ratios else "—"
            rows.append(
                [
                    label,
                    str(workers),
                    *(f"{ratios[name]:.3f}x" for name in COLUMNS),
                    shared,
                    f"{keying:+.1f}",
                    f"{statistics.median(micros['DataLoader']):.1f}",
                ]
            )
            print(rows[-1], flush=True)
    header = [
        "items (whole epochs)",
        "num_workers",
        *COLUMNS,
        SHARED,
        "keying cost, µs a batch (default - off)",
        "DataLoader µs a batch",
    ]
    sections.append(markdown(header, rows))
    stream_rows = []
    for workers in (0, 2):
        result = stream_throughput(workers, 400, rounds)
        ratios = [f"{result[k]:.3f}x" for k in result if k != "DataLoader"] + (
            [] if workers else ["—"]
        )
        stream_rows.append(
            ["stream, state = a few ints", str(workers), *ratios, f"{result['DataLoader']:,.0f}"]
        )
        print(stream_rows[-1], flush=True)
    stream_header = [
        "iterable dataset (400 batches after the first)",
        "num_workers",
        *COLUMNS[:4],
        SHARED,
        "DataLoader batches/s",
    ]
    sections.append(markdown(stream_header, stream_rows))
    sections.append(
        markdown(
            [
                "one tensor a batch (whole epochs, num_workers=2, keying off)",
                "DataLoader µs a batch",
                "ours (default `by_value_bytes`)",
                "ours, by value whatever the size",
            ],
            transport_rows(3 if args.quick else 7),
        )
    )
    print(sections[-1], flush=True)
    wake = helper_wake_control(rounds)
    control = ["control: tiny items, nw=2, every seeding stubbed out", "ours, keying off",
               "ours, seed-ahead helper seeding nothing"]
    sections.append(
        markdown(
            control,
            [["ratio to DataLoader", f"{wake['off']:.3f}x", f"{wake['empty_helper']:.3f}x"]],
        )
    )
    costs = keying_costs()
    sections.append(
        markdown(["keying cost (3 generators)", "µs"], [[k, f"{v:.1f}"] for k, v in costs.items()])
    )
    states = state_costs()
    sections.append(
        markdown(
            ["state", "value"],
            [[k, f"{v:.1f}" if isinstance(v, float) else str(v)] for k, v in states.items()],
        )
    )
    latency = resume_latency()
    sections.append(markdown(["first batch after resume, n=1e7", "10 %", "50 %", "90 %"],
                             [[name, *(f"{s * 1000:.1f} ms" for s in by_fraction.values())]
                              for name, by_fraction in latency.items()]))
    memory = {n: peak_memory_mib(n) for n in (10**3, 10**9)}
    sections.append(
        markdown(
            ["shuffled loader, first 10 batches", "RSS growth MiB", "Python/numpy peak MiB"],
            [[f"n = {n:.0e}", f"{rss:.1f}", f"{peak:.2f}"] for n, (rss, peak) in memory.items()],
        )
    )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, batch {BATCH}"
    )
    head = (
        f"Measured by `python benchmarks/bench_core.py` ({machine}). Each loader runs whole "
        "shuffled epochs (from `iter()` to its end, so per-epoch costs count; "
        "`persistent_workers=True` at 2 workers, one untimed warm-up epoch each), taking turns in "
        f"interleaved rounds ({main_rounds} for the map-style rows at `num_workers=0`, {rounds} "
        "for the others; order reversed every other round); a ratio is the median of its "
        "throughput over plain DataLoader's in the same round. Time is CPU time, which leaves out "
        "the time a process waits for a CPU (on a shared machine, wall time moved an A/A pair by "
        "±10 % between rounds): the process's at `num_workers=0`, where all the work is, and at 2 "
        "workers the sum of the main process's and the loader's two worker processes' (all their "
        "threads, from `/proc`): where the pipeline keeps every core busy, that is what an epoch "
        "costs. The A/A column, a second identical DataLoader, shows the remaining noise: "
        "differences of that size are not ours."
    )
    return head + "\n\n" + "\n\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds; do not touch the docs")
    args = parser.parse_args()
    text = report(args)
    print(text)
    if not args.quick:
        write_docs_section("core", text)


if __name__ == "__main__":
    main()
