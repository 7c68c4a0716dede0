"""``TorchFTResume``: every sample exactly once per epoch while TorchFT's replica groups fail and
rejoin, without restarting the job.

The epoch is one global order of samples (``ResumableDataLoader``'s): each committed step takes the
next ``participants * batch_size`` of it, participant ``r`` the ``r``-th slice. So:

- at each quorum the loader is sharded over the participating replica groups (rebuilt, from the
  same global position, when the participants change): the samples a dead group would have read
  are read by the groups left;
- a step that does not commit gives its batch back: the loader returns to the state taken before
  the batch, and the step's samples are read again by whoever takes part in the next one;
- a group that rejoins takes the loader state from a healthy peer in TorchFT's own recovery (the
  state holds no rank: one state serves every group), with the model and optimizer the user
  registered.

Random augmentations are keyed per sample (``keying="sample"``): a sample read by another group,
in another batch, draws the same numbers.

When every group is lost (the whole job stopped), the periodic checkpoint brings it back: with
``checkpoint_dir``, the first participant writes the model, the optimizer, TorchFT's step and the
loader state every ``save_every_n_steps`` committed steps (sealed: a kill during a write leaves the
previous one), and a restarted job loads the newest complete one before its first quorum. A
preemption signal (SIGTERM, SIGUSR1) on any group stops them all at the same committed step: the
groups agree inside the step's gradient exchange, the first participant writes the checkpoint, and
every group exits with 143 once it is on storage (74 when the write failed, or a group does not see
it within ``WAIT_SECONDS``); without ``checkpoint_dir`` the signals are left as they are. A group
restarted while the others train loads the checkpoint, then TorchFT's recovery brings it to their
step.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader

from loader_resume.audit.log import audit_from_environment, quorum_log, state_digest
from loader_resume.convert import resumable
from loader_resume.job.checkpoint import complete_checkpoints, write_sealed
from loader_resume.job.checkpoint_dir import newest_usable
from loader_resume.job.checkpoint_entry import checked_entry, new_entry
from loader_resume.job.preemption import Preemption
from loader_resume.job.storage import is_remote
from loader_resume.keyed.keyed_rng import GENERATORS
from loader_resume.loader import ResumableDataLoader
from loader_resume.workers.torch_internals import shut_down_workers

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["STATE_KEY", "TorchFTResume"]

logger = logging.getLogger(__name__)

_DONE = object()

STATE_KEY = "loader_resume"
"""The name the loader state is registered under with ``Manager.register_state_dict_fn``."""
CHECKPOINT_FILE = "torchft_resume.pt"
"""The file of a ``step_N`` checkpoint directory: model, optimizer, TorchFT's and the loader's
state."""
WRITE_FAILED = 74
WAIT_SECONDS = 600.0
"""How long a group that does not write waits for the first participant's preemption checkpoint."""


class TorchFTResume:
    """The data side of a TorchFT training loop (see the module docstring).

    Args:
        manager: the replica group's ``torchft.Manager``, built with ``use_async_quorum=False``
            (an asynchronous quorum lets a step run before its participants are known: refused).
        loader: the training loader, a plain ``DataLoader`` or a ``ResumableDataLoader`` (map-style
            data); its batch size is each group's share of a step.
        seed: the order of every epoch and every keyed random number.
        keyed_generators: the generators a sample's loading draws from, keyed per sample.
        model: registered with the manager (a rejoining group takes it from a peer) and saved in
            the checkpoint; leave it out if the manager already has it (then no checkpoint can be
            written).
        optimizer: the same, for the optimizer.
        checkpoint_dir: the directory of ``step_N`` checkpoints, shared by the groups (``None``:
            no checkpoint; the job lives as long as one group does).
        save_every_n_steps: a checkpoint every N committed steps (0: only on preemption).
        keep: the newest checkpoints kept.
        signals: the signals that stop the job at an agreed checkpoint.
        exit_code: every group's exit after that checkpoint.
        audit: a directory every group sees (or ``$LOADER_RESUME_AUDIT``): each process records
            the steps it took part in, for ``loader-resume audit DIR``.

    The loop::

        resume = TorchFTResume(manager, loader)
        for batch in resume.batches(epochs=2):
            loss = model(batch).sum()
            loss.backward()
            resume.average_gradients(model.parameters())
            if resume.commit():
                optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(self, manager: Manager, loader: DataLoader[Any], *, seed: int = 0,
                 keyed_generators: Iterable[str] = GENERATORS, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, save_every_n_steps: int = 0,
                 keep: int = 2, signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1"),
                 exit_code: int = 143, audit: str | os.PathLike[str] | None = None) -> None:
        _refuse_unsupported(manager, loader, optimizer)
        if checkpoint_dir is not None and is_remote(checkpoint_dir):
            raise ValueError(f"TorchFTResume(checkpoint_dir={os.fspath(checkpoint_dir)!r}): a URL; "
                             "expected a directory every group sees (a shared mount)")
        if checkpoint_dir is not None and (model is None or optimizer is None):
            raise ValueError("TorchFTResume(checkpoint_dir=...): expected model= and optimizer= "
                             "too (the checkpoint holds them)")
        for name, value, least in (("save_every_n_steps", save_every_n_steps, 0),
                                   ("keep", keep, 1), ("exit_code", exit_code, 0)):
            if type(value) is not int or value < least:
                raise ValueError(f"TorchFTResume({name}={value!r}): expected an int >= {least}")
        self.manager = manager
        self.preemption = Preemption(signals)
        self._ignores = checkpoint_dir is not None
        self._source = loader
        self._seed = seed
        self._generators = tuple(keyed_generators)
        self._shard: tuple[int, int] | None = None
        self.loader: ResumableDataLoader[Any] = self._build(0, 1)
        directory = audit_from_environment(audit)
        self._audit = None if directory is None else quorum_log(
            directory, self.loader.dataset, self.loader.state_dict(),
            str(getattr(manager, "_replica_id", "")))
        self._units = _units(loader, self.loader) if self._audit is not None else 0
        self._pass: Iterator[Any] | None = None
        self._before: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        self._uncommitted = False
        self._exchanged = False
        self._taken_at = 0
        self._due: str | None = None
        self.steps_committed = 0
        """Steps this group committed in this process."""
        self.batches_given_back = 0
        """Batches of steps that did not commit, read again in a later step."""
        self.model, self.optimizer = model, optimizer
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.save_every_n_steps, self.keep, self.exit_code = save_every_n_steps, keep, exit_code
        self._stop = torch.zeros(1)
        manager.register_state_dict_fn(STATE_KEY, self._load, self._state)
        if model is not None:
            manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        if optimizer is not None:
            manager.register_state_dict_fn("optimizer", optimizer.load_state_dict,
                                           optimizer.state_dict)
        if checkpoint_dir is not None:  # NOTE: without one, a signal ends the group as it would
            self.preemption.install()
        self.loaded_from: Path | None = self._resume()
        """The checkpoint this process started from (``None``: the start, or TorchFT's recovery
        alone)."""

    # --- the user's API ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the batch in hand (between steps, of the next batch)."""
        if self._uncommitted and self._before is not None:
            return int(self._before["epoch"])
        return self.loader.epoch

    def batches(self, epochs: int) -> Iterator[Any]:
        """This group's batch of each step until ``epochs`` epochs are done (counted from 0, over
        the whole job: a group that rejoins ends with the others). Each step starts TorchFT's
        quorum, shards the loader over its participants and takes this group's batch; the step
        must end with ``commit()``."""
        if self._ignores:
            self.preemption.install()
        try:
            yield from self._steps(epochs)
        finally:
            # NOTE: the last pass's workers stop here, whatever ends the loop (a break, an error):
            # never at interpreter exit, where workers that ignore SIGTERM would block it
            self._drop_pass()
            self.preemption.uninstall()

    def _steps(self, epochs: int) -> Iterator[Any]:
        while True:
            if self._uncommitted:
                raise RuntimeError(
                    "TorchFTResume: a batch was taken and its step never ended; expected "
                    "resume.commit() once per step (after the gradients, before optimizer.step)"
                )
            due, self._due = self._due, None
            if due == "stop":
                self._preempted(self.manager.current_step())
            if due == "save":
                self.save()
            self.manager.start_quorum()
            self._follow_quorum()
            batch = self._next_batch(epochs)
            if batch is _DONE:
                return
            if self._audit is not None:
                self._record_step()
            self._uncommitted = True
            yield batch

    def average_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Average each parameter's gradient over the participating groups
        (``Manager.allreduce``), and learn whether any group received a preemption signal. A peer
        that dies during the exchange makes the step fail to commit; nothing is raised here."""
        works = [self.manager.allreduce(p.grad) for p in parameters if p.grad is not None]
        works.append(self._share_stop())
        for work in works:
            work.wait()
        self._exchanged = True

    def _share_stop(self) -> Any:
        """Whether any group received a preemption signal: one more value in the step's exchange
        (a SUM over the participants)."""
        self._stop.fill_(0.0 if self.preemption.received is None else 1.0)
        return self.manager.allreduce(self._stop, reduce_op=ReduceOp.SUM)

    def commit(self) -> bool:
        """End the step: ``True`` when every participant may step its optimizer
        (``Manager.should_commit``); ``False`` gives the batch back (read again in a later step)."""
        if not self._uncommitted:
            raise RuntimeError("TorchFTResume.commit(): no batch in hand; expected one per step")
        self._uncommitted = False
        if not self._exchanged:  # NOTE: the gradients went another way (the user's own allreduce)
            self._share_stop().wait()
        self._exchanged = False
        try:
            committed = self.manager.should_commit()
        except BaseException:
            self._give_back()
            raise
        # NOTE: done before the next step, once the caller has stepped its optimizer; a group
        # whose step did not commit stops too (its state is the step before, whole)
        if self._stop.item() > 0:
            self._due = "stop"
        if self._audit is not None:
            self._audit.record({"t": "c", "step": self._taken_at, "ok": int(committed)})
            self._audit.flush()
        if committed:
            self.steps_committed += 1
            step = self.manager.current_step()
            if self.save_every_n_steps and step % self.save_every_n_steps == 0 and not self._due:
                self._due = "save"
            return True
        self._give_back()
        return False

    def _give_back(self) -> None:
        assert self._before is not None
        self.batches_given_back += 1
        logger.info("TorchFTResume: step not committed; its batch is given back (epoch %d)",
                    self._before["epoch"])
        self._drop_pass()
        self.loader.load_state_dict(self._before)

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write ``step_N`` (N: TorchFT's committed steps) on the first participant, between steps
        (``None`` elsewhere, or without ``checkpoint_dir``); ``None`` too when the write failed
        (logged; the previous checkpoints stay)."""
        if self.checkpoint_dir is None or not self._writes():
            return None
        assert self.model is not None and self.optimizer is not None
        step = self.manager.current_step()
        loader = self.loader.state_dict(pass_ended=False)
        entry = new_entry(step=step, epoch=self.loader.epoch, torchft=self.manager.state_dict(),
                          loader=loader, model=self.model.state_dict(),
                          optimizer=self.optimizer.state_dict())
        final = self.checkpoint_dir / f"step_{step:09d}"
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        written = write_sealed(final, lambda into: torch.save(entry, into / CHECKPOINT_FILE),
                               main=True, agree=lambda flag: flag, step=step, keep=self.keep)
        if written and self._audit is not None:
            self._audit.record({"t": "save", "step": step, "e": loader["epoch"],
                                "pos": loader["position"], "d": state_digest(loader)}, flush=True)
        return final if written else None

    def _writes(self) -> bool:
        first_rank = getattr(self.manager, "_group_rank", 0) == 0
        return first_rank and self.manager.participating_rank() == 0

    def _resume(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        newest = newest_usable(complete_checkpoints(self.checkpoint_dir), lambda flag: flag)
        if newest is None:
            return None
        path = newest / CHECKPOINT_FILE
        entry = checked_entry(torch.load(path, weights_only=True), path,
                              needs=("step", "torchft", "loader", "model", "optimizer"))
        assert self.model is not None and self.optimizer is not None
        self.model.load_state_dict(entry["model"])
        self.optimizer.load_state_dict(entry["optimizer"])
        self.manager.load_state_dict(entry["torchft"])
        self._pending = entry["loader"]
        if self._audit is not None:
            self._audit.record({"t": "load", "step": entry["step"], "e": entry["loader"]["epoch"],
                                "pos": entry["loader"]["position"],
                                "d": state_digest(entry["loader"])}, flush=True)
        logger.info("TorchFTResume: resumed from %s (step %d, epoch %d)", newest, entry["step"],
                    entry["epoch"])
        return newest

    def _preempted(self, step: int) -> None:
        """A group received a preemption signal: every group stops after this committed step, the
        first participant having written its checkpoint."""
        assert self.checkpoint_dir is not None
        self._drop_pass()
        if self._writes():
            written = self.save() is not None
            if not written:
                (self.checkpoint_dir / f".preemption-{step}.failed").touch()
        else:
            # NOTE: no collective: the write may take longer than the process group's timeout
            written = _wait_for_checkpoint(self.checkpoint_dir, step - 1)
        code = self.exit_code if written else WRITE_FAILED
        logger.warning("TorchFTResume: preemption signal; stopping at step %d, checkpoint %s, "
                       "exit %d", step, "written" if code == self.exit_code else "NOT written",
                       code)
        self.preemption.uninstall()
        self.manager.shutdown(wait=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # --- the quorum ----------------------------------------------------------------------------
    def _follow_quorum(self) -> None:
        rank = self.manager.participating_rank()
        world = self.manager.num_participants()
        if rank is None:
            raise RuntimeError("TorchFTResume: this group takes no part in the quorum")
        pending, self._pending = self._pending, None
        if pending is None and self._shard == (rank, world):
            return
        state = pending if pending is not None else self.loader.state_dict()
        if self._shard is not None or pending is not None:
            logger.info("TorchFTResume: participant %d of %d from epoch %d, position %s",
                        rank, world, state["epoch"], state["position"])
        self._drop_pass()
        self.loader = self._build(rank, world)
        self.loader.load_state_dict(state)

    def _next_batch(self, epochs: int) -> Any:
        """This group's batch of the step, the next epoch's first after an epoch's end; ``_DONE``
        once ``epochs`` are."""
        for _ in range(2):
            if self.loader.epoch >= epochs:
                return _DONE
            if self._pass is None:
                self._pass = iter(self.loader)
            self._before = self.loader.state_dict(pass_ended=False)
            try:
                return next(self._pass)
            except StopIteration:
                self._drop_pass()
        raise RuntimeError(f"TorchFTResume: epoch {self.loader.epoch} has no batch for this group")

    def _record_step(self) -> None:
        """The audit's record of the batch in hand: the step, its epoch, the step's global start
        and end (past the epoch's end: the padding of its last step, ``DistributedSampler``'s rule)
        and this group's place in it; written before the gradients are exchanged."""
        assert self._audit is not None and self._before is not None and self._shard is not None
        before, after = self._before, self.loader.state_dict(pass_ended=False)
        rank, world = self._shard
        start, epoch = int(before["position"]), int(before["epoch"])
        self._taken_at = self.manager.current_step()
        record = {"t": "b", "step": self._taken_at, "e": epoch, "s": start, "r": rank, "w": world,
                  "u": self._units}
        if after["epoch"] == epoch:
            record["end"] = int(after["position"])
        else:
            left = self._units - start
            padded, full = -(-left // world) * world, world * int(self.loader.batch_size or 0)
            record["end"] = start + (min(full, padded) if full else padded)
            record["l"] = 1
        self._audit.record(record)
        self._audit.flush()

    def _drop_pass(self) -> None:
        if self._pass is not None:
            shut_down_workers(self._pass)
            self._pass = None

    def _build(self, rank: int, world: int) -> ResumableDataLoader[Any]:
        self._shard = (rank, world)
        return resumable(self._source, seed=self._seed, keying="sample",
                         keyed_generators=self._generators, rank=rank, world_size=world,
                         ignore_signals=self.preemption.signals if self._ignores else ())

    # --- TorchFT's recovery ----------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        # NOTE: called by TorchFT's quorum thread while the main thread waits in start_quorum:
        # between steps, so the state after the last committed one (or the one loaded from a
        # checkpoint or a peer and not yet applied)
        if self._pending is not None:
            return self._pending
        return self.loader.state_dict(pass_ended=False)

    def _load(self, state: dict[str, Any]) -> None:
        # NOTE: applied at the next quorum, sharded over its participants
        self._pending = state


def _units(source: DataLoader[Any], loader: ResumableDataLoader[Any]) -> int:
    """The positions of an epoch: the dataset's, or those of the user's sampler."""
    state = loader.state_dict()
    if state["source"] == "permutation":
        return int(state["dataset_len"])
    try:
        return len(source.sampler)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"TorchFTResume(audit=...): the loader's sampler ({type(source.sampler).__name__}) has "
            "no length; expected one with __len__ (the audit counts an epoch's positions)"
        ) from None


def _refuse_unsupported(manager: Manager, loader: DataLoader[Any], optimizer: Any) -> None:
    """What ``TorchFTResume`` cannot keep exact, refused by name."""
    refused = []
    if getattr(manager, "_use_async_quorum", False):
        refused.append("Manager(use_async_quorum=True) starts a step before its quorum (and so its "
                       "participants) is known; expected use_async_quorum=False")
    if getattr(manager, "_group_world_size", 1) != 1:
        refused.append("a replica group of several processes (the loader is sharded over groups); "
                       "expected one process per group")
    mode = getattr(manager, "_world_size_mode", None)
    if mode is not None and getattr(mode, "name", "") == "FIXED_WITH_SPARES":
        refused.append("WorldSizeMode.FIXED_WITH_SPARES (a spare group takes no part in a step); "
                       "expected WorldSizeMode.DYNAMIC")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        refused.append("an IterableDataset has no global order to share between replica groups; "
                       "expected a map-style dataset")
    if isinstance(loader.sampler, torch.utils.data.DistributedSampler):
        refused.append(f"a loader already sharded ({type(loader.sampler).__name__}); expected "
                       "DataLoader(shuffle=...): TorchFTResume shards over the groups itself")
    if getattr(loader, "in_order", True) is False:
        refused.append("DataLoader(in_order=False): the groups must hand out one step's batches "
                       "together; expected in_order=True")
    if type(optimizer).__module__.startswith("torchft"):
        refused.append(f"torchft's {type(optimizer).__name__} starts a quorum and commits itself; "
                       "expected the plain optimizer it wraps")
    if refused:
        raise ValueError("TorchFTResume: " + "; ".join(refused))


def _wait_for_checkpoint(directory: Path, step: int) -> bool:
    """Whether a sealed checkpoint of ``step`` or later appears in ``directory`` (``False`` at once
    when the first participant marked its write failed, or after ``WAIT_SECONDS``)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        # NOTE: a step_N directory appears only sealed (renamed into place whole)
        if any(int(path.name.removeprefix("step_")) >= step
               for path in directory.glob("step_[0-9]*") if path.name[5:].isdigit()):
            return True
        if any(int(path.name[len(".preemption-"):-len(".failed")]) >= step
               for path in directory.glob(".preemption-*.failed")):
            return False
        time.sleep(0.1)
    return False
