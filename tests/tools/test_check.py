"""`loader-resume check`: a deterministic pipeline passes; an unkeyed RNG is caught."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.launch import CHILDREN

CLI = Path(sys.executable).parent / "loader-resume"


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), "check", *args], cwd=CHILDREN, capture_output=True, text=True, timeout=600
    )


def test_a_deterministic_pipeline_resumes_exactly_in_every_scenario() -> None:
    done = check("check_pipelines:good", "--epochs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # 5 batches an epoch: cuts 1, 2, 4 (the epoch's last), 5 (boundary), 6; resumed with 2 and 0
    # workers, cut again one batch after the resume with 2, and over 2 ranks (judged on the samples:
    # the batches are composed differently)
    assert lines[-1] == "20 exact, 0 diverging"
    assert "cut after    4 batches, num_workers 2 -> 0: exact" in lines
    assert "cut after    5 batches, num_workers 2 -> 2, cut again after 6: exact" in lines
    assert "cut after    2 batches, world size 1 -> 2: the rest of the epoch exactly once" in lines
    assert "scenarios" in done.stderr  # the progress bar


def test_an_unseeded_generator_is_caught_and_the_first_diverging_batch_named() -> None:
    done = check(
        "check_pipelines:unkeyed", "--epochs", "1", "--cuts", "2", "--workers", "0", "--json"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    scenario, rescale = json.loads(done.stdout)
    assert scenario["exact"] is False and scenario["diverged_at"] == 2 and scenario["epoch"] == 0
    assert scenario["fields"] == ["'noise'"]
    # its order is fine: only its values are not keyed
    assert rescale["world"] == 2 and rescale["exact"] is True


def test_a_bad_factory_spec_is_refused_clearly() -> None:
    done = check("check_pipelines.good")
    assert done.returncode != 0 and "is not MODULE:FACTORY" in done.stderr


def test_an_order_no_seed_reaches_is_caught_on_resume_and_on_rescale() -> None:
    done = check("check_pipelines:unstable_order", "--epochs", "1", "--cuts", "2", "--workers", "0",
                 "--worlds", "2,3")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cut after    2 batches, num_workers 0 -> 0: DIVERGES at batch 2")
    assert lines[1].startswith("cut after    2 batches, world size 1 -> 2: WRONG: samples ")
    assert lines[2].startswith("cut after    2 batches, world size 1 -> 3: WRONG: samples ")


def test_a_resumable_factory_is_really_run_at_the_other_worker_count() -> None:
    """The factory returns a ResumableDataLoader(num_workers=2) whose values depend on the worker
    count: 2 -> 2 is exact and 2 -> 0 must diverge (it did not when the other count was silently
    ignored)."""
    done = check(
        "check_pipelines:resumable_unkeyed",
        "--epochs",
        "1",
        "--cuts",
        "2",
        "--worlds",
        "",
        "--json",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    by_workers = {s["resume_workers"]: s for s in json.loads(done.stdout)}
    assert by_workers[2]["exact"] is True
    assert by_workers[0]["exact"] is False and by_workers[0]["fields"] == ["'noise'"]


def test_a_scenario_refused_by_design_is_reported_as_refused_not_a_traceback() -> None:
    done = check("check_pipelines:plain_stream", "--epochs", "1", "--cuts", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "cut after    2 batches, num_workers 2 -> 2: exact" in lines
    refused = [line for line in lines if "num_workers 2 -> 0" in line]
    assert refused and refused[0].startswith(
        "cut after    2 batches, num_workers 2 -> 0: refused: loader state "
        "field 'num_workers': saved 2, expected 0"
    )
    assert (
        lines[-1] == "2 exact, 0 diverging, 1 refused by design" and "Traceback" not in done.stderr
    )


def test_a_mixture_with_a_weight_schedule_resumes_exactly_in_every_scenario() -> None:
    """The schedule runs after every batch of every run (--after-batch); 20 batches an epoch,
    weights changed after batches 2 and 4: cuts before, between and after the changes and over the
    epoch boundary, resumed with the same 2 workers and over 2 ranks. (With another num_workers, a
    change made after the resume applies after that run's own prefetched batches: the check reports
    those batches as diverging, as they do.)"""
    done = check(
        "check_pipelines:mixture",
        "--epochs",
        "2",
        "--cuts",
        "1,3,10,19,20,21",
        "--workers",
        "2",
        "--after-batch",
        "check_pipelines:mixture_schedule",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "18 exact, 0 diverging"
    assert "cut after    3 batches, num_workers 2 -> 2: exact" in lines  # between the changes
    assert "cut after   10 batches, world size 1 -> 2: the rest of the epoch exactly once" in lines


def test_a_schedule_that_does_not_follow_the_step_is_caught() -> None:
    """Counting its own calls, the schedule restarts in the resumed process: its second change comes
    3 batches late (after the prefetched batches: from batch 8 on), and the check names the first
    batch that differs."""
    done = check(
        "check_pipelines:mixture",
        "--epochs",
        "1",
        "--cuts",
        "3",
        "--workers",
        "2",
        "--worlds",
        "",
        "--after-batch",
        "check_pipelines:mixture_schedule_by_own_count",
        "--json",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    (scenario,) = json.loads(done.stdout)
    assert scenario["exact"] is False and scenario["diverged_at"] == 8 and scenario["fields"]


def test_a_state_right_once_and_wrong_after_a_resume_is_caught_by_the_second_cut() -> None:
    """A stream whose loaded state sets its start but whose state after that counts from it: the
    resume is exact, the job cut again after that resume repeats batches (a job preempted twice)."""
    done = check(
        "check_pipelines:counts_since_load", "--epochs", "1", "--cuts", "2", "--workers", "0"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "cut after    2 batches, num_workers 0 -> 0: exact"
    assert lines[1].startswith(
        "cut after    2 batches, num_workers 0 -> 0, cut again after 3: DIVERGES at batch 3 "
        "(epoch 0)"
    )
