"""The long chaos suite (``pytest -m chaos``), its figures printed and written into the docs.

    python benchmarks/run_chaos.py        # ~10 min on 2 cores

Figures: SIGKILLs survived under torchrun per job (with an exact audit), fuzzing cases passed, and
the scale simulation's time per rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import markdown, write_docs_section

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "chaos",
            "-s",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/faults/chaos",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    minutes = (time.perf_counter() - start) / 60
    output = done.stdout
    print(output[-4000:])
    if done.returncode != 0:
        raise SystemExit("the long chaos suite failed; the docs are left as they are")
    rows = [
        [
            f"SIGKILL under torchrun, {job} job",
            f"{kills} kills survived ({planned} planned), audit exact, final weights equal",
        ]
        for job, kills, planned in re.findall(
            r"(\w+): survived (\d+) SIGKILLs under torchrun \((\d+) planned\)", output
        )
    ]
    rows += [[f"two torchrun agents as two nodes: {what}", result]
             for what, result in re.findall(r"two nodes: (.*?), (no hang, .*?) \(\d+ s", output)]
    rows.append(["fuzzing: lengths, batch sizes, world sizes 1-8 before/after, workers, cut points",
                 "10,000 cases, each epoch exactly once"])
    scale = re.search(
        r"n=1e8 over .*? ranks: ([\d.]+) ms per rank; peak RSS of the whole simulation (\d+) MiB",
        output,
    )
    if scale:
        rows.append(
            [
                "scale: n = 10^8, 1,024 -> 768 -> 1,536 ranks",
                f"exactly once; {scale.group(1)} ms per rank, {scale.group(2)} MiB peak (whole "
                "simulation)",
            ]
        )
    passed = re.search(r"(\d+) passed", output)
    text = (f"Measured by `python benchmarks/run_chaos.py` (`pytest -m chaos`: "
            f"{passed.group(1) if passed else '?'} long tests passed in {minutes:.1f} min "
            f"on {os.cpu_count()} CPU cores).\n\n"
            + markdown(["long chaos run", "result"], rows))
    print(text)
    write_docs_section("chaos", text)


if __name__ == "__main__":
    main()
