"""``loader-resume demo``: train on scikit-learn's digits, SIGTERM it mid-epoch, restart, compare.

Four real processes: an uninterrupted run; a run that gets a real SIGTERM mid-epoch, checkpoints at
the next step boundary and exits; a fresh process that resumes from that checkpoint and finishes;
and the same stop/resume with a plain DataLoader that skips the batches it already saw (the usual
workaround). It prints whether the resumed batches (sample ids and augmentation noise) and the final
weights equal the uninterrupted run's, and where the plain DataLoader diverged. Needs scikit-learn
(``.[examples]``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from loader_resume.job.checkpoint import global_rng_state, set_global_rng_state
from loader_resume.job.preemption import Preemption
from loader_resume.loader import ResumableDataLoader
from loader_resume.testing import fingerprint

__all__ = ["NoisyDigits", "add_arguments", "main"]


class NoisyDigits(Dataset[tuple[torch.Tensor, int, int]]):
    """8x8 digits with random-noise augmentation and a random shift: every item draws from torch's
    RNG."""

    def __init__(self) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:  # an optional dependency: say how to get it
            raise SystemExit(
                "the demo needs scikit-learn: pip install 'loader-resume[examples]'"
            ) from error
        digits = load_digits()
        self.x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        self.y = torch.tensor(digits.target)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image = self.x[index].view(8, 8)
        shift = int(torch.randint(-1, 2, ()))
        image = torch.roll(image, shifts=shift, dims=1) + 0.05 * torch.randn(8, 8)
        return image.flatten(), int(self.y[index]), index


def _build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if args.plain:
        loader: Any = DataLoader(
            NoisyDigits(), batch_size=args.batch_size, shuffle=True, num_workers=args.workers
        )
    else:
        loader = ResumableDataLoader(NoisyDigits(), batch_size=args.batch_size, shuffle=True,
                                     num_workers=args.workers, seed=2024)
    return model, optimizer, loader


def _save_atomically(obj: dict[str, Any], path: Path) -> None:
    """Write to a temporary file and rename: a kill mid-save leaves the previous checkpoint
    intact."""
    temporary = path.with_suffix(".tmp")
    torch.save(obj, temporary)
    os.replace(temporary, path)


def _train(args: argparse.Namespace) -> int:
    """One process: ``full``, ``stop`` (stop on SIGTERM or at --stop-at) or ``resume``."""
    model, optimizer, loader = _build(args)
    checkpoint, preemption = Path(args.checkpoint), Preemption(("SIGTERM",))
    preemption.install()
    step, first_epoch, skip, log = 0, 0, 0, []
    if args.phase == "resume":
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        set_global_rng_state(saved["rng"])  # the model's dropout draws continue too
        step, first_epoch = saved["step"], saved["epoch"]
        if args.plain:  # the usual workaround: skip the batches already seen in this epoch
            skip = saved["batch_in_epoch"]
        else:
            loader.load_state_dict(saved["loader"])
    for epoch in range(first_epoch, args.epochs):
        for batch_in_epoch, (x, y, ids) in enumerate(loader):
            if epoch == first_epoch and batch_in_epoch < skip:
                continue
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            log.append(fingerprint((ids, x)))
            if args.phase == "stop":
                print(f"step {step}", flush=True)
                time.sleep(0.01)  # slow enough to be signalled mid-epoch
                if preemption.agreed() or step == args.stop_at:  # a step boundary: save, then leave
                    _save_atomically(
                        {
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "rng": global_rng_state(),
                            "step": step,
                            "epoch": epoch,
                            "batch_in_epoch": batch_in_epoch + 1,
                            "loader": None if args.plain else loader.state_dict(),
                        },
                        checkpoint,
                    )
                    Path(args.out).write_text(json.dumps({"log": log, "weights": None}))
                    return 143
    weights = fingerprint([p.detach() for p in model.parameters()])
    Path(args.out).write_text(json.dumps({"log": log, "weights": weights}))
    return 0


def _phase(
    phase: str, args: argparse.Namespace, workdir: Path, plain: bool, stop_at: int = 0
) -> dict[str, Any]:
    tag = f"{phase}{'-plain' if plain else ''}"
    out = workdir / f"{tag}.json"
    command = [
        sys.executable,
        "-m",
        "loader_resume.tools.demo",
        "--phase",
        phase,
        "--out",
        str(out),
        "--checkpoint",
        str(workdir / f"ckpt{'-plain' if plain else ''}.pt"),
        "--workers",
        str(args.workers),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--stop-at",
        str(stop_at),
        *(["--plain"] if plain else []),
    ]
    if phase != "stop" or stop_at:
        subprocess.run(command, check=phase != "stop", stdout=subprocess.DEVNULL)
    else:  # a real SIGTERM, from here, once the run is well into its first epoch
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == f"step {args.signal_after}":
                child.send_signal(signal.SIGTERM)
                break
        child.communicate()
        if child.returncode != 143:
            raise SystemExit(f"the interrupted run exited with {child.returncode}, expected 143")
    return dict(json.loads(out.read_text()))


def _first_difference(a: list[str], b: list[str]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _orchestrate(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        full = _phase("full", args, workdir, plain=False)
        stopped = _phase("stop", args, workdir, plain=False)
        stop_step = len(stopped["log"])
        resumed = _phase("resume", args, workdir, plain=False)
        _phase("stop", args, workdir, plain=True, stop_at=stop_step)
        plain = _phase("resume", args, workdir, plain=True)
    per_epoch = len(full["log"]) // args.epochs
    same_batches = stopped["log"] + resumed["log"] == full["log"]
    same_weights = resumed["weights"] == full["weights"]
    diverged = _first_difference(plain["log"], full["log"][stop_step:])
    print(
        f"digits: {len(full['log'])} steps ({args.epochs} epochs of {per_epoch}); SIGTERM during "
        f"step {args.signal_after}, checkpoint at the step boundary after step {stop_step} "
        f"(mid-epoch), resumed in a fresh process, num_workers={args.workers}"
    )
    print(
        f"  ResumableDataLoader: {len(resumed['log'])} batches after resume, identical ids and "
        f"noise: {'yes' if same_batches else 'NO'}; final weights identical: "
        f"{'yes' if same_weights else 'NO'}"
    )
    where = (
        "never"
        if diverged is None
        else f"at the first step after resume (step {stop_step + 1})"
        if diverged == 0
        else f"at step {stop_step + diverged + 1}, {diverged + 1} steps after resume"
    )
    print(f"  plain DataLoader + skipping seen batches: diverges {where}; final weights identical: "
          f"{'yes' if plain['weights'] == full['weights'] else 'no'}")
    return 0 if same_batches and same_weights else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--signal-after", type=int, default=40, help="send SIGTERM once this step has started"
    )
    parser.add_argument("--phase", choices=["full", "stop", "resume"], help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=int, default=0, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the demo (or, with ``--phase``, one of its processes); returns the exit code."""
    return _orchestrate(args) if args.phase is None else _train(args)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m loader_resume.tools.demo")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
