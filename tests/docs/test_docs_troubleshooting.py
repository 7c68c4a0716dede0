"""docs/troubleshooting.md has an anchored entry for every exception class the packages define, each
exit code, and every warning or error line they log: a new one fails here until the page explains
it. Read from the sources, nothing imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "troubleshooting.md").read_text()
PACKAGES = [
    ROOT / "core" / "loader_resume",
    *(
        ROOT / name
        for name in ("lightning_resume", "accelerate_resume", "transformers_resume", "ray_resume",
                     "torchft_resume")
    ),
]
LOG_CALLS = {"warning", "error", "critical", "exception", "warn", "_warn_once"}

# A distinctive phrase of each logged line -> the page's entry for it. Every line the packages log
# at warning or error level must hold phrases of exactly one entry; every phrase must still be
# logged somewhere.
ENTRIES = {
    "cannot be locked": "not-locked",
    "is not locked": "not-locked",
    "taking over": "lease",
    "could not renew the lease": "lease",
    "could not remove the lease": "lease",
    "was taken by another job": "lease",
    "trying the one before it": "checkpoint-skipped",
    "at the automatic resume": "checkpoint-skipped",
    "the newest checkpoint that verifies": "checkpoint-skipped",
    "an incomplete checkpoint": "checkpoint-skipped",
    "so it may be incomplete": "checkpoint-skipped",
    "skipping %s: %s": "checkpoint-skipped",
    "left by a write interrupted": "checkpoint-skipped",
    "NOT written to": "checkpoint-not-written",
    "syncing its directory failed": "checkpoint-not-written",
    "deleting older ones failed": "checkpoint-not-written",
    "but NOT copied": "checkpoint-not-written",
    "deleting older remote checkpoints failed": "checkpoint-not-written",
    "written in the same second": "checkpoint-skipped",
    "so its upload did not complete": "checkpoint-skipped",
    "no loader_resume state": "no-loader-state",
    "saved without FabricResume": "no-loader-state",
    "saved before enable_resume": "no-loader-state",
    "no complete checkpoint in": "no-checkpoint",
    "no checkpoint to resume from: starting from step 0": "no-checkpoint",
    "will NOT be bit-identical": "not-exact",
    "before they were keyed": "not-exact",
    "re-sharded": "not-exact",
    "CUDA generators are NOT restored": "not-exact",
    "saved with an MPS generator": "not-exact",
    "has no saved RNG state": "not-exact",
    "resumed on %d": "another-world-size",
    "not moved to step": "another-world-size",
    "the generators start afresh": "another-world-size",
    "replaying %d of its indices": "replay",
    "by replaying the epoch's delivered items": "replay",
    "replaying %d items": "replay",
    "own resume protocol": "replay",
    "defines __getitems__": "batch-read",
    "with the same seed": "shared-seed",
    "could not write %d records": "audit-log",
    "kept after a failed write": "audit-log",
    "records dropped after failed writes": "audit-log",
    "records were never written": "audit-log",
    "was built without audit=": "audit-log",
    "is still mid-epoch": "load-state",
    "called twice with no iter()": "load-state",
    "the loop left the pass": "pass-left",
    "was left before its end": "pass-left",
    "preemption notice": "preemption",
    "TorchFTResume: preemption signal": "preemption",
    "outside a SLURM job": "preemption",
    "SLURM_JOB_ID is not set": "preemption",
    "scontrol could not run": "preemption",
    "scontrol exited with": "preemption",
    "requeued SLURM job": "preemption",
    "checkpoint written at step": "exit-143",
    "could NOT be written": "exit-74",
    "is switched off": "switched-off",
}


def _anchors() -> set[str]:
    return set(re.findall(r"\{ ?#([\w-]+) ?\}", PAGE))


def _trees() -> list[tuple[Path, ast.Module]]:
    return [
        (path, ast.parse(path.read_text()))
        for package in PACKAGES
        for path in sorted(package.rglob("*.py"))
    ]


def _text(node: ast.expr) -> str:
    """The literal text of a message argument (an f-string's fixed parts, a concatenation's)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(part) for part in node.values)
    if isinstance(node, ast.BinOp):
        return _text(node.left) + _text(node.right)
    return ""


def _logged() -> list[tuple[str, str]]:
    """``(where, message)`` of each warning or error logged; a call that only passes a message on
    (``"%s"``, ``logger.warning(message, *args)``) is left out: its callers carry the text and are
    counted instead."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", "")
            )
            if name not in LOG_CALLS:
                continue
            message = max((_text(arg) for arg in node.args), key=len, default="")
            if len(re.findall(r"[A-Za-z]{2,}", re.sub(r"%\S", "", message))) > 1:
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", message))
    return found


def test_every_logged_warning_or_error_has_an_entry() -> None:
    logged = _logged()
    assert len(logged) >= 50, "the scan sees the log calls"
    unmatched = [f"{where}: {message[:80]!r}" for where, message in logged
                 if len({anchor for phrase, anchor in ENTRIES.items() if phrase in message}) != 1]
    assert not unmatched, (
        "each logged line needs one phrase in ENTRIES and an entry on docs/troubleshooting.md:\n"
        + "\n".join(unmatched)
    )


def test_every_entry_is_on_the_page_and_still_logged() -> None:
    anchors = _anchors()
    assert not {anchor for anchor in ENTRIES.values() if anchor not in anchors}
    messages = [message for _, message in _logged()]
    assert [
        phrase for phrase in ENTRIES if not any(phrase in message for message in messages)
    ] == []


def _exception_classes() -> set[str]:
    classes: dict[str, list[str]] = {}
    for _, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [
                    getattr(base, "id", getattr(base, "attr", "")) for base in node.bases
                ]
    exceptions = {
        name
        for name, bases in classes.items()
        if any(base.endswith(("Error", "Exception")) or base == "Exception" for base in bases)
    }
    while (
        grown := {name for name, bases in classes.items() if set(bases) & exceptions} - exceptions
    ):
        exceptions |= grown
    return exceptions


def test_every_exception_class_has_an_anchored_entry() -> None:
    exceptions = _exception_classes()
    assert {
        "StateError",
        "CheckpointError",
        "WorkerStartError",
        "CheckpointDirectoryError",
    } <= exceptions
    headings = re.findall(r"^### `(\w+)`.*\{ ?#([\w-]+) ?\}$", PAGE, re.M)
    assert {name for name, anchor in headings if anchor == name.lower()} >= exceptions, headings


def test_every_exit_code_is_on_the_page() -> None:
    source = (ROOT / "core" / "loader_resume" / "job" / "checkpoint_dir.py").read_text()
    failed = int(re.search(r"^FAILED_SAVE_EXIT_CODE: Final = (\d+)$", source, re.M).group(1))
    anchors = _anchors()
    assert {f"exit-{failed}", "exit-143", "directory-lock"} <= anchors
    defaults = {int(code) for path, _ in _trees()
                for code in re.findall(r"exit_code: int(?: \| None)? = (\d+)", path.read_text())}
    assert defaults == {143}, defaults
