"""`loader-resume check` (issue #6 item 1): a deterministic pipeline passes; an unkeyed RNG is caught."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
CLI = Path(sys.executable).parent / "loader-resume"


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), "check", *args], cwd=TESTS, capture_output=True, text=True, timeout=600)


def test_a_deterministic_pipeline_resumes_exactly_in_every_scenario() -> None:
    done = check("check_pipelines:good", "--epochs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # 5 batches an epoch: cuts 1, 2, 4 (the epoch's last), 5 (boundary), 6; resumed with 2 and 0 workers
    assert lines[-1] == "10 exact, 0 diverging"
    assert "cut after    4 batches, num_workers 2 -> 0: exact" in lines
    assert "scenarios" in done.stderr  # the progress bar


def test_an_unseeded_generator_is_caught_and_the_first_diverging_batch_named() -> None:
    done = check("check_pipelines:unkeyed", "--epochs", "1", "--cuts", "2", "--workers", "0", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    (scenario,) = json.loads(done.stdout)
    assert scenario["exact"] is False and scenario["diverged_at"] == 2 and scenario["epoch"] == 0
    assert scenario["fields"] == ["'noise'"]


def test_a_bad_factory_spec_is_refused_clearly() -> None:
    done = check("check_pipelines.good")
    assert done.returncode != 0 and "is not MODULE:FACTORY" in done.stderr
