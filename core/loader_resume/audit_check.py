"""Checking a job's audit logs (``loader_resume.audit_read``): was every sample seen exactly once across restarts?

Every attempt must share its loader's identity (``SAME``); no two processes may read as one rank at the same time
(``loader_resume.audit_read.Attempt.alongside``); an attempt that loaded a state must have loaded one an earlier
attempt took (its digest is recorded), and one that loaded none after states were taken is named. What the logs
cannot show (the attempts before the first one in them, a state no attempt in them took, a rank with no log) is a
*gap*: the report is incomplete, never "exactly once". Map-style data: ``loader_resume.audit_map``.

Streams (each rank's workers own their part): each worker's batches of an epoch must be numbered 1, 2, ... without
a gap or a repeat after the cuts, and an attempt must continue each worker where its loaded state said.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .audit_read import Attempt, AuditFormatError, RankLog, first_load, read_audit

SAME = ("kind", "n", "order", "seed", "keying")
"""What every attempt's loader must share: what decides its order and its random keys (the batch size, the world
size and the workers may change)."""

__all__ = ["AuditFormatError", "Finding", "LoaderReport", "audit_directory", "check_loader", "resumed_from",
           "states_taken"]


@dataclass(frozen=True)
class Finding:
    """One thing that does not hold (or, in ``LoaderReport.gaps``, that the logs cannot show), where it was found."""

    attempt: int
    """The attempt (numbered from 1 in the logs' order) whose batches or state it concerns."""
    epoch: int | None
    position: int | None
    """The global position (map-style) or the worker's batch number (streams): the first one concerned."""
    message: str
    rank: int | None = None
    """The rank concerned; None: every rank of the attempt."""
    count: int = 1
    """How many samples (map-style) or batches (streams) it concerns, from ``position`` on."""


@dataclass
class LoaderReport:
    """One loader's attempts and epochs, and what does not hold."""

    name: str
    header: dict[str, Any]
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Per attempt: ``number``, ``world``, ``batches``, ``resumed`` (text), ``rolled_back`` and
    ``rolled_back_exact`` (False: a kill lost the records of the attempt it continues, so at least that many)."""
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """Per epoch: ``epoch``, ``delivered`` (samples), ``padding``, ``dropped``, ``status``; streams: per epoch, rank
    and worker, with its ``batches`` too."""
    findings: list[Finding] = field(default_factory=list)
    gaps: list[Finding] = field(default_factory=list)
    """What the logs cannot show: the report is incomplete (``loader-resume audit`` exits 3)."""
    notes: list[str] = field(default_factory=list)
    began_before_audit: bool = False
    """Checked with ``began_before_audit``: a first attempt resumed from a state taken before the logs is accepted."""
    checked_from: str | None = None
    """Where the check began when it did not begin at the job's start (``began_before_audit``): ``epoch E position
    P``; else None."""

    @property
    def ok(self) -> bool:
        """Everything holds, and the logs show the whole job."""
        return not self.findings and not self.gaps

    @property
    def complete(self) -> bool:
        """The logs show the whole job (or all of it from the first state loaded, with ``began_before_audit``)."""
        return not self.gaps


def audit_directory(directory: str | os.PathLike[str], *, began_before_audit: bool = False) -> list[LoaderReport]:
    """Every loader's report from the logs under ``directory``; ``AuditFormatError`` if they cannot be read.
    ``began_before_audit``: the job ran before its audit was turned on; its first attempt in the logs may resume from
    a state taken before them, and is checked from there on."""
    return [check_loader(name, attempts, began_before_audit=began_before_audit)
            for name, attempts in read_audit(directory).items()]


def check_loader(name: str, attempts: list[Attempt], *, began_before_audit: bool = False) -> LoaderReport:
    """The report of one loader's attempts."""
    header = attempts[0].logs[0].header
    report = LoaderReport(name, header, began_before_audit=began_before_audit)
    for attempt in attempts:
        for log in attempt.logs:
            if log.torn is not None:
                report.notes.append(f"{log.path}: its last line was cut short (a kill while writing): ignored")
            _lost(report, attempt, log)
            changed = [f"{key} {log.header.get(key)!r} (attempt 1: {header.get(key)!r})" for key in SAME
                       if log.header.get(key) != header.get(key)]
            if changed:
                epoch, position = _first_place(log)
                report.findings.append(Finding(attempt.number, epoch, position, f"ran with {', '.join(changed)}: "
                                               "the order and the random keys are not the same", log.rank))
    for attempt in attempts:
        for earlier, log in attempt.alongside:
            report.findings.append(_alongside(attempts, earlier, log, header["kind"] == "map"))
    if report.findings:  # NOTE: what follows assumes one loader identity and one process a rank at a time
        report.attempts = [{"number": attempt.number, "world": attempt.world, "batches": sum(
            record["t"] == "b" for log in attempt.logs for record in log.records), "resumed": "(not checked)",
            "rolled_back": 0, "rolled_back_exact": True} for attempt in attempts]
        return report
    if header["kind"] == "map":
        from .audit_map import MapCheck  # NOTE: it builds on this module's Finding and resumed_from

        MapCheck(report).run(attempts)
    else:
        _StreamCheck(report).run(attempts)
    return report


def _first_place(log: RankLog) -> tuple[int | None, int | None]:
    """Where ``log``'s loader began: its first batch's epoch and position (streams: batch number), else its load's."""
    for record in log.records:
        if record["t"] == "b":
            return record["e"], record.get("s", record.get("b"))
        if record["t"] == "load":
            return record.get("e"), record.get("pos")
    return None, None


def _lost(report: LoaderReport, attempt: Attempt, log: RankLog) -> None:
    """A finding for records dropped after failed writes, placed after the last batch written before them."""
    epoch = position = None
    for record in log.records:
        if record["t"] == "b":
            epoch, position = record["e"], record.get("end", record.get("b"))
        elif record["t"] == "lost":
            report.findings.append(Finding(attempt.number, epoch, position, f"{log.path}: {record['records']} records "
                                           "were dropped after failed writes (a full disk?): what was delivered "
                                           "after this is not known", log.rank, record["records"]))


def _alongside(attempts: list[Attempt], earlier: RankLog, log: RankLog, map_style: bool) -> Finding:
    """Two processes that read at the same time as one rank (or at two world sizes): the samples both delivered."""
    number = {id(other): attempt.number for attempt in attempts for other in attempt.logs}
    both = sorted(_delivered(earlier, map_style) & _delivered(log, map_style))
    epoch, position = both[0][:2] if both else _first_place(log)
    epochs = sorted({key[0] for key in both})
    what = (f"{len(both)} {'samples' if map_style else 'batches'} delivered by both (epoch{'s' * (len(epochs) > 1)} "
            f"{', '.join(map(str, epochs))}, from {'position' if map_style else 'batch'} {position})" if both else
            "nothing delivered by both yet")
    same = (f"rank {log.rank} of {log.world} in two processes" if (earlier.rank, earlier.world) == (log.rank, log.world)
            else f"rank {earlier.rank} of {earlier.world} and rank {log.rank} of {log.world}")
    return Finding(number[id(log)], epoch, position, f"{same} at the same time ({earlier.process}, attempt "
                   f"{number[id(earlier)]}; {log.process}, attempt {number[id(log)]}): {what}; give every process its "
                   "own rank= and world_size= (or initialize torch.distributed before the loader is built)",
                   log.rank, max(len(both), 1))


def _delivered(log: RankLog, map_style: bool) -> set[tuple[int, ...]]:
    """What ``log``'s process was handed: (epoch, global position) of each sample; streams: (epoch, worker, batch)."""
    if not map_style:
        return {(record["e"], record["w"], record["b"]) for record in log.records if record["t"] == "b"}
    units: dict[int, int | None] = {}
    seen: set[tuple[int, ...]] = set()
    for record in log.records:
        if record["t"] == "pass":
            units[record["e"]] = record["units"]
        elif record["t"] == "b":
            share = -(-(record["end"] - record["s"]) // log.world)
            first = record["s"] + log.rank * share
            limit = units.get(record["e"])
            seen.update((record["e"], p) for p in range(first, first + share) if limit is None or p < limit)
    return seen


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
            epoch, position = _first_place(attempt.logs[0])
            report.findings.append(Finding(attempt.number, epoch, position, "started from the beginning, though "
                                           "earlier attempts took states: no state was loaded before its first batch"))
        elif states_taken(earlier):
            report.notes.append(f"attempt {attempt.number} started from the beginning: the only states taken before "
                                "were each their attempt's last record (killed while saving: no checkpoint, maybe)")
        return None
    missing = [log.rank for log, load in zip(attempt.logs, loads, strict=True) if load is None]
    load = next(load for load in loads if load is not None)
    if missing:
        report.findings.append(Finding(attempt.number, load.get("e"), load.get("pos"), f"ranks {missing} loaded no "
                                       "state, the others did", missing[0]))
    where = f"epoch {load.get('e')} position {load.get('pos')}" if "pos" in load else f"epoch {load.get('e')}"
    if "resharded" in load or load["d"] in states_taken(earlier):
        return load
    if not earlier and report.began_before_audit:
        report.checked_from = where
        report.notes.append(f"attempt 1 resumed from {where}, a state taken before these logs (--began-before-audit): "
                            "what was delivered before it is not checked")
    elif not earlier:
        report.gaps.append(Finding(attempt.number, load.get("e"), load.get("pos"), f"resumed from {where}, a state no "
                                   "attempt in these logs took: the logs of the attempts before it are missing "
                                   "(deleted, or in another directory), or the job ran before its audit was turned on "
                                   "(then audit it with --began-before-audit)"))
    else:
        report.gaps.append(Finding(attempt.number, load.get("e"), load.get("pos"), f"loaded a state ({where}) that no "
                                   "earlier attempt in these logs took: the log of the attempt that took it is "
                                   "missing, or it is another run's checkpoint or an edited state"))
    return load


class _StreamCheck:
    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        # (epoch, rank, worker) -> batch number -> (the attempt that delivered it, the worker's items after it)
        self.seen: dict[tuple[int, int, int], dict[int, tuple[int, int]]] = {}

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
                        self._add(attempt.number, log.rank, record)
            resumed = "(fresh)" if load is None else f"epoch {load['e']}, workers at batches {load.get('wb')}"
            exact = all(log.ended for other in attempts[:index] for log in other.logs)
            self.report.attempts.append({"number": attempt.number, "world": attempt.world, "batches": batches,
                                         "resumed": resumed, "rolled_back": rolled, "rolled_back_exact": exact})
        last = attempts[-1].number
        for (epoch, rank, worker), numbers in sorted(self.seen.items()):
            gaps = sorted(set(range(1, max(numbers) + 1)) - set(numbers))
            samples = sum(items - (numbers[n - 1][1] if n > 1 else 0) for n, (_, items) in numbers.items()
                          if n == 1 or n - 1 in numbers)
            status = "ok"
            if gaps:
                after = next((numbers[n][0] for n in sorted(numbers) if n > gaps[0]), last)
                status = f"batch {gaps[0]} never delivered ({len(gaps)} missing)"
                self.report.findings.append(Finding(after, epoch, gaps[0], f"worker {worker}: {len(gaps)} batch"
                                                    f"{'es' * (len(gaps) > 1)} never delivered, from batch {gaps[0]}",
                                                    rank, len(gaps)))
            self.report.epochs.append({"epoch": epoch, "rank": rank, "worker": worker, "batches": len(numbers),
                                       "delivered": samples, "padding": 0, "dropped": 0, "status": status})

    def _cut(self, rank: int, load: dict[str, Any] | None) -> int:
        gone = 0
        for (epoch, owner, worker), numbers in self.seen.items():
            if owner != rank:
                continue
            keep = 0 if load is None or epoch > load["e"] else None if epoch < load["e"] else load["wb"][worker]
            if keep is None:
                continue
            cut = [n for n in numbers if n > keep]
            gone += len(cut)
            for n in cut:
                del numbers[n]
        return gone

    def _add(self, attempt: int, rank: int, record: dict[str, Any]) -> None:
        key = (record["e"], rank, record["w"])
        numbers = self.seen.setdefault(key, {})
        if record["b"] in numbers:
            self.report.findings.append(Finding(attempt, record["e"], record["b"], f"worker {record['w']}: batch "
                                                f"{record['b']} delivered again, with no resume between", rank))
        numbers[record["b"]] = (attempt, int(record.get("i", 0)))
