"""One base for every error loader-resume raises on purpose, each still the built-in exception it
was; and one reader of a front door's checkpoint entry, so the same condition raises the same error
in every front door."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import loader_resume
from loader_resume import LoaderResumeError
from loader_resume.audit.check import AuditFormatError
from loader_resume.job.checkpoint import CHECKPOINT_FORMAT, CheckpointError
from loader_resume.job.checkpoint_dir import CheckpointDirectoryError
from loader_resume.job.checkpoint_entry import checked_entry
from loader_resume.job.remote_copy import RemoteCopyError
from loader_resume.workers.worker_start import WorkerStartError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ROOT / "core" / "loader_resume",
    *(
        ROOT / name
        for name in ("lightning_resume", "accelerate_resume", "transformers_resume", "ray_resume")
    ),
]
BUILT_IN = {
    loader_resume.StateError: ValueError,
    CheckpointError: ValueError,
    AuditFormatError: ValueError,
    CheckpointDirectoryError: RuntimeError,
    WorkerStartError: RuntimeError,
    RemoteCopyError: OSError,
}


def test_every_error_is_a_loader_resume_error_and_the_built_in_it_was() -> None:
    defined = {node.name for folder in PACKAGES for path in folder.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
               and node.name.endswith("Error") and node.name != "LoaderResumeError"}
    assert defined == {error.__name__ for error in BUILT_IN}, (
        "a new error class: add it here, under the base"
    )
    for error, built_in in BUILT_IN.items():
        assert issubclass(error, LoaderResumeError) and issubclass(error, built_in), error
    # code that caught the built-in still does
    with pytest.raises(ValueError, match="loader state field 'seed'"):
        raise loader_resume.StateError("seed", 1, "0")


def test_a_front_doors_entry_of_another_format_or_missing_keys_is_one_error_naming_where() -> None:
    good = {"format": CHECKPOINT_FORMAT, "loaders": [], "rng": []}
    assert checked_entry(good, "x.pt", needs=("loaders", "rng")) is good
    for saved, said in (
        (
            dict(good, format=99),
            f"x.pt: format 99; expected {CHECKPOINT_FORMAT} (written by "
            "another loader-resume release?)",
        ),
        (3, f"x.pt: format 3; expected {CHECKPOINT_FORMAT}"),
        (
            {"format": CHECKPOINT_FORMAT},
            "x.pt: loaders, rng missing; expected an entry written by loader-resume",
        ),
    ):
        with pytest.raises(CheckpointError) as raised:
            checked_entry(saved, "x.pt", needs=("loaders", "rng"))
        assert str(raised.value).startswith(said)
