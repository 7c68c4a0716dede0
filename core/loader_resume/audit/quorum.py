"""The check of a job whose membership changes while it runs (``kind: "quorum"``: TorchFT's replica
groups, ``torchft_resume``): each group process's log records, per step it took part in, the step
number, its epoch, the step's global start and end, and its own rank and count of participants at
that step (``b``), then whether the step committed (``c``); the checkpoints it saved and the one it
loaded at its start (``save``, ``load``, with the loader state's digest).

A step counts when any of its participants recorded it committed (TorchFT commits a step on every
participant or on none; a participant that died after its gradients were exchanged has no outcome
of its own). A *life* of the job is the processes between two restarts of the whole job: a process
that loaded a checkpoint after every earlier process had ended starts one, and the steps earlier
lives committed past that checkpoint's step were rolled back with the model (counted, not an
error). Each epoch must then hold every position exactly once across the steps that count; the
documented exceptions are those of ``loader_resume.audit.map`` (the padding of an epoch's last step,
what ``drop_last`` leaves out, the job's last epoch stopping part-way). A step that counts and lacks
a participant's record is a gap: what that participant trained is not known.
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
    load: dict[str, Any] | None


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
        saved: dict[str, dict[str, Any]] = {}
        counted: dict[Step, dict[int, int]] = {}  # step -> participant rank -> life
        for life in lives:
            committed, taken = self._steps(life)
            rolled = 0
            if life.number > 1:
                rolled = self._roll_back(life, counted, saved)
            elif life.load is not None:
                self._unsaved(life, life.load, "the logs of the job before it are missing, or it "
                              "ran before its audit was turned on")
            for step, ranks in taken.items():
                if step in committed:
                    for rank in ranks:
                        counted.setdefault(step, {}).setdefault(rank, life.number)
            for log in life.logs:
                saved.update({record["d"]: record for record in log.records
                              if record["t"] == "save"})
            load = life.load
            self.report.attempts.append({
                "number": life.number,
                "world": max([step[4] for step in committed] or [0]),
                "batches": sum(record["t"] == "b" for log in life.logs for record in log.records),
                "resumed": "(fresh)" if load is None
                else f"epoch {load['e']} position {load['pos']}",
                "rolled_back": rolled,
                "rolled_back_exact": True,
            })
        self._epochs(counted, lives)

    def _lives(self, logs: list[RankLog]) -> list[_Life]:
        """A process that started after every earlier one ended starts a life (the whole job
        started again); any other joins the life running (a group rejoining through TorchFT's
        recovery, whether or not it loaded a checkpoint first)."""
        lives: list[_Life] = []
        for log in logs:
            load = next((record for record in log.records if record["t"] == "load"), None)
            if lives and any(other.end > log.start for life in lives for other in life.logs):
                lives[-1].logs.append(log)
            else:
                lives.append(_Life(len(lives) + 1, [log], load))
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
        load = life.load
        if load is None:
            if saved:  # NOTE: a silent restart: checkpoints existed, none was loaded
                self.report.findings.append(Finding(
                    life.number, 0, 0, "started afresh although earlier groups saved checkpoints "
                    f"(the newest at step {max(record['step'] for record in saved.values())}): "
                    "its checkpoint was not found", None))
            past = set(counted)
        else:
            if load["d"] not in saved:
                self._unsaved(life, load, "the logs of the lives before it are missing, or the "
                              "checkpoint is another run's")
            # NOTE: a checkpoint of step K holds the steps taken at 0 .. K - 1 (TorchFT counts a
            # step when it commits)
            past = {step for step in counted if step[0] >= load["step"]}
        for step in past:
            del counted[step]
        return len(past)

    def _unsaved(self, life: _Life, load: dict[str, Any], why: str) -> None:
        self.report.gaps.append(Finding(
            life.number, load["e"], load["pos"],
            f"resumed from step {load['step']}, a checkpoint no group in these logs saved ({why})",
            None))
        self.unlogged_until = max(self.unlogged_until, (load["e"], load["pos"]))

    def _epochs(self, counted: dict[Step, dict[int, int]], lives: list[_Life]) -> None:
        header = self.report.header
        n, step_size = int(header["n"]), int(header["batch_size"])
        seen: dict[tuple[int, int], tuple[int, int]] = {}  # (epoch, position) -> (life, step)
        padding: dict[int, int] = {}
        largest: dict[int, int] = {}
        # (life, epoch, the earlier step, the step) -> [first position, count]
        twice: dict[tuple[int, int, int, int], list[int]] = {}
        unknown: set[tuple[int, int]] = set()  # positions of participants with no record
        for step in sorted(counted):
            number, epoch, start, end, world = step
            units = -(-(end - start) // world)
            largest[epoch] = max(largest.get(epoch, 0), units * world)
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
            missing = [p for p in range(n) if (epoch, p) not in seen and (epoch, p) not in unknown
                       and (epoch, p) >= self.unlogged_until]
            dropped, status = 0, "ok"
            suffix = bool(missing) and missing == list(range(missing[0], n))
            if missing and suffix and header.get("drop_last") and (
                    len(missing) < largest.get(epoch, step_size)):
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
