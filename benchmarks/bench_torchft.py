"""TorchFT: samples lost and repeated per failure, rejoin time and throughput, ours and TorchFT's.

    .venv-torchft/bin/python benchmarks/bench_torchft.py           # ~3 min; updates docs/
    .venv-torchft/bin/python benchmarks/bench_torchft.py --quick   # one run each, docs untouched

(``.venv-torchft``: the venv from ``.ci/locks/torchft.txt``, made as docs/development.md shows.)

A real ``torchft_lighthouse`` and three replica groups (one process each, gloo on loopback) train a
small model on ``N`` generated samples for one epoch's worth of samples, in batches of 4, a step
lasting at least 50 ms. Each job runs twice per data side: without failures, and with one group
SIGKILLed between steps at step 10 and started again at once (it rejoins through TorchFT's
recovery). The data side is either ``TorchFTResume`` or TorchFT's own recipe: its
``torchft.data.DistributedSampler`` (a shard per replica-group number) in a plain ``DataLoader``.
The replica-group script is the TorchFT tests' (``tests_torchft/children/group.py``).

Counted from each group's log of committed batches: the distinct samples trained of the ``N`` the
job trained in all, those trained twice or more (repeats), those never trained (lost); the time from
the kill to the restarted group's first committed step (process start included); committed samples
per second over the whole job.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown, write_docs_section

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests_torchft" / "children" / "group.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
N, KILL_AT = 480, 10


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job(out: Path, sampler: str, fail: bool) -> dict[str, Any]:
    """One job of three groups; its counts."""
    out.mkdir(parents=True)
    port = _port()
    light = subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
         "--join_timeout_ms", "300", "--quorum_tick_ms", "20", "--heartbeat_timeout_ms", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)

    def start(group: int, *extra: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(CHILD), str(out), str(group), f"http://127.0.0.1:{port}",
             "--epochs", "1", "--samples", str(N), "--step-seconds", "0.05", "--sampler", sampler,
             *extra],
            stdout=(out / f"group-{group}.out").open("ab"), stderr=subprocess.STDOUT)

    try:
        # NOTE: the groups wait at their first quorum for each other (join timeout)
        kill = ["--kill-at", str(KILL_AT)] if fail else []
        groups = [start(0), start(1), start(2, *kill)]
        restarted = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(p.poll() is None for p in groups):
            if fail and not restarted and groups[2].poll() == -signal.SIGKILL:
                groups[2], restarted = start(2), True
            time.sleep(0.05)
        for group, process in enumerate(groups):
            if process.poll() is None:
                process.kill()
                raise RuntimeError((out / f"group-{group}.out").read_text()[-2000:])
    finally:
        light.kill()
        light.wait()
    rows = [json.loads(line) for path in sorted(out.glob("log-*.jsonl"))
            for line in path.read_text().splitlines()]
    return _counts(rows, fail, pads=sampler == "ours")


def _counts(rows: list[dict[str, Any]], fail: bool, pads: bool) -> dict[str, Any]:
    """``pads``: the loader pads its epoch's last step (``DistributedSampler``'s rule): the samples
    of that step trained before are counted apart."""
    outcome: dict[int, bool] = {}
    last: dict[int, int] = {}
    for index, row in enumerate(rows):
        if row["t"] == "take":
            last[row["pid"]] = index
        elif row["t"] == "end":
            outcome[last[row["pid"]]] = row["committed"]
    trained = [row for index, row in enumerate(rows) if row["t"] == "take" and outcome.get(index)]
    last = max(row["step"] for row in trained)
    earlier = collections.Counter(i for row in trained if row["step"] < last for i in row["ids"])
    final = [i for row in trained if row["step"] == last for i in row["ids"]]
    padding = sum(i in earlier for i in final) if pads else 0
    # NOTE: the padded occurrences counted apart, never a repeat of the steps before
    counts = earlier + collections.Counter(i for i in final if not (pads and i in earlier))
    ends = [row for row in rows if row["t"] == "end"]
    took = [row["time"] for row in rows if row["t"] == "take"]
    rejoin = None
    if fail:
        killed = max(row["time"] for row in ends
                     if row["group"] == 2 and row["step"] == KILL_AT - 1)
        pids = sorted({row["pid"] for row in rows if row["group"] == 2})
        first = min(row["time"] for row in ends if row["pid"] == pids[-1] and row["committed"])
        rejoin = first - killed
    return {
        "trained": sum(counts.values()),
        "distinct": len(counts),
        "repeated": sum(1 for count in counts.values() if count > 1),
        "padding": padding,
        "lost": N - len(counts),
        "rejoin_s": rejoin,
        "samples_per_s": sum(counts.values()) / (max(row["time"] for row in ends) - min(took)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    names = {"ours": "TorchFTResume", "torchft": "TorchFT's DistributedSampler"}
    results: dict[tuple[str, bool], list[dict[str, Any]]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(repeats):
            for sampler in ("ours", "torchft"):
                for fail in (False, True):
                    out = Path(scratch) / f"{sampler}-{fail}-{round_}"
                    results[(sampler, fail)].append(job(out, sampler, fail))
    rows = []
    for sampler, name in names.items():
        clean = results[(sampler, False)]
        failed = results[(sampler, True)]
        rate = statistics.median(r["samples_per_s"] for r in clean)
        rate_failed = statistics.median(r["samples_per_s"] for r in failed)

        def span(key: str, runs: list[dict[str, Any]] = failed) -> str:
            values = [r[key] for r in runs]
            low, high = min(values), max(values)
            return f"{low}" if low == high else f"{low} to {high}"

        padded = max(r["padding"] for r in failed)
        rows.append([name, span("lost", clean), span("lost"),
                     span("repeated") + (f" (+ up to {padded} padding)" if padded else ""),
                     f"{statistics.median(r['rejoin_s'] for r in failed):.1f} s",
                     f"{rate:.0f}", f"{rate_failed:.0f}"])
    table = markdown(["data side", "lost (no failure)", "lost per failure", "repeated per failure",
                      "kill to rejoined group's first committed step", "samples/s, no failure",
                      "samples/s, one failure"], rows)
    print(table)
    if not args.quick:
        from importlib.metadata import version

        import torch

        machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"torchft {version('torchft')}")
        text = (f"{table}\n\nMeasured by `python benchmarks/bench_torchft.py` ({machine}), in "
                f"TorchFT's environment: three replica groups, {N} samples, batches of 4, one "
                f"group SIGKILLed at step {KILL_AT} and started again at once; min to max over "
                f"{repeats} runs, times and rates their median. Padding: the samples "
                "`TorchFTResume` repeats in an epoch's last step when fewer are left than the "
                "step takes, as `DistributedSampler` pads (a failure changes the step size).")
        write_docs_section("torchft", text)


if __name__ == "__main__":
    main()
