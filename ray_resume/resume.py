"""``RayResume``: exact mid-epoch resume inside a Ray Train ``train_loop_per_worker``.

Ray Train restarts a failed run from the last checkpoint reported to it
(``FailureConfig(max_failures=...)``), and a new run under the same ``RunConfig(name,
storage_path)`` starts from it too; ``ray.train.get_checkpoint()`` hands it to every worker.
``RayResume`` puts into each checkpoint what decides the next batches — every rank's loader states
and generators, the step and the epoch — beside rank 0's model, optimizer and scheduler, and
restores all of it, so training continues with the very next batch: at the same worker count
exactly, at another one (map-style data) with the rest of the epoch exactly once.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from loader_resume import ResumableDataLoader
from loader_resume.distributed import load_rank_state
from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.checkpoint_entry import new_entry
from loader_resume.job.generators import global_rng_state, set_global_rng_state

from .files import rank_file, read_ranks, unwrapped

__all__ = ["RayResume", "to_device"]

logger = logging.getLogger(__name__)

class RayResume:
    """Checkpoints and restores a Ray Train worker's data position with its model.

    Args:
        loaders: the training loaders,
            [`loader_resume.ResumableDataLoader`][loader_resume.ResumableDataLoader] (they shard
            themselves across Ray's workers, through the process group Ray set up). Not
            ``ray.train.torch.prepare_data_loader``'s
            result: by default it builds another loader with a ``DistributedSampler`` (another
                order, a state
            nobody saves), and its wrapper reads a batch ahead (a resume would skip one) — refused;
            move batches with [`to_device`][ray_resume.to_device].
        model: saved by rank 0 and loaded by every rank (``prepare_model``'s DDP wrapper is looked
            through; a sharded FSDP model is refused: rank 0 cannot save it alone).
        optimizer: saved by rank 0 and loaded by every rank, as ``model``.
        scheduler: saved by rank 0 and loaded by every rank, as ``model``.
        every_n_steps: report a checkpoint every N steps
            ([`step_end`][ray_resume.RayResume.step_end]); 0: only when
            [`report`][ray_resume.RayResume.report] is called, or at Ray's preemption notice.
        preemption_notice: ask ``ray.train.get_preemption_info()`` every ``check_every_n_steps``
            steps (a barrier across workers, as the steps are: rank 0's answer goes to every worker,
            so all see the notice at the same step); at the first notice every worker reports a
            checkpoint at that step boundary.
        check_every_n_steps: how often the preemption notice is asked for.
        stop_on_preemption: after the notice's checkpoint (step N), the workers finish step N (the
            code after [`step_end`][ray_resume.RayResume.step_end] runs) and then wait for Ray to
            restart the run, at the node's
            deadline: the next [`step_end`][ray_resume.RayResume.step_end] (step N + 1's work is
                done again after the
            restart, its code after ``step_end`` runs once) or the next pass of
            [`epochs`][ray_resume.RayResume.epochs] does not return, unless the run is over. The
            restart continues with step N + 1. ``False``: training goes on, as Ray's own example
            does, and the restart replays the steps after the newest registered checkpoint.

    Every worker calls [`step_end`][ray_resume.RayResume.step_end] once per step, with the same
    settings: Ray pairs its barriers by order. A checkpoint due at an epoch's last step is reported
    once the epoch's own code after its loop (a scheduler's step, an evaluation) has run: at the
    next pass of [`epochs`][ray_resume.RayResume.epochs], or at the next step.
    """

    def __init__(self, *loaders: ResumableDataLoader[Any], model: Any = None, optimizer: Any = None,
                 scheduler: Any = None, every_n_steps: int = 0, preemption_notice: bool = True,
                 check_every_n_steps: int = 10, stop_on_preemption: bool = True) -> None:
        for loader in loaders:
            if type(loader).__name__ == "_WrappedDataLoader":
                raise TypeError(
                    "RayResume: a loader from ray.train.torch.prepare_data_loader, which reads a "
                    "batch ahead (a resume would skip it); expected the ResumableDataLoader itself "
                    "(it shards itself across Ray's workers; move its batches with "
                    "ray_resume.to_device)"
                )
            if not isinstance(loader, ResumableDataLoader):
                raise TypeError(
                    f"RayResume: a {type(loader).__name__}; expected "
                    "loader_resume.ResumableDataLoader "
                    "(a plain DataLoader's position cannot be saved)"
                )
        if model is not None and (isinstance(model, FullyShardedDataParallel) or any(
                isinstance(parameter, DTensor) for parameter in model.parameters())):
            raise TypeError(
                "RayResume: a sharded model (FSDP); expected a plain or DistributedDataParallel "
                "model (rank 0 saves it alone). Save a sharded model with "
                "torch.distributed.checkpoint yourself and give RayResume no model"
            )
        if every_n_steps < 0 or check_every_n_steps < 1:
            raise ValueError(
                f"RayResume: every_n_steps={every_n_steps}, "
                f"check_every_n_steps={check_every_n_steps}; "
                "expected every_n_steps >= 0 and check_every_n_steps >= 1"
            )
        self.loaders = loaders
        self.objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        self.every_n_steps, self.check_every_n_steps = every_n_steps, check_every_n_steps
        self.preemption_notice, self.stop_on_preemption = preemption_notice, stop_on_preemption
        self.step = 0
        """Optimizer steps taken (counted by [`step_end`][ray_resume.RayResume.step_end]), restored
        from a checkpoint."""
        self.epoch = 0
        self._restored = self._resumed = False
        self._noticed = self._stopping = False
        self._reported_at: int | None = None
        self._unmoved: list[dict[str, Any]] | None = None
        # a report due at an epoch's last step, after its epoch's code
        self._pending: dict[str, Any] | None = None

    def restore(self) -> bool:
        """Load ``ray.train.get_checkpoint()`` if Ray has one (a retry, or a rerun of the same run);
        whether it did. Called by [`epochs`][ray_resume.RayResume.epochs] if not before; once."""
        if not self._restored:
            self._restored = True
            checkpoint = ray.train.get_checkpoint()
            if checkpoint is not None:
                with checkpoint.as_directory() as directory:
                    self._load(Path(directory))
                self._resumed = True
            self._unmoved = [loader.state_dict(pass_ended=False) for loader in self.loaders]
        return self._resumed

    def _load(self, directory: Path) -> None:
        ranks = read_ranks(directory)
        world, context = ranks[0]["world_size"], ray.train.get_context()
        if any(len(state["loaders"]) != len(self.loaders) for state in ranks):
            raise CheckpointError(
                f"{directory}: {len(ranks[0]['loaders'])} loader states per rank; this RayResume "
                f"has {len(self.loaders)} loaders"
            )
        for name, target in self.objects.items():
            path = directory / f"{name}.pt"
            if target is not None:
                if not path.is_file():
                    raise CheckpointError(
                        f"{path}: missing; RayResume was given a {name} to restore"
                    )
                unwrapped(target).load_state_dict(
                    torch.load(path, weights_only=True, map_location="cpu")
                )
        for index, loader in enumerate(self.loaders):
            load_rank_state(
                loader, {"world_size": world, "ranks": [state["loaders"][index] for state in ranks]}
            )
        if world == context.get_world_size():
            generators = dict(ranks[context.get_world_rank()]["rng"])
            own = generators.pop("own_cuda", None)
            set_global_rng_state(generators)
            if own is not None:
                torch.cuda.set_rng_state(own, ray.train.torch.get_device())
        else:
            logger.warning(
                "checkpoint of %d workers, %d now: each loader continues the rest of the epoch "
                "exactly once, the generators start afresh",
                world,
                context.get_world_size(),
            )
        self.step, self.epoch = ranks[0]["step"], ranks[0]["epoch"]
        self._reported_at = self.step
        logger.info("resumed from %s at step %d (epoch %d)", directory, self.step, self.epoch)

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs left of ``count``, from the restored one (restoring first)."""
        self.restore()
        while self.epoch < count:
            yield self.epoch
            self.epoch += 1
            # the epoch's own code (a scheduler's step, an evaluation) has run
            if self._pending is not None:
                self.report(self._pending)
            # the run is not over: nothing of the next epoch runs
            if self._stopping and self.epoch < count:
                wait_for_the_restart()

    def step_end(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Call on every worker after each optimizer step (once the step's work is done): counts the
        step, and reports a checkpoint with ``metrics`` when one is due (``every_n_steps``, Ray's
        preemption notice). After a preemption notice's checkpoint it does not return
        (``stop_on_preemption``)."""
        if self._stopping:
            wait_for_the_restart()
        self.step += 1
        if self._unmoved is not None:
            self._check_iterated()
        notice = False
        if self.preemption_notice and self.step % self.check_every_n_steps == 0:
            notice = ray.train.get_preemption_info() is not None and not self._noticed
        if notice:
            self._noticed, self._stopping = True, self.stop_on_preemption
            logger.warning(
                "Ray's preemption notice: a checkpoint at step %d; %s",
                self.step,
                "waiting for Ray to restart the run" if self._stopping else "training goes on",
            )
        if (
            notice
            or self._pending is not None
            or (self.every_n_steps and self.step % self.every_n_steps == 0)
        ):
            # an epoch's last step: after its own code
            if self.loaders and self.loaders[0].epoch > self.epoch:
                self._pending = dict(metrics or {})
            else:
                self.report(dict(metrics or {}))

    def _check_iterated(self) -> None:
        unmoved, self._unmoved = self._unmoved, None
        if any(read_ahead_by_ray(loader) for loader in self.loaders):
            raise RuntimeError(
                "RayResume: a loader is iterated through ray.train.torch.prepare_data_loader's "
                "wrapper, which reads a batch ahead (a resume would skip it); iterate the "
                "ResumableDataLoader itself and move batches with ray_resume.to_device"
            )
        if (
            self.loaders
            and [loader.state_dict(pass_ended=False) for loader in self.loaders] == unmoved
        ):
            raise RuntimeError(
                "RayResume: a training step was taken, and none of its loaders handed out a batch: "
                "the loop iterates another loader, whose position nobody saves. "
                "ray.train.torch.prepare_data_loader(loader) builds a new DataLoader with a "
                "DistributedSampler; iterate the ResumableDataLoader itself (it shards itself) and "
                "move batches with ray_resume.to_device"
            )

    def report(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Report a checkpoint to Ray now, with ``metrics`` (every worker, at a step boundary: Ray's
        report is a barrier). Once per step: a second call at the same step reports the metrics
        only."""
        self._pending = None
        if self._reported_at == self.step:
            ray.train.report(dict(metrics or {}))
        else:
            self._report_checkpoint(dict(metrics or {}))

    def _report_checkpoint(self, metrics: dict[str, Any]) -> None:
        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
        # the epoch's last batch is out
        ahead = bool(self.loaders) and self.loaders[0].epoch > self.epoch
        state = new_entry(rank=rank, world_size=world, step=self.step, epoch=self.epoch + ahead,
                          loaders=[loader.state_dict(pass_ended=False) for loader in self.loaders],
                          rng=own_generators())
        with tempfile.TemporaryDirectory() as temporary:
            directory = Path(temporary)
            torch.save(state, rank_file(directory, rank))
            for name, target in self.objects.items():
                if target is not None and rank == 0:
                    torch.save(unwrapped(target).state_dict(), directory / f"{name}.pt")
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(temporary),
                             checkpoint_dir_name=f"step_{self.step:09d}")
        self._reported_at = self.step


def wait_for_the_restart() -> None:
    """Take no further step: Ray's controller, told of the preemption, tears this worker down at the
    node's deadline (120 s after it saw the notice when the node has none) and restarts the run from
    the checkpoint just reported. Returning instead would end the run as finished, and raising would
    count as a failure."""
    while True:
        time.sleep(60)
        logger.info("waiting for Ray to restart the run after the preemption notice")


def own_generators() -> dict[str, Any]:
    """This worker's generators: the CPU's, numpy's, random's, and its own CUDA device's only (Ray
    may show a worker every GPU of its node; after a restart it may use another one)."""
    generators = global_rng_state()
    generators.pop("cuda", None)
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        generators["own_cuda"] = torch.cuda.get_rng_state(device)
    return generators


def read_ahead_by_ray(loader: ResumableDataLoader[Any]) -> bool:
    """Whether ``prepare_data_loader(loader, add_dist_sampler=False)``'s wrapper holds ``loader``:
    it copies the loader's attributes into its own and keeps the loader as ``_dataloader``, which it
    reads one batch ahead."""
    for holder in gc.get_referrers(loader):
        fields = holder if isinstance(holder, dict) else getattr(holder, "__dict__", {})
        if fields.get("_dataloader") is loader and "next_batch" in fields:
            return True
    return False


def to_device(batch: Any, device: torch.device | None = None) -> Any:
    """``batch`` (tensors in tuples, lists and dicts) on ``device`` (default:
    ``ray.train.torch.get_device()``), copied without blocking; nothing is read ahead, unlike
    ``prepare_data_loader``'s wrapper."""
    if device is None:
        device = ray.train.torch.get_device()
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple):  # a named tuple takes its fields one by one
        moved = [to_device(value, device) for value in batch]
        return tuple(moved) if type(batch) is tuple else type(batch)(*moved)
    if isinstance(batch, list):
        return [to_device(value, device) for value in batch]
    return batch
