"""A plain FSDP2 loop (``fully_shard``) saving with ``torch.distributed.checkpoint``, loader inside.

    torchrun --nproc_per_node 2 examples/fsdp2_dcp.py --out runs/dcp   # two processes, gloo, CPU

The model is sharded with FSDP2 over every process; each checkpoint is a distributed-checkpoint
directory that holds the sharded model and optimizer, every rank's loader state (``DCPLoaderState``:
all ranks' states as one value, so another number of processes resumes too) and every rank's
generators (``gather_rng_states``: CPU, every CUDA device, numpy, random). Every ``--every`` steps,
and at the step after SIGTERM/SIGUSR1 (all ranks agree), the ranks write
``OUT/checkpoints/.step_N.tmp-TOKEN``; rank 0 then seals it (a manifest of every file) and renames
it to ``step_N``, so a kill during a save leaves the previous checkpoint the newest. On start the
newest sealed checkpoint is loaded: rerunning the command continues with the very next batch. The
last line printed is a digest of the final weights, the same for an interrupted-and-resumed job as
for an uninterrupted one.

With ``--async-save`` each checkpoint is written by ``dcp.async_save``: the call takes the state of
this step (the model and optimizer copied to CPU memory, the step, the generators and the loader's
position, all in the one dict it is given) and a thread writes it while training goes on, over a
process group of its own. It is sealed once written, before the next checkpoint starts; at a
preemption the write in flight is finished and sealed, then the preemption checkpoint is written and
sealed, and only then does the process exit.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from loader_resume import ResumableDataLoader, set_global_rng_state
from loader_resume.job.checkpoint import (
    complete_checkpoints,
    prune,
    seal,
    temporary_name,
    verify,
    writer_token,
)
from loader_resume.distributed import (
    DCPLoaderState,
    any_rank,
    gather_rng_states,
    init_process_group,
)
from loader_resume.job.preemption import Preemption, workers_ignore_signals
from loader_resume.job.remote_copy import RemoteCopy, fetch_newer, start_remote_copy
from loader_resume.testing import fingerprint
from loader_resume.tools.demo import NoisyDigits


class Training(Stateful):
    """The model, the optimizer, the step and every rank's generators, as
    ``torch.distributed.checkpoint`` asks for them (on every rank)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.step = self.epoch = 0

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        rng = io.BytesIO()
        # NOTE: the same value on every rank (a collective): written once
        torch.save(gather_rng_states(), rng)
        return {"model": model, "optimizer": optimizer, "step": self.step, "epoch": self.epoch,
                "rng": rng.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step, self.epoch = state["step"], state["epoch"]
        rng = torch.load(io.BytesIO(state["rng"]), weights_only=True)
        # NOTE: a rank the saving run did not have keeps its fresh generators
        if dist.get_rank() < len(rng):
            set_global_rng_state(rng[dist.get_rank()])


class Checkpoints:
    """Every rank: each checkpoint written under a temporary name, then sealed and renamed by rank 0
    (and uploaded to ``copy``'s URL, its manifest last); with ``asynchronous``, written by
    ``dcp.async_save``'s thread meanwhile."""

    def __init__(self, root: Path, copy: RemoteCopy | None, asynchronous: bool) -> None:
        self.root, self.copy = root, copy
        # NOTE: the writing thread's collectives on a group of their own, never interleaved with the
        # loop's
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending: tuple[Future[Any], Path, Path] | None = None

    def save(
        self, training: Training, loader: ResumableDataLoader[Any], *, whole: bool = False
    ) -> None:
        """A checkpoint of this step; ``whole``: sealed before this returns (else, asynchronously,
        at the next)."""
        self.finish()
        final = self.root / f"step_{training.step:09d}"
        # NOTE: the same name on every rank (rank 0's, broadcast)
        temporary = temporary_name(final, writer_token())
        # NOTE: one dict: the loader's position is taken in the call, with the model of the same
        # step
        state = {"training": training, "loader": DCPLoaderState(loader)}
        if self.group is None:
            dcp.save(state, checkpoint_id=temporary)
            self._seal(temporary, final)
            return
        self.pending = (
            cast(
                "Future[Any]",
                dcp.async_save(state, checkpoint_id=temporary, process_group=self.group),
            ),
            temporary,
            final,
        )
        if whole:
            self.finish()

    def finish(self) -> None:
        """The checkpoint being written, if any, waited for and sealed."""
        if self.pending is not None:
            future, temporary, final = self.pending
            self.pending = None
            # NOTE: on rank 0, once every rank's files are written (DCP's last step gathers them)
            future.result()
            self._seal(temporary, final)

    def _seal(self, temporary: Path, final: Path) -> None:
        if dist.get_rank() == 0:
            seal(temporary, final)
            prune(self.root, keep=2)
            if self.copy is not None:
                self.copy.upload(final)
        dist.barrier()


def restore(root: Path, training: Training, loader: ResumableDataLoader[Any]) -> None:
    """The newest sealed checkpoint, if any (verified against its manifest), into ``training``."""
    found = complete_checkpoints(root)
    if found:
        verify(found[-1])
        state: dict[str, Any] = {"training": training, "loader": DCPLoaderState(loader)}
        dcp.load(state, checkpoint_id=found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="runs/fsdp2_dcp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N optimizer steps")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch-log", help="write one JSON line per step to DIR/log-RANK.jsonl")
    parser.add_argument(
        "--async-save", action="store_true", help="write checkpoints with dcp.async_save"
    )
    parser.add_argument(
        "--remote",
        help="an fsspec URL (s3://bucket/run) each checkpoint is copied to, and resumed "
        "from on a machine without them",
    )
    args = parser.parse_args()
    # under torchrun (one process: WORLD_SIZE=1 RANK=0 ... or torchrun --nproc 1)
    init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ResumableDataLoader(
        NoisyDigits(),
        batch_size=64,
        shuffle=True,
        num_workers=args.workers,
        # each rank its shard (rank and world size from torch.distributed)
        seed=0,
    )
    training = Training(model, optimizer)
    root = Path(args.out) / "checkpoints"
    preemption = Preemption(("SIGTERM", "SIGUSR1"))
    preemption.install()
    # a signal to the process group: the main process decides
    workers_ignore_signals(loader, preemption.signals)
    # a copy off the machine (one job per URL): the newer complete ones come first
    main = dist.get_rank() == 0
    copy = start_remote_copy(args.remote, root, keep=2, main=main, agree=any_rank)
    fetch_newer(copy, main=main, agree=any_rank)
    restore(root, training, loader)
    checkpoints = Checkpoints(root, copy, args.async_save)
    rank = dist.get_rank()
    log = open(Path(args.batch_log) / f"log-{rank}.jsonl", "a") if args.batch_log else None
    for epoch in range(training.epoch, args.epochs):
        for x, y, ids in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            training.step += 1
            if log is not None:
                log.write(
                    json.dumps(
                        {"step": training.step, "ids": ids.tolist(), "batch": fingerprint([x, y])}
                    )
                )
                log.write("\n")
                log.flush()
            stop = preemption.agreed()  # every rank, every step: one tiny all_reduce
            if stop or training.step % args.every == 0:
                # after an epoch's last batch: the next epoch
                training.epoch = epoch + (loader.epoch > epoch)
                # NOTE: a preemption's: on storage before the exit
                checkpoints.save(training, loader, whole=stop)
            if stop:
                print(
                    f"preempted: checkpoint at step {training.step}; exiting with 143", flush=True
                )
                raise SystemExit(143)
    checkpoints.finish()
    # a collective
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        print(
            f"final weights digest: {fingerprint([full[name] for name in sorted(full)])}",
            flush=True,
        )
    dist.barrier()
    gc.collect()  # NOTE: gloo aborts (SIGABRT) a process whose threads still hold tensors at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
