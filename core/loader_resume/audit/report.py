"""What ``loader-resume audit`` reports for one loader (``LoaderReport``, its ``Finding`` s), and
what the map-style and stream checks share: where each attempt resumed from, checked against the
states earlier attempts took.

An attempt that loaded a state must have loaded one an earlier attempt took (its digest is
recorded), and one that loaded none after states were taken is named. What the logs cannot show (the
attempts before the first one in them, a state no attempt in them took, a rank with no log) is a
*gap*: the report is incomplete, never "exactly once".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loader_resume.audit.read import Attempt, RankLog, first_load

__all__ = ["Finding", "LoaderReport", "first_place", "resumed_from", "states_taken"]


@dataclass(frozen=True)
class Finding:
    """One thing that does not hold (or, in ``LoaderReport.gaps``, that the logs cannot show), where
    it was found."""

    attempt: int
    """The attempt (numbered from 1 in the logs' order) whose batches or state it concerns."""
    epoch: int | None
    position: int | None
    """The global position (map-style) or the worker's batch number (streams): the first one
    concerned."""
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
    ``rolled_back_exact`` (False: a kill lost the records of the attempt it continues, so at least
    that many)."""
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """Per epoch: ``epoch``, ``delivered`` (samples), ``padding``, ``dropped``, ``status``; streams:
    per epoch, rank and worker, with its ``batches`` too."""
    findings: list[Finding] = field(default_factory=list)
    gaps: list[Finding] = field(default_factory=list)
    """What the logs cannot show: the report is incomplete (``loader-resume audit`` exits 3)."""
    notes: list[str] = field(default_factory=list)
    began_before_audit: bool = False
    """Checked with ``began_before_audit``: a first attempt resumed from a state taken before the
    logs is accepted."""
    checked_from: str | None = None
    """Where the check began when it did not begin at the job's start (``began_before_audit``):
    ``epoch E position P``; else None."""

    @property
    def ok(self) -> bool:
        """Everything holds, and the logs show the whole job."""
        return not self.findings and not self.gaps

    @property
    def complete(self) -> bool:
        """The logs show the whole job (or all of it from the first state loaded, with
        ``began_before_audit``)."""
        return not self.gaps


def first_place(log: RankLog) -> tuple[int | None, int | None]:
    """Where ``log``'s loader began: its first batch's epoch and position (streams: batch number),
    else its load's."""
    for record in log.records:
        if record["t"] == "b":
            return record["e"], record.get("s", record.get("b"))
        if record["t"] == "load":
            return record.get("e"), record.get("pos")
    return None, None


def states_taken(attempts: list[Attempt]) -> dict[str, int]:
    """Digest of each state taken -> the attempt that took it (the latest)."""
    return {
        record["d"]: attempt.number
        for attempt in attempts
        for log in attempt.logs
        for record in log.records
        if record["t"] == "state"
    }


def _saved(log: RankLog) -> bool:
    """Whether ``log``'s attempt went on delivering after a state it took (so its save, which comes
    first, was done)."""
    state_before = False
    for record in log.records:
        if record["t"] == "b" and state_before:
            return True
        state_before = state_before or record["t"] == "state"
    return False


def resumed_from(
    report: LoaderReport, attempt: Attempt, earlier: list[Attempt]
) -> dict[str, Any] | None:
    """The state ``attempt`` resumed from (checked to be one an earlier attempt took), or None: it
    began afresh."""
    loads = [first_load(log) for log in attempt.logs]
    if all(load is None for load in loads):
        if any(_saved(log) for other in earlier for log in other.logs):
            epoch, position = first_place(attempt.logs[0])
            report.findings.append(
                Finding(
                    attempt.number,
                    epoch,
                    position,
                    "started from the beginning, though "
                    "earlier attempts took states: no state was loaded before its first batch",
                )
            )
        elif states_taken(earlier):
            report.notes.append(
                f"attempt {attempt.number} started from the beginning: the only states taken "
                "before "
                "were each their attempt's last record (killed while saving: no checkpoint, maybe)"
            )
        return None
    missing = [log.rank for log, load in zip(attempt.logs, loads, strict=True) if load is None]
    load = next(load for load in loads if load is not None)
    if missing:
        report.findings.append(
            Finding(
                attempt.number,
                load.get("e"),
                load.get("pos"),
                f"ranks {missing} loaded no state, the others did",
                missing[0],
            )
        )
    where = (
        f"epoch {load.get('e')} position {load.get('pos')}"
        if "pos" in load
        else f"epoch {load.get('e')}"
    )
    if "resharded" in load or load["d"] in states_taken(earlier):
        return load
    if not earlier and report.began_before_audit:
        report.checked_from = where
        report.notes.append(
            f"attempt 1 resumed from {where}, a state taken before these logs "
            "(--began-before-audit): what was delivered before it is not checked"
        )
    elif not earlier:
        report.gaps.append(
            Finding(
                attempt.number,
                load.get("e"),
                load.get("pos"),
                f"resumed from {where}, a state no attempt in these logs took: the logs of the "
                "attempts before it are missing (deleted, or in another directory), or the job "
                "ran before its audit was turned on (then audit it with --began-before-audit)",
            )
        )
    else:
        report.gaps.append(
            Finding(
                attempt.number,
                load.get("e"),
                load.get("pos"),
                f"loaded a state ({where}) that no "
                "earlier attempt in these logs took: the log of the attempt that took it is "
                "missing, or it is another run's checkpoint or an edited state",
            )
        )
    return load
