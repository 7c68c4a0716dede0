"""The front-door tests' check of a job's ``audit=DIR`` logs (``LOADER_RESUME_AUDIT``): every loader's report holds,
and the training loader's says where each rerun resumed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loader_resume.audit_check import audit_directory


def audited(directory: Path, worlds: list[int]) -> dict[str, Any]:
    """Check the reports under ``directory``: all hold; one loader (the training one) ran ``len(worlds)`` attempts of
    those world sizes, each rerun resumed from a state with nothing redone (a preemption checkpoint is taken at the
    step boundary after the last batch). Returns that loader's attempts."""
    reports = audit_directory(directory)
    assert all(report.ok for report in reports), [(report.name, report.findings) for report in reports]
    training = [report for report in reports if any(a["resumed"] != "(fresh)" for a in report.attempts)]
    assert training, [report.attempts for report in reports]
    report = training[0]
    assert [a["world"] for a in report.attempts] == worlds, report.attempts
    assert [a["rolled_back"] for a in report.attempts[1:]] == [0] * (len(worlds) - 1), report.attempts
    assert all(row["status"] == "ok" or row["status"].startswith("partial") for row in report.epochs), report.epochs
    return {"attempts": report.attempts, "epochs": report.epochs}
