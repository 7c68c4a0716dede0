"""``loader-resume audit DIR``: the report of a job's ``audit=DIR`` logs; exit 0 only if every
sample was seen exactly once across its restarts and the logs show the whole job
(``loader_resume.audit.check``)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import asdict
from typing import Any

from loader_resume.audit.check import Finding, LoaderReport, audit_directory
from loader_resume.audit.read import AuditFormatError

__all__ = ["INCOMPLETE_EXIT_CODE", "add_arguments", "main", "render"]

INCOMPLETE_EXIT_CODE = 3
"""Nothing found wrong, but the logs do not show the whole job (a missing log, a state taken before
them)."""
WIDTH = 88
"""The findings, gaps, notes and the verdict are wrapped at this many characters (the tables are
not)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", help="the audit directory (a path or an fsspec URL) the job's loaders wrote to"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of tables"
    )
    parser.add_argument(
        "--began-before-audit",
        action="store_true",
        help="the job ran before its audit was turned on: check it from the state its first "
             "attempt "
        "in the logs loaded (else that attempt is a gap: exit 3)",
    )


def main(args: argparse.Namespace) -> int:
    """Print the report; 0 if everything holds, 1 if something does not, 2 if the logs cannot be
    read, 3 if nothing is wrong in them but they do not show the whole job."""
    try:
        reports = audit_directory(args.directory, began_before_audit=args.began_before_audit)
    except (AuditFormatError, OSError) as error:
        sys.stderr.write(f"loader-resume audit: {error}\n")
        return 2
    if args.json:
        payload = [
            dict(asdict(report), ok=report.ok, complete=report.complete) for report in reports
        ]
        sys.stdout.write(json.dumps(payload, indent=1, default=repr) + "\n")
    else:
        sys.stdout.write(render(reports))
    if any(report.findings for report in reports):
        return 1
    return 0 if all(report.complete for report in reports) else INCOMPLETE_EXIT_CODE


def render(reports: list[LoaderReport]) -> str:
    """The reports as plain-text tables, with the verdict last."""
    out: list[str] = []
    for report in reports:
        header = report.header
        size = f"{header['n']} samples" if header.get("n") is not None else "a stream"
        out.append(
            f"loader {report.name} ({header['kind']}, {header.get('order')}, {size}, seed "
            f"{header['seed']})"
        )
        out.append(
            _table(
                ["attempt", "ranks", "resumed from", "batches (all ranks)", "steps rolled back"],
                [
                    [
                        a["number"],
                        a["world"],
                        a["resumed"],
                        a["batches"],
                        a["rolled_back"]
                        if a.get("rolled_back_exact", True)
                        else f"{a['rolled_back']} or more",
                    ]
                    for a in report.attempts
                ],
            )
        )
        streams = header["kind"] not in ("map", "quorum")
        columns = [
            "epoch",
            *(["rank", "worker", "batches"] if streams else []),
            "delivered",
            "padding",
            "dropped",
            "status",
        ]
        rows = [
            dict(
                row,
                dropped=f"{row['dropped']} (from {row['dropped_from']})"
                if row.get("dropped")
                else row.get("dropped", 0),
            )
            for row in report.epochs
        ]
        out.append(_table(columns, [[row.get(column, "") for column in columns] for row in rows]))
        out.extend(_wrap(f"note: {note}") for note in report.notes)
        out.extend(
            _wrap(f"FAIL {_where(finding, streams)}: {finding.message}")
            for finding in report.findings
        )
        out.extend(
            _wrap(f"GAP {_where(finding, streams)}: {finding.message}") for finding in report.gaps
        )
        out.append("")
    out.append(_wrap(_verdict(reports)))
    return "\n".join(out) + "\n"


def _wrap(line: str) -> str:
    """A line of words at most ``WIDTH`` characters wide, the rest indented (a path or a word is
    never cut)."""
    return textwrap.fill(
        line, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )


def _where(finding: Finding, streams: bool) -> str:
    parts = [
        f"attempt {finding.attempt}",
        "all ranks" if finding.rank is None else f"rank {finding.rank}",
    ]
    if finding.epoch is not None:
        parts.append(f"epoch {finding.epoch}")
    if finding.position is not None:
        parts.append(f"{'batch' if streams else 'position'} {finding.position}")
    return ", ".join(parts)


def _verdict(reports: list[LoaderReport]) -> str:
    findings = [finding for report in reports for finding in report.findings]
    gaps = [gap for report in reports for gap in report.gaps]
    if findings:
        count = len(findings)
        return f"FAILED: {count} finding{'s' * (count != 1)}, the first: {findings[0].message}"
    if gaps:
        count = len(gaps)
        return (
            f"INCOMPLETE: nothing found wrong, but the logs do not show the whole job ({count} gap"
            f"{'s' * (count != 1)}, the first: attempt {gaps[0].attempt} "
            f"{gaps[0].message.split(': ')[0]})"
        )
    attempts = max((len(report.attempts) for report in reports), default=0)
    since = "".join(
        f" from {report.checked_from} on" for report in reports[:1] if report.checked_from
    )
    plural = "s" * (attempts != 1)
    return f"OK: every sample{since} delivered exactly once, across {attempts} attempt{plural}"


def _table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [columns, *[[str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )
