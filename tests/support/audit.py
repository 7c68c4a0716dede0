"""The audit's tests: attempts of ``tests/children/audit_child.py`` as real processes, and
``loader-resume audit`` over what they wrote; and the front-door tests' check of a job's
``audit=DIR`` logs (``LOADER_RESUME_AUDIT``): every loader's report holds, and the training loader's
says where each rerun resumed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loader_resume.audit.check import audit_directory
from loader_resume.tools.cli import main as cli
from support import forked

CHILD = Path(__file__).resolve().parent.parent / "children" / "audit_child.py"
N = 100
"""The child's samples, unless ``--n``."""


def attempt(out: Path, name: str, *args: str, expect: int = 0) -> list[Any]:
    """One attempt (one process); what it was handed, as it wrote it."""
    done = forked.run(
        [sys.executable, str(CHILD), str(out / "audit"), str(out / f"{name}.json"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == expect, done.stderr[-3000:]
    return json.loads((out / f"{name}.json").read_text())  # type: ignore[no-any-return]


def side_by_side(out: Path, name: str, *args: str, expect: int = 0) -> list[list[Any]]:
    """One attempt of a world of 2: two processes at once, rank 0 and rank 1."""
    children = [
        forked.popen(
            [
                sys.executable,
                str(CHILD),
                str(out / "audit"),
                str(out / f"{name}-{rank}.json"),
                "--rank",
                str(rank),
                "--world",
                "2",
                *[a.replace("RANK", str(rank)) for a in args],
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for child in children:
        _, stderr = child.communicate(timeout=120)
        assert child.returncode == expect, stderr[-3000:]
    return [json.loads((out / f"{name}-{rank}.json").read_text()) for rank in (0, 1)]


def audit(
    out: Path, capsys: pytest.CaptureFixture[str], *options: str
) -> tuple[int, dict[str, Any], str]:
    """``loader-resume audit`` as JSON and as text: exit code, the (one) loader's report, the
    text."""
    capsys.readouterr()
    code = cli(["audit", str(out / "audit"), "--json", *options])
    (report,) = json.loads(capsys.readouterr().out)
    assert cli(["audit", str(out / "audit"), *options]) == code
    return code, report, capsys.readouterr().out


def verdict(text: str) -> str:
    """The report's verdict (its last paragraph), on one line as it reads unwrapped."""
    return " ".join(text.rstrip().split("\n\n")[-1].split())


def by_epoch(batches: list[Any]) -> dict[int, list[int]]:
    """An attempt's own record of what it was handed, as the ids of each epoch."""
    ids: dict[int, list[int]] = {}
    for epoch, batch in batches:
        ids.setdefault(epoch, []).extend(batch)
    return ids


def audited(directory: Path, worlds: list[int]) -> dict[str, Any]:
    """Check the reports under ``directory``: all hold; one loader (the training one) ran
    ``len(worlds)`` attempts of those world sizes, each rerun resumed from a state with nothing
    redone (a preemption checkpoint is taken at the step boundary after the last batch). Returns
    that loader's attempts."""
    reports = audit_directory(directory)
    assert all(report.ok for report in reports), [
        (report.name, report.findings, report.gaps) for report in reports
    ]
    training = [
        report for report in reports if any(a["resumed"] != "(fresh)" for a in report.attempts)
    ]
    assert training, [report.attempts for report in reports]
    report = training[0]
    assert [a["world"] for a in report.attempts] == worlds, report.attempts
    assert [a["rolled_back"] for a in report.attempts[1:]] == [0] * (len(worlds) - 1), (
        report.attempts
    )
    # a preemption: every record written
    assert all(a["rolled_back_exact"] for a in report.attempts), report.attempts
    assert all(
        row["status"] == "ok" or row["status"].startswith("partial") for row in report.epochs
    ), report.epochs
    return {"attempts": report.attempts, "epochs": report.epochs}
