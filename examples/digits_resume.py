"""The main job: train on scikit-learn's digits, get stopped mid-epoch, resume, compare.

    python examples/digits_resume.py            # ~15 s on 2 CPU cores

Three real processes: an uninterrupted run; a run that checkpoints and exits mid-epoch (as if
preempted); a fresh process that resumes from that checkpoint. It prints whether the resumed batches
(sample ids and augmentation noise) and the final weights equal the uninterrupted run's, and where a
plain DataLoader restarted the same way would have diverged. Exit code 0 only if everything matches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Dataset

from loader_resume import ResumableDataLoader
from loader_resume.testing import fingerprint


class NoisyDigits(Dataset[tuple[torch.Tensor, int, int]]):
    """8x8 digits with random-noise augmentation and a random shift: every item draws from torch's RNG."""

    def __init__(self) -> None:
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


def build(args: argparse.Namespace, plain: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if plain:
        loader: Any = DataLoader(NoisyDigits(), batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    else:
        loader = ResumableDataLoader(NoisyDigits(), batch_size=args.batch_size, shuffle=True,
                                     num_workers=args.workers, seed=2024)
    return model, optimizer, loader


def save_atomically(obj: dict[str, Any], path: Path) -> None:
    """Write to a temporary file and rename: a kill mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(args: argparse.Namespace) -> None:
    """One process of the job: full, stop (checkpoint + exit at --stop-at) or resume (from --checkpoint)."""
    model, optimizer, loader = build(args, plain=args.plain)
    checkpoint = Path(args.checkpoint)
    step, first_epoch, log = 0, 0, []
    if args.phase == "resume":
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])  # the model's dropout stream continues too
        step, first_epoch = saved["step"], saved["epoch"]
        if args.plain:  # the usual workaround: skip the batches already seen in this epoch
            args.skip = saved["batch_in_epoch"]
        else:
            loader.load_state_dict(saved["loader"])
    for epoch in range(first_epoch, args.epochs):
        for batch_in_epoch, (x, y, ids) in enumerate(loader):
            if args.plain and args.phase == "resume" and epoch == first_epoch and batch_in_epoch < args.skip:
                continue
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            log.append(fingerprint((ids, x)))
            if args.phase == "stop" and step == args.stop_at:
                save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                 "rng": torch.get_rng_state(), "step": step, "epoch": epoch,
                                 "batch_in_epoch": batch_in_epoch + 1,
                                 "loader": None if args.plain else loader.state_dict()}, checkpoint)
                break
        else:
            continue
        break
    weights = fingerprint([p.detach() for p in model.parameters()])
    Path(args.out).write_text(json.dumps({"log": log, "weights": weights}))


def run_phase(phase: str, args: argparse.Namespace, workdir: Path, plain: bool = False) -> dict[str, Any]:
    out = workdir / f"{phase}{'-plain' if plain else ''}.json"
    command = [sys.executable, __file__, "--phase", phase, "--out", str(out),
               "--checkpoint", str(workdir / f"ckpt{'-plain' if plain else ''}.pt"),
               "--workers", str(args.workers), "--epochs", str(args.epochs),
               "--stop-at", str(args.stop_at), "--batch-size", str(args.batch_size)]
    subprocess.run([*command, *(["--plain"] if plain else [])], check=True)
    return dict(json.loads(out.read_text()))


def first_difference(a: list[str], b: list[str]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def orchestrate(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        full = run_phase("full", args, workdir)
        stop = run_phase("stop", args, workdir)
        resumed = run_phase("resume", args, workdir)
        run_phase("stop", args, workdir, plain=True)
        plain = run_phase("resume", args, workdir, plain=True)
    expected = full["log"][args.stop_at:]
    per_epoch = len(full["log"]) // args.epochs
    same_batches = stop["log"] == full["log"][: args.stop_at] and resumed["log"] == expected
    same_weights = resumed["weights"] == full["weights"]
    diverged = first_difference(plain["log"], expected)
    print(f"digits: {len(full['log'])} steps ({args.epochs} epochs of {per_epoch}), stopped after step "
          f"{args.stop_at} (mid-epoch), resumed in a fresh process, num_workers={args.workers}")
    print(f"  ResumableDataLoader: {len(resumed['log'])} batches after resume, identical ids and noise: "
          f"{'yes' if same_batches else 'NO'}; final weights identical: {'yes' if same_weights else 'NO'}")
    where = "never" if diverged is None else f"at the first step after resume (step {args.stop_at + diverged + 1})"
    print(f"  plain DataLoader + skipping seen batches: diverges {where}; final weights identical: "
          f"{'yes' if plain['weights'] == full['weights'] else 'no'}")
    return 0 if same_batches and same_weights else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stop-at", type=int, default=40, help="global step after which the job is stopped")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--phase", choices=["full", "stop", "resume"], help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is None:
        return orchestrate(args)
    args.skip = 0
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
