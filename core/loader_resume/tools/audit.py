"""``loader-resume audit DIR``: the report of a job's ``audit=DIR`` logs; exit 0 only if every sample was seen
exactly once across its restarts (``loader_resume.audit_check``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from ..audit_check import LoaderReport, audit_directory
from ..audit_read import AuditFormatError

__all__ = ["add_arguments", "main", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="the audit directory (a path or an fsspec URL) the job's loaders wrote to")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")


def main(args: argparse.Namespace) -> int:
    """Print the report; 0 if everything holds, 1 if something does not, 2 if the logs cannot be read."""
    try:
        reports = audit_directory(args.directory)
    except (AuditFormatError, OSError) as error:
        sys.stderr.write(f"loader-resume audit: {error}\n")
        return 2
    if args.json:
        payload = [dict(asdict(report), ok=report.ok) for report in reports]
        sys.stdout.write(json.dumps(payload, indent=1, default=repr) + "\n")
    else:
        sys.stdout.write(render(reports))
    return 0 if all(report.ok for report in reports) else 1


def render(reports: list[LoaderReport]) -> str:
    """The reports as plain-text tables, with the verdict last."""
    out: list[str] = []
    for report in reports:
        header = report.header
        size = f"{header['n']} samples" if header.get("n") is not None else "a stream"
        out.append(f"loader {report.name} ({header['kind']}, {header.get('order')}, {size}, seed {header['seed']})")
        out.append(_table(["attempt", "ranks", "resumed from", "batches (all ranks)", "steps rolled back"],
                          [[a["number"], a["world"], a["resumed"], a["batches"], a["rolled_back"]]
                           for a in report.attempts]))
        streams = header["kind"] != "map"
        columns = ["epoch", *(["rank", "worker"] if streams else []), "delivered", "padding", "dropped", "status"]
        out.append(_table(columns, [[row.get(column, "") for column in columns] for row in report.epochs]))
        out.extend(f"note: {note}" for note in report.notes)
        for finding in report.findings:
            where = [f"attempt {finding.attempt}" if finding.attempt else "",
                     f"rank {finding.rank}" if finding.rank is not None else "",
                     f"epoch {finding.epoch}" if finding.epoch is not None else "",
                     f"{'batch' if streams else 'position'} {finding.position}" if finding.position is not None else ""]
            out.append(f"FAIL {', '.join(part for part in where if part)}: {finding.message}")
        out.append("")
    bad = [report for report in reports if not report.ok]
    first = next((report.findings[0] for report in bad), None)
    count = sum(len(report.findings) for report in bad)
    attempts = max((len(report.attempts) for report in reports), default=0)
    out.append(f"OK: every sample delivered exactly once, across {attempts} attempt{'s' * (attempts != 1)}"
               if first is None else f"FAILED: {count} finding{'s' * (count != 1)}, the first: {first.message}")
    return "\n".join(out) + "\n"


def _table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [columns, *[[str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in cells)
