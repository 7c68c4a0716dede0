"""A real Accelerate loop over two prepared loaders of unequal length, for
test_loop_edges_frameworks.py.

    python accelerate_loops_child.py OUT --shape zip|alternate [--workers W] [--signal-at N[,N...]]
    python accelerate_loops_child.py --batch PLAN   # runs one after another (support/batch.py)

``zip``: ``for xa, xb in zip(a, b)``, a (6 batches) longer than b (4), one optimizer step per pair.
``alternate``: the batches of ``zip(b, a)`` one after another, the optimizer stepped twice per
batch. OUT/log.json gathers every run's rows (optimizer steps done, and per loader the ids and a
fingerprint of the noise its items drew) and the final weights. ``--signal-at N``: SIGTERM to itself
once the job's N-th row is logged (counting the rows of the runs before); the checkpoint follows at
the next step boundary (exit 143); the same command again continues, and is signalled again at the
next N of the list.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from accelerate_resume import enable_resume
from loader_resume.testing import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' folder: support
from support.batch import fresh_accelerate, run_each
from support.data import Noisy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shape", required=True, choices=["zip", "alternate"])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument(
        "--signal-at", type=lambda text: {int(n) for n in text.split(",")}, default=set()
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(123)
    accelerator = Accelerator(cpu=True, project_dir=str(out))
    assert accelerator.num_processes == 1
    resume = enable_resume(accelerator, {"seed": 7})
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = {"a": Noisy(24), "b": Noisy(16)}
    a, b = (
        DataLoader(data[name], batch_size=4, shuffle=True, num_workers=args.workers)
        for name in "ab"
    )
    model, optimizer, a, b = accelerator.prepare(model, optimizer, a, b)

    log = out / "log.json"
    rows: list[Any] = json.loads(log.read_text())["rows"] if log.exists() else []

    def step(named: dict[str, Any]) -> None:
        row: dict[str, Any] = {}
        loss = torch.zeros(())
        for name, (x, y, ids) in sorted(named.items()):
            row[name] = [ids.tolist(), fingerprint([x - data[name].x[ids]])]
            loss = loss + nn.functional.cross_entropy(model(x), y)
        for _ in range(1 if args.shape == "zip" else 2):
            accelerator.backward(loss if _ == 0 else nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        row["step"] = resume.step
        rows.append(row)
        log.write_text(json.dumps({"rows": rows}))
        if len(rows) in args.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def alternate() -> Iterator[dict[str, Any]]:
        for xb, xa in zip(b, a, strict=False):
            yield {"b": xb}
            yield {"a": xa}

    for _ in resume.epochs(2):
        model.train()
        batches = (
            ({"a": xa, "b": xb} for xa, xb in zip(a, b, strict=False))
            if args.shape == "zip"
            else alternate()
        )
        for named in batches:
            step(named)
    weights = fingerprint([p.detach() for p in model.parameters()])
    log.write_text(json.dumps({"rows": rows, "weights": weights}))
    accelerator.end_training()


if __name__ == "__main__":
    if sys.argv[1] == "--batch":
        run_each(main, sys.argv[2], fresh_accelerate)
    else:
        main()
