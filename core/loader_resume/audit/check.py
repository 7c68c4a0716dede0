"""Checking a job's audit logs (``loader_resume.audit.read``): was every sample seen exactly once
across restarts?

Every attempt must share its loader's identity (``SAME``); no two processes may read as one rank at
the same time (``loader_resume.audit.read.Attempt.alongside``); an attempt that loaded a state must
have loaded one an earlier attempt took (its digest is recorded), and one that loaded none after
states were taken is named. What the logs cannot show (the attempts before the first one in them, a
state no attempt in them took, a rank with no log) is a *gap*: the report is incomplete, never
"exactly once" (``loader_resume.audit.report``). Map-style data: ``loader_resume.audit.map``;
streams: ``loader_resume.audit.stream``; a job whose groups come and go while it runs (TorchFT):
``loader_resume.audit.quorum``.
"""

from __future__ import annotations

import os

from loader_resume.audit.map import MapCheck
from loader_resume.audit.quorum import QuorumCheck
from loader_resume.audit.read import Attempt, AuditFormatError, RankLog, read_audit
from loader_resume.audit.report import (
    Finding,
    LoaderReport,
    first_place,
    resumed_from,
    states_taken,
)
from loader_resume.audit.stream import StreamCheck

SAME = ("kind", "n", "order", "seed", "keying")
"""What every attempt's loader must share: what decides its order and its random keys (the batch
size, the world size and the workers may change)."""

__all__ = [
    "AuditFormatError",
    "Finding",
    "LoaderReport",
    "audit_directory",
    "check_loader",
    "resumed_from",
    "states_taken",
]


def audit_directory(
    directory: str | os.PathLike[str], *, began_before_audit: bool = False
) -> list[LoaderReport]:
    """Every loader's report from the logs under ``directory``; ``AuditFormatError`` if they cannot
    be read. ``began_before_audit``: the job ran before its audit was turned on; its first attempt
    in the logs may resume from a state taken before them, and is checked from there on."""
    return [check_loader(name, attempts, began_before_audit=began_before_audit)
            for name, attempts in read_audit(directory).items()]


def check_loader(
    name: str, attempts: list[Attempt], *, began_before_audit: bool = False
) -> LoaderReport:
    """The report of one loader's attempts."""
    header = attempts[0].logs[0].header
    report = LoaderReport(name, header, began_before_audit=began_before_audit)
    for attempt in attempts:
        for log in attempt.logs:
            if log.torn is not None:
                report.notes.append(
                    f"{log.path}: its last line was cut short (a kill while writing): ignored"
                )
            _lost(report, attempt, log)
            changed = [
                f"{key} {log.header.get(key)!r} (attempt 1: {header.get(key)!r})"
                for key in SAME
                if log.header.get(key) != header.get(key)
            ]
            if changed:
                epoch, position = first_place(log)
                report.findings.append(
                    Finding(
                        attempt.number,
                        epoch,
                        position,
                        f"ran with {', '.join(changed)}: "
                        "the order and the random keys are not the same",
                        log.rank,
                    )
                )
    for attempt in attempts:
        for earlier, log in attempt.alongside:
            found = _alongside(attempts, earlier, log, header["kind"] == "map")
            if found is not None:
                report.findings.append(found)
    # NOTE: what follows assumes one loader identity and one process a rank at a time
    if report.findings:
        report.attempts = [
            {
                "number": attempt.number,
                "world": attempt.world,
                "batches": sum(
                    record["t"] == "b" for log in attempt.logs for record in log.records
                ),
                "resumed": "(not checked)",
                "rolled_back": 0,
                "rolled_back_exact": True,
            }
            for attempt in attempts
        ]
        return report
    if header["kind"] == "map":
        MapCheck(report).run(attempts)
    elif header["kind"] == "quorum":
        QuorumCheck(report).run(attempts)
    else:
        StreamCheck(report).run(attempts)
    return report


def _lost(report: LoaderReport, attempt: Attempt, log: RankLog) -> None:
    """A finding for records dropped after failed writes, placed after the last batch written before
    them."""
    epoch = position = None
    for record in log.records:
        if record["t"] == "b":
            epoch, position = record["e"], record.get("end", record.get("b"))
        elif record["t"] == "lost":
            report.findings.append(
                Finding(
                    attempt.number,
                    epoch,
                    position,
                    f"{log.path}: {record['records']} records were dropped after failed writes (a "
                    "full disk?): what was delivered after this is not known",
                    log.rank,
                    record["records"],
                )
            )


def _alongside(
    attempts: list[Attempt], earlier: RankLog, log: RankLog, map_style: bool
) -> Finding | None:
    """Two processes that read at the same time as one rank (or at two world sizes): the samples
    both delivered (None if none: nothing was read twice)."""
    number = {id(other): attempt.number for attempt in attempts for other in attempt.logs}
    both = sorted(_delivered(earlier, map_style) & _delivered(log, map_style))
    if not both:
        return None
    epoch, position = both[0][0], both[0][-1]
    epochs = sorted({key[0] for key in both})
    what = (
        f"{len(both)} {'samples' if map_style else 'batches'} delivered by both "
        f"(epoch{'s' * (len(epochs) > 1)} "
        f"{', '.join(map(str, epochs))}, from {'position' if map_style else 'batch'} {position})"
    )
    same = (
        f"rank {log.rank} of {log.world} in two processes"
        if (earlier.rank, earlier.world) == (log.rank, log.world)
        else f"rank {earlier.rank} of {earlier.world} and rank {log.rank} of {log.world}"
    )
    return Finding(
        number[id(log)],
        epoch,
        position,
        f"{same} at the same time ({earlier.process}, attempt {number[id(earlier)]}; "
        f"{log.process}, attempt {number[id(log)]}): {what}; give every process its own rank= and "
        "world_size= (or initialize torch.distributed before the loader is built)",
        log.rank,
        len(both),
    )


def _delivered(log: RankLog, map_style: bool) -> set[tuple[int, ...]]:
    """What ``log``'s process was handed: (epoch, global position) of each sample; streams: (epoch,
    worker, batch)."""
    if not map_style:
        return {
            (record["e"], record["w"], record["b"]) for record in log.records if record["t"] == "b"
        }
    units: dict[int, int | None] = {}
    seen: set[tuple[int, ...]] = set()
    for record in log.records:
        if record["t"] == "pass":
            units[record["e"]] = record["units"]
        elif record["t"] == "b":
            share = -(-(record["end"] - record["s"]) // log.world)
            first = record["s"] + log.rank * share
            limit = units.get(record["e"])
            seen.update(
                (record["e"], p) for p in range(first, first + share) if limit is None or p < limit
            )
    return seen
