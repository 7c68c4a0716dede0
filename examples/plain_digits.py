"""Plain PyTorch (core only) on scikit-learn's digits: DDP-ready, resumes by itself.

    python plain_digits.py --out runs/plain                     # one process
    torchrun --nproc_per_node 2 --max-restarts 3 \
        plain_digits.py --out runs/plain                        # DDP, gloo
    python plain_digits.py --device cuda --bf16 --deterministic # on a GPU

Every ``--every`` optimizer steps (and on SIGTERM/SIGUSR1, at the next step) all ranks
agree and rank 0 writes ``OUT/checkpoints/step_N``: model, optimizer, every rank's
loader and RNG states, in a directory sealed with a manifest
(``loader_resume.job.checkpoint``: written under a temporary name, checksummed,
renamed). On
start the newest sealed checkpoint is verified and loaded, so rerunning the command — or
torchrun restarting crashed processes — continues with the very next batch.
``--batch-log DIR`` writes one JSON line per step and rank (the chaos tests audit them);
``--audit DIR`` has the loader log what it hands over, for ``loader-resume audit DIR``.
The last line printed is a digest of the final weights, the same for an
interrupted-and-resumed job as for an uninterrupted one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loader_resume import ResumableDataLoader
from loader_resume.distributed import (
    any_rank,
    gather_rng_states,
    gather_states,
    init_process_group,
    load_rank_state,
)
from loader_resume.job.checkpoint import (
    complete_checkpoints,
    prune,
    seal,
    set_global_rng_state,
    temporary_name,
    verify,
)
from loader_resume.job.preemption import Preemption
from loader_resume.job.remote_copy import RemoteCopy, fetch_newer, start_remote_copy
from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits


# --8<-- [start:checkpoint]
def save(root: Path, step: int, epoch: int, model: nn.Module,
         optimizer: torch.optim.Optimizer, loader: ResumableDataLoader[Any],
         copy: RemoteCopy | None = None) -> None:
    """All ranks call it (the gathers are collectives); rank 0 writes and seals
    ``root/step_N``, then uploads it to ``copy``'s URL, its manifest last."""
    state = {"step": step, "epoch": epoch, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "loader": gather_states(loader),
             "rng": gather_rng_states()}
    if loader.rank == 0:
        final = root / f"step_{step:09d}"
        temporary = temporary_name(final)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        torch.save(state, temporary / "state.pt")
        seal(temporary, final)
        prune(root, keep=2)
        if copy is not None:
            copy.upload(final)
    if dist.is_initialized():
        dist.barrier()


def restore(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
            loader: ResumableDataLoader[Any]) -> tuple[int, int]:
    """Load the newest sealed checkpoint, if any; returns (step, epoch)."""
    found = complete_checkpoints(root)
    if not found:
        return 0, 0
    verify(found[-1])
    state = torch.load(found[-1] / "state.pt", weights_only=True,
                       map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    load_rank_state(loader, state["loader"])
    rng = state["rng"]
    if loader.rank < len(rng):
        set_global_rng_state(rng[loader.rank])
    return state["step"], state["epoch"]
# --8<-- [end:checkpoint]


def incarnation() -> int:
    """For the batch log: one number per start of the job, agreed by its ranks, growing
    from start to start (torchrun's restart counts are per node and do not grow on a
    membership change)."""
    stamp = [time.time_ns()]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return int(stamp[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="runs/plain_digits")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=10,
                        help="checkpoint every N optimizer steps")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batch-log",
                        help="write one JSON line per step to DIR/log-RANK.jsonl")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda (one GPU per process: cuda:LOCAL_RANK)")
    parser.add_argument("--bf16", action="store_true",
                        help="the forward pass under bf16 autocast")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds per step (to interrupt it by hand)")
    parser.add_argument("--audit", default=os.environ.get("LOADER_RESUME_AUDIT"),
                        help="a directory or fsspec URL each rank logs the batches it "
                        "is handed to, for `loader-resume audit DIR` (default: "
                        "$LOADER_RESUME_AUDIT, as the front-ends read it)")
    parser.add_argument("--remote",
                        help="an fsspec URL (s3://bucket/run) each checkpoint is "
                        "copied to, and resumed from on a machine without them")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda
                          else "cpu")
    if args.deterministic:
        # cuBLAS's condition for determinism
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(device)
        # dist.init_process_group, safe across torchrun's restarts
        init_process_group("nccl" if cuda else "gloo")
    # --8<-- [start:loop]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
                        nn.Linear(64, 10)).to(device)
    model: nn.Module = (nn.parallel.DistributedDataParallel(net)
                        if dist.is_initialized() else net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ResumableDataLoader(NoisyDigits(), batch_size=args.batch_size,
                                 shuffle=True, pin_memory=cuda,
                                 num_workers=args.workers,
                                 seed=0,  # rank and world from torch.distributed
                                 audit=args.audit)
    root = Path(args.out) / "checkpoints"
    preemption = Preemption(("SIGTERM", "SIGUSR1"))
    preemption.install()
    # a copy off the machine (one job per URL): the newer complete ones come first
    main = loader.rank == 0
    copy = start_remote_copy(args.remote, root, keep=2, main=main, agree=any_rank)
    fetch_newer(copy, main=main, agree=any_rank)
    step, first_epoch = restore(root, model, optimizer, loader)
    log = (open(Path(args.batch_log) / f"log-{loader.rank}.jsonl", "a")
           if args.batch_log else None)
    attempt = incarnation() if log is not None else 0
    for epoch in range(first_epoch, args.epochs):
        for x, y, ids in loader:
            x, y = (x.to(device, non_blocking=True),
                    y.to(device, non_blocking=True))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            if log is not None:
                log.write(json.dumps({"attempt": attempt, "rank": loader.rank,
                                      "step": step, "epoch": epoch,
                                      "ids": ids.tolist(),
                                      "batch": fingerprint([x, y])}) + "\n")
                log.flush()
            if step % 10 == 0 and loader.rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
            stop = preemption.agreed()  # every rank, every step: one tiny all_reduce
            if stop or step % args.every == 0:
                # NOTE: a checkpoint taken after an epoch's last batch resumes at
                # the next epoch's start
                save(root, step, epoch + (loader.epoch > epoch), model, optimizer,
                     loader, copy)
            if stop:
                raise SystemExit(143)
            time.sleep(args.sleep)
    # --8<-- [end:loop]
    if loader.rank == 0:
        print("final weights digest: "
              f"{fingerprint([p.detach() for p in net.parameters()])}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        # NOTE: gloo aborts (SIGABRT) a process whose threads still hold tensors at exit
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
