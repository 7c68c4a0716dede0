"""The check of a job whose membership changes while it runs (``kind: "quorum"``: TorchFT's replica
groups, ``torchft_resume``): each group process's log records, per step it took part in, the step
number, its epoch, the step's global start and end, and its own rank and count of participants at
that step (``b``), then whether the step committed (``c``); the checkpoints it saved and the one it
loaded at its start (``save``, ``load``, with the loader state's digest).

A step counts when any of its participants recorded it committed (TorchFT commits a step on every
participant or on none; a participant that died after its gradients were exchanged has no outcome
of its own). A *life* of the job is the processes between two restarts of the whole job: TorchFT's
step only grows while any group keeps the job's state (a group that rejoins takes it from a peer),
so a process whose first step is one the job had already committed (read by the records' write
times) began a new life: the job's state was lost, and it started again from a checkpoint (its
first step is that checkpoint's) or afresh. The steps earlier lives committed from there on were
rolled back with the model (counted, not an error). Each epoch must then hold every position
exactly once across the steps that count, its positions numbered up to its units (the dataset's
length, or the sampler's: each step's record says); the documented exceptions are those of
``loader_resume.audit.map`` (the padding of an epoch's last step, what ``drop_last`` leaves out of
its last step, the job's last epoch stopping part-way). A step that counts and lacks a participant's
record is a gap: what that participant trained is not known.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from loader_resume.audit.read import Attempt, RankLog
from loader_resume.audit.report import Finding, LoaderReport

__all__ = ["QuorumCheck"]

Step = tuple[int, int, int, int, int]
"""(step number, epoch, global start, global end, participants): one step as its participants saw
it."""


@dataclasses.dataclass
class _Life:
    number: int
    logs: list[RankLog]
    first: dict[str, Any]
    """Its first step's record: where the job stood when this life began."""

    @property
    def load(self) -> dict[str, Any] | None:
        """The checkpoint of its first step that one of its processes loaded, if any."""
        return next((record for log in self.logs for record in log.records
                     if record["t"] == "load" and record["step"] == self.first["step"]), None)


def _timed(log: RankLog) -> list[tuple[float, dict[str, Any]]]:
    """Each record with the time it was written (the time mark of the write that carried it)."""
    timed: list[tuple[float, dict[str, Any]]] = []
    pending: list[dict[str, Any]] = []
    for record in log.records:
        if record["t"] == "at":
            timed.extend((float(record["time"]), waiting) for waiting in pending)
            pending = []
        else:
            pending.append(record)
    return timed + [(log.end, waiting) for waiting in pending]


class QuorumCheck:
    """Lives, the steps that count, then every epoch's positions."""

    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        # the furthest (epoch, position) a life resumed from with a checkpoint no process in the
        # logs saved: what is missing before it was trained in no log (a gap, not a finding)
        self.unlogged_until = (-1, 0)

    def run(self, attempts: list[Attempt]) -> None:
        logs = sorted((log for attempt in attempts for log in attempt.logs),
                      key=lambda log: log.start)
        lives = self._lives(logs)
        # NOTE: an epoch's positions are numbered up to its units: the dataset's length, or a
        # sampler's (each step's record carries them)
        self.units = {record["e"]: int(record.get("u", self.report.header["n"]))
                      for log in logs for record in log.records if record["t"] == "b"}
        saved: dict[str, dict[str, Any]] = {}
        counted: dict[Step, dict[int, int]] = {}  # step -> participant rank -> life
        for life in lives:
            committed, taken = self._steps(life)
            rolled = 0
            if life.number > 1:
                rolled = self._roll_back(life, counted, saved)
            elif life.first["step"] > 0:
                self._unsaved(life, "the logs of the job before it are missing, or it ran before "
                              "its audit was turned on")
            for step, ranks in taken.items():
                if step in committed:
                    for rank in ranks:
                        counted.setdefault(step, {}).setdefault(rank, life.number)
            for log in life.logs:
                saved.update({record["d"]: record for record in log.records
                              if record["t"] == "save"})
            first = life.first
            self.report.attempts.append({
                "number": life.number,
                "world": max([step[4] for step in committed] or [0]),
                "batches": sum(record["t"] == "b" for log in life.logs for record in log.records),
                "resumed": "(fresh)" if first["step"] == 0
                else f"epoch {first['e']} position {first['s']}",
                "rolled_back": rolled,
                "rolled_back_exact": True,
            })
        self._epochs(counted, lives)

    def _lives(self, logs: list[RankLog]) -> list[_Life]:
        """In the order of their first steps: a process whose first step the life running had
        already committed (before that step was written), or that took it after every process of
        that life had ended (a job stopped at a checkpoint and started again), begins a new life;
        any other joins the life running (a group rejoining through TorchFT's recovery, whether or
        not it loaded a checkpoint first). A process that took no step is in no life."""
        starts = []
        for log in logs:
            timed = _timed(log)
            found = next(((time, record) for time, record in timed if record["t"] == "b"), None)
            if found is not None:
                starts.append((found[0], found[1], log, timed))
        lives: list[_Life] = []
        # the current life's commits: (time written, step)
        commits: list[tuple[float, int]] = []
        for time, first, log, timed in sorted(starts, key=lambda start: start[0]):
            if (not lives or any(step >= first["step"] for when, step in commits if when < time)
                    or all(other.end < time for other in lives[-1].logs)):
                lives.append(_Life(len(lives) + 1, [log], first))
                commits = []
            else:
                lives[-1].logs.append(log)
            step = None
            for when, record in timed:
                if record["t"] == "b":
                    step = record["step"]
                elif record["t"] == "c" and record.get("ok") and step is not None:
                    commits.append((when, step))
        return lives

    def _steps(self, life: _Life) -> tuple[set[Step], dict[Step, set[int]]]:
        """The steps any participant recorded committed, and each step's participants' ranks."""
        committed: set[Step] = set()
        taken: dict[Step, set[int]] = {}
        for log in life.logs:
            step: Step | None = None
            for record in log.records:
                if record["t"] == "b":
                    step = (record["step"], record["e"], record["s"], record["end"], record["w"])
                    taken.setdefault(step, set()).add(record["r"])
                elif record["t"] == "c" and step is not None:
                    if record.get("ok"):
                        committed.add(step)
                    step = None
        return committed, taken

    def _roll_back(self, life: _Life, counted: dict[Step, dict[int, int]],
                   saved: dict[str, dict[str, Any]]) -> int:
        """Drop what earlier lives committed past the checkpoint this life loaded; the number of
        steps dropped."""
        began = life.first["step"]
        if began == 0 and saved:  # NOTE: a silent restart: checkpoints existed, none was loaded
            self.report.findings.append(Finding(
                life.number, 0, 0, "started afresh although earlier groups saved checkpoints "
                f"(the newest at step {max(record['step'] for record in saved.values())}): "
                "its checkpoint was not found", None))
        elif began > 0 and (life.load is None or life.load["d"] not in saved):
            self._unsaved(life, "the logs of the lives before it are missing, or the "
                          "checkpoint is another run's")
        # NOTE: a checkpoint of step K holds the steps taken at 0 .. K - 1 (TorchFT counts a step
        # when it commits); what the lives before took from K on was rolled back
        past = {step for step in counted if step[0] >= began}
        for step in past:
            del counted[step]
        return len(past)

    def _unsaved(self, life: _Life, why: str) -> None:
        first = life.first
        self.report.gaps.append(Finding(
            life.number, first["e"], first["s"],
            f"resumed from step {first['step']}, a checkpoint no group in these logs saved ({why})",
            None))
        self.unlogged_until = max(self.unlogged_until, (first["e"], first["s"]))

    def _epochs(self, counted: dict[Step, dict[int, int]], lives: list[_Life]) -> None:
        header = self.report.header
        seen: dict[tuple[int, int], tuple[int, int]] = {}  # (epoch, position) -> (life, step)
        padding: dict[int, int] = {}
        last_step: dict[int, tuple[int, int]] = {}  # epoch -> (start, size) of its last step
        # (life, epoch, the earlier step, the step) -> [first position, count]
        twice: dict[tuple[int, int, int, int], list[int]] = {}
        unknown: set[tuple[int, int]] = set()  # positions of participants with no record
        for step in sorted(counted):
            number, epoch, start, end, world = step
            units, n = -(-(end - start) // world), self.units.get(epoch, int(header["n"]))
            last_step[epoch] = max(last_step.get(epoch, (-1, 0)), (start, units * world))
            for rank in sorted(set(range(world)) - set(counted[step])):
                first = start + rank * units
                unknown.update((epoch, p) for p in range(first, min(first + units, n)))
                self.report.gaps.append(Finding(
                    next(iter(counted[step].values())), epoch, first,
                    f"step {number} counts, but participant {rank} of {world} has no record of it: "
                    "what it trained is not known (its log deleted, or cut by a kill)", rank))
            for rank, life in counted[step].items():
                first = start + rank * units
                share = range(first, max(first, min(first + units, n)))
                padding[epoch] = padding.get(epoch, 0) + units - len(share)
                for position in share:
                    if (epoch, position) in seen:
                        key = (life, epoch, seen[(epoch, position)][1], number)
                        twice.setdefault(key, [position, 0])[1] += 1
                    seen[(epoch, position)] = (life, number)
        for (life, epoch, earlier, number), (position, count) in twice.items():
            self.report.findings.append(Finding(
                life, epoch, position, f"delivered twice: {count} sample{'s' * (count > 1)} of "
                f"step {earlier} again in step {number}", None, count))
        latest = max([epoch for epoch, _ in seen] or [0])
        for epoch in range(latest + 1):
            n = self.units.get(epoch, int(header["n"]))
            missing = [p for p in range(n) if (epoch, p) not in seen and (epoch, p) not in unknown
                       and (epoch, p) >= self.unlogged_until]
            dropped, status = 0, "ok"
            suffix = bool(missing) and missing == list(range(missing[0], n))
            last_start, last_size = last_step.get(epoch, (0, 0))
            # NOTE: drop_last leaves out a tail shorter than the step it would have been
            if (missing and suffix and header.get("drop_last")
                    and missing[0] == last_start + last_size and len(missing) < last_size):
                dropped = len(missing)
            elif missing and suffix and epoch == latest:
                status = f"partial: the job stopped at position {missing[0]}"
            elif missing:
                status = f"position {missing[0]} never delivered ({len(missing)} missing)"
                self.report.findings.append(Finding(
                    lives[-1].number, epoch, missing[0],
                    f"never delivered: {len(missing)} samples", None, len(missing)))
            if (epoch, 0) < self.unlogged_until:
                status += (" (from position "
                           f"{self.unlogged_until[1] if epoch == self.unlogged_until[0] else n}: "
                           "earlier ones are in no log)")
            self.report.epochs.append({
                "epoch": epoch, "delivered": sum(1 for e, _ in seen if e == epoch),
                "dropped": dropped,
                "dropped_from": missing[0] if dropped else None, "padding": padding.get(epoch, 0),
                "status": status,
            })
