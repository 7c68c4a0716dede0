"""Checking a job's audit logs (``loader_resume.audit_read``): was every sample seen exactly once across restarts?

Every attempt must share its loader's identity (``SAME``); an attempt that loaded a state must have loaded one an
earlier attempt took (its digest is recorded), and one that loaded none after states were taken is named. Map-style
data: ``loader_resume.audit_map``.

Streams (each rank's workers own their part): each worker's batches of an epoch must be numbered 1, 2, ... without
a gap or a repeat after the cuts, and an attempt must continue each worker where its loaded state said.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .audit_read import Attempt, RankLog, first_load, read_audit

SAME = ("kind", "n", "order", "seed", "keying")
"""What every attempt's loader must share: what decides its order and its random keys (the batch size, the world
size and the workers may change)."""

__all__ = ["Finding", "LoaderReport", "audit_directory", "check_loader", "resumed_from", "states_taken"]


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
            lost = sum(record["records"] for record in log.records if record["t"] == "lost")
            if lost:
                report.findings.append(Finding(attempt.number, None, None, f"{log.path}: {lost} records were dropped "
                                               "after failed writes (a full disk?): what was delivered is not known",
                                               log.rank))
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
        from .audit_map import MapCheck  # NOTE: it builds on this module's Finding and resumed_from

        MapCheck(report).run(attempts)
    else:
        _StreamCheck(report).run(attempts)
    return report


def states_taken(attempts: list[Attempt]) -> dict[str, int]:
    """Digest of each state taken -> the attempt that took it (the latest)."""
    return {record["d"]: attempt.number for attempt in attempts for log in attempt.logs for record in log.records
            if record["t"] == "state"}


def _saved(log: RankLog) -> bool:
    """Whether ``log``'s attempt went on delivering after a state it took (so its save, which comes first, was done)."""
    state_before = False
    for record in log.records:
        if record["t"] == "b" and state_before:
            return True
        state_before = state_before or record["t"] == "state"
    return False


def resumed_from(report: LoaderReport, attempt: Attempt, earlier: list[Attempt]) -> dict[str, Any] | None:
    """The state ``attempt`` resumed from (checked to be one an earlier attempt took), or None: it began afresh."""
    loads = [first_load(log) for log in attempt.logs]
    if all(load is None for load in loads):
        if any(_saved(log) for other in earlier for log in other.logs):
            report.findings.append(Finding(attempt.number, None, None, "started from the beginning, though earlier "
                                           "attempts took states: no state was loaded before its first batch"))
        elif states_taken(earlier):
            report.notes.append(f"attempt {attempt.number} started from the beginning: the only states taken before "
                                "were each their attempt's last record (killed while saving: no checkpoint, maybe)")
        return None
    missing = [log.rank for log, load in zip(attempt.logs, loads, strict=True) if load is None]
    if missing:
        report.findings.append(Finding(attempt.number, None, None, f"ranks {missing} loaded no state, the others did"))
    load = next(load for load in loads if load is not None)
    if earlier and "resharded" not in load and load["d"] not in states_taken(earlier):
        report.findings.append(Finding(attempt.number, load.get("e"), load.get("pos"), "loaded a state that no earlier "
                                       "attempt took (another run's checkpoint, or an edited state)"))
    return load


class _StreamCheck:
    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        self.seen: dict[tuple[int, int, int], set[int]] = {}  # (epoch, rank, worker) -> batch numbers

    def run(self, attempts: list[Attempt]) -> None:
        workers = None
        for index, attempt in enumerate(attempts):
            load = resumed_from(self.report, attempt, attempts[:index])
            counts = {len(record["wb"]) for log in attempt.logs for record in log.records if record["t"] == "pass"}
            changed = workers is not None and bool(counts - {workers})
            workers = next(iter(counts), workers)
            if load is not None and ("resharded" in load or changed):
                self.report.findings.append(Finding(attempt.number, load.get("e"), None, "resumed a stream at another "
                                                    "world size or num_workers: the audit cannot follow a re-shard "
                                                    "(not checked)"))
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
