"""Checking a job's audit logs (``loader_resume.audit_read``): was every sample seen exactly once across restarts?

Map-style data (positions are global): each attempt's batches are laid out by epoch and global position. An attempt
that loaded a state resumes where that state stands; the batches an earlier attempt delivered from there on were
rolled back with the model (counted, not errors). The loaded state must be one an earlier attempt took (its digest
is recorded), and the attempt's first batch must start where the state said. Then each epoch must hold every
position exactly once: the documented exceptions are the padding of the last step (``DistributedSampler``'s rule:
positions past the end, counted), the samples ``drop_last`` leaves out (a tail shorter than one step), and the last
epoch of the job, which may stop part-way. With our own permutation the ids at distinct positions must be distinct.

Streams (each rank's workers own their part): each worker's batches of an epoch must be numbered 1, 2, ... without
a gap or a repeat after the cuts, and an attempt must continue each worker where its loaded state said.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .audit_read import Attempt, first_load, read_audit

SAME = ("kind", "n", "order", "seed", "keying")
"""What every attempt's loader must share: what decides its order and its random keys (the batch size, the world
size and the workers may change)."""

__all__ = ["Finding", "LoaderReport", "audit_directory", "check_loader"]


@dataclass(frozen=True)
class Finding:
    """One thing that does not hold, where it was found."""

    attempt: int
    epoch: int | None
    position: int | None
    """The global position (map-style) or the worker's batch number (streams)."""
    message: str
    rank: int | None = None


@dataclass
class LoaderReport:
    """One loader's attempts and epochs, and what does not hold."""

    name: str
    header: dict[str, Any]
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Per attempt: ``number``, ``world``, ``batches``, ``resumed`` (text), ``rolled_back``."""
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """Per epoch: ``epoch``, ``delivered``, ``padding``, ``dropped``, ``status``."""
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings


def audit_directory(directory: str | os.PathLike[str]) -> list[LoaderReport]:
    """Every loader's report from the logs under ``directory``; ``AuditFormatError`` if they cannot be read."""
    return [check_loader(name, attempts) for name, attempts in read_audit(directory).items()]


def check_loader(name: str, attempts: list[Attempt]) -> LoaderReport:
    """The report of one loader's attempts."""
    header = attempts[0].logs[0].header
    report = LoaderReport(name, header)
    for attempt in attempts:
        for log in attempt.logs:
            if log.torn is not None:
                report.notes.append(f"{log.path}: its last line was cut short (a kill while writing): ignored")
    for attempt in attempts:
        for log in attempt.logs:
            changed = [f"{key} {log.header.get(key)!r} (attempt 1: {header.get(key)!r})" for key in SAME
                       if log.header.get(key) != header.get(key)]
            if changed:
                report.findings.append(Finding(attempt.number, None, None, f"ran with {', '.join(changed)}: "
                                               "the order and the random keys are not the same", log.rank))
    if report.findings:
        return report
    if header["kind"] == "map":
        _MapCheck(report).run(attempts)
    else:
        _StreamCheck(report).run(attempts)
    return report


def _states(attempts: list[Attempt]) -> dict[str, int]:
    """Digest of each state taken -> the attempt that took it (the latest)."""
    return {record["d"]: attempt.number for attempt in attempts for log in attempt.logs for record in log.records
            if record["t"] == "state"}


def _resume(report: LoaderReport, attempt: Attempt, earlier: list[Attempt]) -> dict[str, Any] | None:
    """The state ``attempt`` resumed from (checked to be one an earlier attempt took), or None: it began afresh."""
    loads = [first_load(log) for log in attempt.logs]
    if all(load is None for load in loads):
        if _states(earlier):
            report.findings.append(Finding(attempt.number, None, None, "started from the beginning, though earlier "
                                           "attempts took states: no state was loaded before its first batch"))
        return None
    missing = [log.rank for log, load in zip(attempt.logs, loads, strict=True) if load is None]
    if missing:
        report.findings.append(Finding(attempt.number, None, None, f"ranks {missing} loaded no state, the others did"))
    load = next(load for load in loads if load is not None)
    if earlier and "resharded" not in load and load["d"] not in _states(earlier):
        report.findings.append(Finding(attempt.number, load.get("e"), load.get("pos"), "loaded a state that no earlier "
                                       "attempt took (another run's checkpoint, or an edited state)"))
    return load


class _MapCheck:
    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        self.seen: dict[tuple[int, int], tuple[int, int, int]] = {}  # (epoch, position) -> attempt, rank, step start
        self.steps: dict[tuple[int, int], int] = {}  # (epoch, step start) -> the step's end
        self.units: dict[int, int | None] = {}
        self.padding: dict[int, int] = {}
        self.step_size: dict[int, int] = {}  # epoch -> units of its last full step
        self.known_from: dict[int, int] = {}  # epoch -> first position this audit saw (a job resumed from elsewhere)

    def run(self, attempts: list[Attempt]) -> None:
        header = self.report.header
        for index, attempt in enumerate(attempts):
            load = _resume(self.report, attempt, attempts[:index])
            rolled = 0
            resumed = "(fresh)"
            if load is not None:
                where = (load["e"], load["pos"])
                resumed = f"epoch {where[0]} position {where[1]}"
                rolled = self._cut(where)
                if index == 0:
                    self.known_from[where[0]] = where[1]
                self._check_landing(attempt, where)
            elif index:
                rolled = self._cut((-1, 0))
            batches = 0
            for log in attempt.logs:
                for record in log.records:
                    if record["t"] == "pass":
                        self.units[record["e"]] = record["units"]
                    elif record["t"] == "b":
                        batches += 1
                        self._add(attempt.number, log.rank, log.world, record)
            self.report.attempts.append({"number": attempt.number, "world": attempt.world, "batches": batches,
                                         "resumed": resumed, "rolled_back": rolled})
        self._epochs(header)

    def _cut(self, where: tuple[int, int]) -> int:
        """Forget what was delivered from ``where`` on (rolled back with the model); the steps forgotten."""
        gone = [key for key in self.steps if key >= where]
        for key in gone:
            del self.steps[key]
        for key in [key for key, seen in self.seen.items() if (key[0], seen[2]) >= where]:
            del self.seen[key]
        return len(gone)

    def _check_landing(self, attempt: Attempt, where: tuple[int, int]) -> None:
        for log in attempt.logs:
            first = next((record for record in log.records if record["t"] == "b"), None)
            if first is None:
                continue
            got = (first["e"], first["s"])
            at_end = got == (where[0] + 1, 0) and where[1] == self.units.get(where[0])
            if got != where and not at_end:
                self.report.findings.append(Finding(
                    attempt.number, got[0], got[1], f"resumed from epoch {where[0]} position {where[1]}, but its first "
                    f"batch starts at epoch {got[0]} position {got[1]}", log.rank))

    def _add(self, attempt: int, rank: int, world: int, record: dict[str, Any]) -> None:
        epoch, start, end = record["e"], record["s"], record["end"]
        units = -(-(end - start) // world)  # a full step's batch, or the tail's share (loader_resume.sampler)
        self.steps[(epoch, start)] = end
        self.step_size[epoch] = max(self.step_size.get(epoch, 0), units * world)
        first = start + rank * units
        total = self.units.get(epoch)
        for position in range(first, first + units):
            if total is not None and position >= total:
                self.padding[epoch] = self.padding.get(epoch, 0) + 1
                continue
            previous = self.seen.get((epoch, position))
            if previous is not None:
                self.report.findings.append(Finding(
                    attempt, epoch, position, f"delivered again (first by attempt {previous[0]} rank {previous[1]}), "
                    "with no resume between", rank))
                continue
            self.seen[(epoch, position)] = (attempt, rank, start)

    def _epochs(self, header: dict[str, Any]) -> None:
        epochs = sorted({epoch for epoch, _ in self.seen} | set(self.padding))
        last = epochs[-1] if epochs else None
        for epoch in epochs:
            positions = sorted(position for e, position in self.seen if e == epoch)
            total = self.units.get(epoch)
            begin = self.known_from.get(epoch, 0)
            end = total if total is not None else positions[-1] + 1
            missing = [p for p in range(begin, end) if (epoch, p) not in self.seen]
            dropped, status = 0, "ok"
            if missing:
                suffix = missing == list(range(missing[0], end))
                if suffix and epoch == last:
                    status = f"partial: the job stopped at position {missing[0]} of {end}"
                elif suffix and header["drop_last"] and len(missing) < self.step_size.get(epoch, 0):
                    dropped = len(missing)
                else:
                    step = sum(1 for e, start in self.steps if e == epoch and start < missing[0])
                    status = f"position {missing[0]} never delivered ({len(missing)} missing)"
                    self.report.findings.append(Finding(0, epoch, missing[0], f"never delivered: {len(missing)} "
                                                        f"samples from step {step} of the epoch on"))
            if begin:
                status += f" (from position {begin}: earlier ones ran before this audit)"
            self.report.epochs.append({"epoch": epoch, "delivered": len(positions), "dropped": dropped,
                                       "padding": self.padding.get(epoch, 0), "status": status})


class _StreamCheck:
    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        self.seen: dict[tuple[int, int, int], set[int]] = {}  # (epoch, rank, worker) -> batch numbers

    def run(self, attempts: list[Attempt]) -> None:
        for index, attempt in enumerate(attempts):
            load = _resume(self.report, attempt, attempts[:index])
            if load is not None and "resharded" in load:
                self.report.findings.append(Finding(attempt.number, load.get("e"), None, "resumed a stream at another "
                                                    "world size: the audit cannot follow a reshard (not checked)"))
                return
            rolled, batches = 0, 0
            for log in attempt.logs:
                loaded = first_load(log)
                if loaded is not None or index:
                    rolled += self._cut(log.rank, loaded)
                for record in log.records:
                    if record["t"] == "b":
                        batches += 1
                        self._add(attempt.number, log.rank, record, loaded)
                        loaded = None
            resumed = "(fresh)" if load is None else f"epoch {load['e']}, workers at batches {load.get('wb')}"
            self.report.attempts.append({"number": attempt.number, "world": attempt.world, "batches": batches,
                                         "resumed": resumed, "rolled_back": rolled})
        for (epoch, rank, worker), numbers in sorted(self.seen.items()):
            gaps = sorted(set(range(1, max(numbers) + 1)) - numbers)
            status = "ok" if not gaps else f"batch {gaps[0]} never delivered"
            if gaps:
                self.report.findings.append(Finding(0, epoch, gaps[0], f"worker {worker}: batch {gaps[0]} never "
                                                    "delivered", rank))
            self.report.epochs.append({"epoch": epoch, "rank": rank, "worker": worker, "delivered": len(numbers),
                                       "padding": 0, "dropped": 0, "status": status})

    def _cut(self, rank: int, load: dict[str, Any] | None) -> int:
        gone = 0
        for (epoch, owner, worker), numbers in self.seen.items():
            if owner != rank:
                continue
            keep = 0 if load is None or epoch > load["e"] else None if epoch < load["e"] else load["wb"][worker]
            if keep is None:
                continue
            cut = {n for n in numbers if n > keep}
            gone += len(cut)
            numbers -= cut
        return gone

    def _add(self, attempt: int, rank: int, record: dict[str, Any], loaded: dict[str, Any] | None) -> None:
        key = (record["e"], rank, record["w"])
        numbers = self.seen.setdefault(key, set())
        if record["b"] in numbers:
            self.report.findings.append(Finding(attempt, record["e"], record["b"], f"worker {record['w']}: batch "
                                                f"{record['b']} delivered again, with no resume between", rank))
        numbers.add(record["b"])
