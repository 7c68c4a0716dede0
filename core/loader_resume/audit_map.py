"""The map-style check of ``loader_resume.audit_check``: positions are global, so each attempt's batches are laid out
by epoch and global position. An attempt that loaded a state resumes where that state stands, and continues the
attempt that took it: the batches that count are the last attempt's, then, back along the states each attempt
loaded, each earlier one's from where it resumed up to where the next one resumed. What an attempt delivered past the
state its successor loaded was rolled back with the model (counted, not an error). The first batch after a load must
start where the state said. Then each epoch must hold every position exactly once; the documented exceptions: the
padding of the last step (``DistributedSampler``'s rule: positions past the end), what ``drop_last`` leaves out (a
tail shorter than one step), an epoch the loop itself left (it began the next pass, or said ``pass_ended=True``),
and the job's last epoch, which may stop part-way.
"""

from __future__ import annotations

from typing import Any

from .audit_check import Finding, LoaderReport, resumed_from
from .audit_read import Attempt

__all__ = ["MapCheck"]


class _Own:
    """One attempt's own deliveries (map-style): position -> (rank, its step's start); step start -> end."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], tuple[int, int]] = {}
        self.steps: dict[tuple[int, int], int] = {}


class MapCheck:
    """Each attempt's own deliveries, then the batches that count: the last attempt's, and back along the states
    each attempt loaded, each earlier one's from where it resumed up to where the next one resumed."""

    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        self.units: dict[int, int | None] = {}
        self.last_end: dict[int, int] = {}  # epoch -> the end of its last step (delivered, flagged)
        self.padding: dict[int, int] = {}
        self.step_size: dict[int, int] = {}  # epoch -> units of its largest step
        self.known_from: dict[int, int] = {}  # epoch -> first position this audit saw (a job resumed from elsewhere)
        self.left: dict[int, str] = {}  # epoch -> how the loop left it before its end (on purpose)
        self.latest = -1  # the latest epoch a batch, a pass or a state reached

    def run(self, attempts: list[Attempt]) -> None:
        owns: list[_Own] = []
        starts: list[tuple[int, int] | None] = []  # where each attempt resumed (None: afresh)
        parents: list[int | None] = []
        taken: dict[str, tuple[int, dict[str, Any]]] = {}  # state digest -> (attempt index, its record)
        for index, attempt in enumerate(attempts):
            load = resumed_from(self.report, attempt, attempts[:index])
            where = None if load is None else (load["e"], load["pos"])
            # NOTE: a state no attempt took (named by resumed_from) continues the attempt before, as its position says
            parent = taken[load["d"]][0] if load is not None and load["d"] in taken else index - 1 if index else None
            if load is not None and load["d"] in taken and taken[load["d"]][1].get("x"):
                self.left.setdefault(load["e"] - 1, "the loop left it (pass_ended=True)")
            if where is not None and index == 0:
                self.known_from[where[0]] = where[1]
            own, batches = self._read(attempt, taken, index)
            if where is not None:
                self._check_landing(attempt, where)
            rolled = 0 if parent is None or where is None else sum(1 for key in owns[parent].steps if key >= where)
            if load is None and index:
                rolled = sum(len(other.steps) for other in owns)
            owns.append(own)
            starts.append(where)
            parents.append(parent)
            self.report.attempts.append({"number": attempt.number, "world": attempt.world, "batches": batches,
                                         "resumed": "(fresh)" if where is None else f"epoch {where[0]} position "
                                         f"{where[1]}", "rolled_back": rolled})
        counted: dict[tuple[int, int], tuple[int, int, int]] = {}
        steps: dict[tuple[int, int], int] = {}
        cursor: int | None = len(attempts) - 1  # NOTE: back along the loads, from the last attempt
        until: tuple[int, int] | None = None
        while cursor is not None:
            begin = starts[cursor] or (-1, 0)
            for key, (rank, start) in owns[cursor].seen.items():
                if (key[0], start) >= begin and (until is None or (key[0], start) < until):
                    counted[key] = (attempts[cursor].number, rank, start)
            steps.update({key: end for key, end in owns[cursor].steps.items()
                          if key >= begin and (until is None or key < until)})
            until, cursor = starts[cursor], parents[cursor] if starts[cursor] is not None else None
        self._epochs(counted, steps)

    def _read(self, attempt: Attempt, taken: dict[str, tuple[int, dict[str, Any]]], index: int) -> tuple[_Own, int]:
        own, batches = _Own(), 0
        for log in attempt.logs:
            epoch_of_pass = None
            for record in log.records:
                kind = record["t"]
                if kind == "pass":
                    self.units[record["e"]] = record["units"]
                    if epoch_of_pass is not None and record["e"] > epoch_of_pass:  # a new pass left the one before
                        self.left.setdefault(epoch_of_pass, "the loop began the next pass before its end")
                    epoch_of_pass = record["e"]
                    self.latest = max(self.latest, record["e"])
                elif kind == "b":
                    batches += 1
                    self._add(own, attempt.number, log.rank, log.world, record)
                elif kind == "state":
                    taken[record["d"]] = (index, record)
                    self.latest = max(self.latest, record["e"] if record.get("e") is not None else -1)
                elif kind == "load":
                    self.latest = max(self.latest, record["e"] if record.get("e") is not None else -1)
        return own, batches

    def _check_landing(self, attempt: Attempt, where: tuple[int, int]) -> None:
        for log in attempt.logs:
            first = next((record for record in log.records if record["t"] == "b"), None)
            if first is None:
                continue
            got = (first["e"], first["s"])
            at_end = got == (where[0] + 1, 0) and where[1] in (self.units.get(where[0]), self.last_end.get(where[0]))
            if got != where and not at_end:
                self.report.findings.append(Finding(
                    attempt.number, got[0], got[1], f"resumed from epoch {where[0]} position {where[1]}, but its first "
                    f"batch starts at epoch {got[0]} position {got[1]}", log.rank))

    def _add(self, own: _Own, attempt: int, rank: int, world: int, record: dict[str, Any]) -> None:
        epoch, start, end = record["e"], record["s"], record["end"]
        units = -(-(end - start) // world)  # a full step's batch, or the tail's share (loader_resume.sampler)
        own.steps[(epoch, start)] = end
        self.step_size[epoch] = max(self.step_size.get(epoch, 0), units * world)
        self.latest = max(self.latest, epoch)
        if record.get("l"):
            self.last_end[epoch] = end
        total = self.units.get(epoch)
        limit = total if total is not None else end if record.get("l") else None
        first = start + rank * units
        for position in range(first, first + units):
            if limit is not None and position >= limit:
                self.padding[epoch] = self.padding.get(epoch, 0) + 1
                continue
            previous = own.seen.get((epoch, position))
            if previous is not None:
                self.report.findings.append(Finding(
                    attempt, epoch, position, f"delivered twice in one attempt (ranks {previous[0]} and {rank}), with "
                    "no resume between", rank))
                continue
            own.seen[(epoch, position)] = (rank, start)

    def _epochs(self, counted: dict[tuple[int, int], tuple[int, int, int]], steps: dict[tuple[int, int], int]) -> None:
        header = self.report.header
        for epoch in sorted({epoch for epoch, _ in counted} | set(self.padding)):
            positions = sorted(position for e, position in counted if e == epoch)
            total = self.units.get(epoch)
            end = total if total is not None else self.last_end.get(epoch)
            reached = end is not None
            end = end if end is not None else (positions[-1] + 1 if positions else 0)
            begin = self.known_from.get(epoch, 0)
            missing = [p for p in range(begin, end) if (epoch, p) not in counted]
            if not reached and epoch < self.latest and epoch not in self.left:
                missing = missing or [end]
            dropped, status = 0, "ok"
            if missing:
                suffix = missing == list(range(missing[0], max(end, missing[0] + 1)))
                if suffix and epoch == self.latest and epoch not in self.left:
                    status = f"partial: the job stopped at position {missing[0]}"
                elif suffix and epoch in self.left:
                    status = f"left at position {missing[0]}: {self.left[epoch]}"
                elif suffix and header["drop_last"] and len(missing) < self.step_size.get(epoch, 0):
                    dropped = len(missing)
                else:
                    step = sum(1 for e, start in steps if e == epoch and start < missing[0])
                    status = f"position {missing[0]} never delivered ({len(missing)} missing)"
                    self.report.findings.append(Finding(0, epoch, missing[0], f"never delivered: {len(missing)} "
                                                        f"samples from step {step} of the epoch on"))
            if begin:
                status += f" (from position {begin}: earlier ones ran before this audit)"
            self.report.epochs.append({"epoch": epoch, "delivered": len(positions), "dropped": dropped,
                                       "padding": self.padding.get(epoch, 0), "status": status})
