"""How long a preemption takes: from the signal to an exit with the checkpoint on storage.

    python benchmarks/bench_preemption.py           # ~3 min; prints the table, updates docs/
    python benchmarks/bench_preemption.py --quick   # 100 MB only, one run each, docs untouched

A Lightning ``Trainer`` with ``ResumeCallback`` trains one linear layer whose weights are the model
state (about 100 MB or 1 GB of float32, SGD without momentum: the checkpoint is the weights and
little else), in a process of its own. After step 3 a callback records the time and sends the
process SIGTERM; the callback's agreed checkpoint follows at that step's boundary, and an ``atexit``
handler records when the process is about to exit (``preempted.ckpt`` renamed in place, verified).
Writers: Lightning's ``TorchCheckpointIO`` (synchronous), ``AsyncCheckpointIO`` over it, and
``AsyncCheckpointIO`` with a periodic ``ModelCheckpoint`` write of the same size started at the same
step (so it is in flight when the preemption save begins: the save waits for it). The checkpoint
directory is on the machine's disk; the times are what the process waits for (the page cache takes
the bytes; neither Lightning nor the callback calls ``fsync`` on a Lightning checkpoint). Medians
over 3 runs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import markdown, write_docs_section

SIZES = {"100 MB": 100 * 2**20, "1 GB": 2**30}
WRITERS = {
    "synchronous (`TorchCheckpointIO`)": "sync",
    "`AsyncCheckpointIO`": "async",
    "`AsyncCheckpointIO`, a periodic write in flight": "async-periodic",
}
SIGNAL_AFTER = 3


def child(out: Path, size: int, writer: str) -> None:
    """One job: train, SIGTERM itself after step ``SIGNAL_AFTER``, record the times in
    ``out/times.json``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import AsyncCheckpointIO
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_resume import ResumeCallback

    width = int(math.sqrt(size / 4))
    times: dict[str, float] = {}
    atexit.register(
        lambda: (out / "times.json").write_text(json.dumps({**times, "exit": time.time()}))
    )

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(width, width, bias=False)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            times[f"step{self.global_step}"] = time.time()
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(TensorDataset(torch.randn(64, width)), batch_size=4)

    class Signal(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == SIGNAL_AFTER:
                times["signal"] = time.time()
                os.kill(os.getpid(), signal.SIGTERM)

    periodic = (
        [
            ModelCheckpoint(
                dirpath=out / "periodic",
                every_n_train_steps=SIGNAL_AFTER,
                save_top_k=-1,
                save_last=False,
            )
        ]
        if writer == "async-periodic"
        else []
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        plugins=[AsyncCheckpointIO()] if writer.startswith("async") else None,
        callbacks=[*periodic, Signal(), ResumeCallback(dirpath=out)],
    )
    trainer.fit(Model())


def measure(size: int, writer: str) -> dict[str, float]:
    """One job in a fresh process: the seconds from the signal to the exit, the checkpoint's size, a
    step's time."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        out = Path(root)
        done = subprocess.run([sys.executable, __file__, "--child", str(out), str(size), writer],
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 143:
            raise SystemExit(f"{writer} {size}: exit {done.returncode}\n{done.stderr[-3000:]}")
        times = json.loads((out / "times.json").read_text())
        return {
            "seconds": times["exit"] - times["signal"],
            "bytes": (out / "preempted.ckpt").stat().st_size,
            "step": times[f"step{SIGNAL_AFTER - 1}"] - times[f"step{SIGNAL_AFTER - 2}"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="100 MB, one run each; do not touch the docs"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), int(args.child[1]), args.child[2])
        return
    runs = 1 if args.quick else 3
    rows = []
    for size_name, size in SIZES.items() if not args.quick else [("100 MB", SIZES["100 MB"])]:
        for writer_name, writer in WRITERS.items():
            results = [measure(size, writer) for _ in range(runs)]
            seconds = statistics.median(r["seconds"] for r in results)
            rows.append([size_name, writer_name, f"{results[0]['bytes'] / 2**20:,.0f} MiB",
                         f"{statistics.median(r['step'] for r in results):.2f}", f"{seconds:.1f}"])
            print(rows[-1], flush=True)
    import lightning

    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"Lightning {lightning.__version__}")
    text = (
        f"Measured by `python benchmarks/bench_preemption.py` ({machine}); median over {runs} "
        "runs, each a fresh process, the checkpoint on the machine's disk.\n\n"
        + markdown(
            ["model state", "writer", "checkpoint", "one step (s)", "signal to exit (s)"], rows
        )
    )
    print(text)
    if not args.quick:
        write_docs_section("preemption", text)


if __name__ == "__main__":
    main()
