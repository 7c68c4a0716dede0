"""``RayResume`` in real Ray Train jobs: ``TorchTrainer`` with 2 CPU workers (gloo) on a local Ray
cluster that the tests share (Ray's start-up is slow).

- A worker killed mid-epoch (``os._exit(1)``) and restarted by Ray
  (``FailureConfig(max_failures=...)``) from the last checkpoint Ray registered: every step's batch
  (ids, and values with augmentations drawn from torch, numpy and random) equals the uninterrupted
  run's — a step replayed after the restart (Ray registers a checkpoint reported just before a crash
  late, or never) is the same batch again — and so are the final weights; with ``num_workers`` 0 and
  2 inside each Ray worker.
- A loop that leaves its passes early, cut at the step it leaves one: the restart leaves it too.
- A job that failed, run again under the same ``RunConfig(name)`` on 1 worker: the rest of the epoch
  exactly once.
- ``storage_path`` on a disk that fills up: the job fails naming it; the rerun continues exactly.
- A checkpoint missing a rank's file: refused, naming it.
- ``prepare_data_loader`` (its default, and ``add_dist_sampler=False``): refused, never silently
  wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import ray

# the main suite's storage faults
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from train_loop import ITEMS, fit, rows, steps, when

from support.mounts import fill, tmpfs

# a Ray job takes tens of seconds on 2 cores; the fixtures run several
pytestmark = pytest.mark.timeout(900)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Any:
    path = f"{ROOT / 'core'}:{ROOT}:{HERE}"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    runs = {}
    for workers in (0, 2):
        runs[workers] = tmp_path_factory.mktemp(f"full{workers}")
        assert fit(runs[workers] / "logs", runs[workers] / "storage", workers=workers) is None
    return runs


@pytest.mark.parametrize(("workers", "every"), [(0, 2), (2, 2), (0, 5)])
def test_a_worker_killed_mid_epoch_and_restarted_by_ray_continues_with_the_uninterrupted_batches(
    uninterrupted: dict[int, Path], tmp_path: Path, workers: int, every: int
) -> None:
    """Rank 1 ends its process 3 s after step 7 (of 10; mid second epoch), time for Ray to register
    the last checkpoint: step 6, or (every 5) step 5, the first epoch's last, reported after the
    epoch's scheduler step."""
    assert (
        fit(
            tmp_path / "logs",
            tmp_path / "storage",
            workers=workers,
            every=every,
            max_failures=2,
            crash_at=(1, 7),
            crash_delay=3.0,
        )
        is None
    )
    assert (tmp_path / "logs" / "crashed").read_text() == "7"
    attempts = rows(tmp_path / "logs", 0)  # the first, and Ray's restart
    assert len(attempts) == 2 and attempts[1][0]["step"] == (6 if every == 5 else 7)
    reference = uninterrupted[workers] / "logs"
    for rank in range(2):
        assert steps(tmp_path / "logs", rank) == steps(reference, rank)
        assert sorted(steps(reference, rank)) == list(range(1, 11))
    assert (tmp_path / "logs" / "weights.txt").read_text() == (
        reference / "weights.txt"
    ).read_text()


def test_a_loop_that_leaves_its_passes_early_resumes_from_a_checkpoint_at_the_pass_it_left(
    tmp_path: Path,
) -> None:
    """Each epoch leaves its pass after 4 of its 5 steps; rank 1 ends its process 3 s after step 4,
    the first pass's last step and a checkpoint: the restart leaves that pass too, and the next
    epoch starts afresh."""
    reference, cut = tmp_path / "reference", tmp_path / "cut"
    assert fit(reference / "logs", reference / "storage", limit=4) is None
    assert (
        fit(
            cut / "logs", cut / "storage", limit=4, max_failures=1, crash_at=(1, 4), crash_delay=3.0
        )
        is None
    )
    attempts = rows(cut / "logs", 0)
    assert len(attempts) == 2 and attempts[1][0]["step"] == 5
    for rank in range(2):
        assert steps(cut / "logs", rank) == steps(reference / "logs", rank)
        assert sorted(steps(reference / "logs", rank)) == list(range(1, 9))
    assert (cut / "logs" / "weights.txt").read_text() == (
        reference / "logs" / "weights.txt"
    ).read_text()


def test_a_failed_job_run_again_on_one_worker_delivers_the_rest_of_the_epoch_exactly_once(
    tmp_path: Path,
) -> None:
    """2 workers, the job fails after step 7 (no retries); the same RunConfig on 1 worker resumes
    from the last registered checkpoint (step 6: one step into epoch 2) and delivers the rest of
    epoch 2, every sample once."""
    assert "Training failed due to worker errors" in (fit(tmp_path / "logs2", tmp_path / "storage",
                                                           crash_at=(1, 7), crash_delay=1.5) or "")
    assert fit(tmp_path / "logs1", tmp_path / "storage", num_workers=1) is None
    saved = min(steps(tmp_path / "logs1", 0)) - 1  # the checkpoint Ray registered (its step)
    assert saved in (2, 4, 6)
    for epoch in (0, 1):
        before = [
            ids
            for rank in range(2)
            for step, (at, ids, _, _) in steps(tmp_path / "logs2", rank).items()
            if step <= saved and at == epoch
        ]
        after = [ids for at, ids, _, _ in steps(tmp_path / "logs1", 0).values() if at == epoch]
        assert sorted(i for batch in before + after for i in batch) == list(range(ITEMS)), epoch


def test_a_full_disk_under_storage_path_fails_the_job_and_the_rerun_continues_exactly(
    uninterrupted: dict[int, Path], tmp_path: Path
) -> None:
    """``storage_path`` on a small tmpfs that fills after step 5: the report of step 6's checkpoint
    fails (the job with it, no retries). Space freed, the same run again continues from a complete
    registered checkpoint."""
    storage, logs = tmp_path / "storage", tmp_path / "logs"
    with tmpfs(storage, "16m"):
        filled = tmp_path / "filled"  # the workers wait after step 5 until the disk is full

        def fill_up(node: str) -> None:
            fill(storage / "filler")
            filled.write_text("")

        filler = when(logs, 0, 5, fill_up)
        error = fit(logs, storage, gate=[5, str(filled)]) or ""
        filler.join(timeout=60)
        assert "No space left on device" in error, error[-3000:]
        (storage / "filler").unlink()
        assert fit(logs, storage) is None
    attempts = rows(logs, 0)
    assert len(attempts) == 2 and attempts[1][0]["step"] in (3, 5)
    reference = uninterrupted[0] / "logs"
    for rank in range(2):
        assert steps(logs, rank) == steps(reference, rank)
    assert (logs / "weights.txt").read_text() == (reference / "weights.txt").read_text()


def test_a_checkpoint_missing_a_ranks_file_is_refused_naming_it(tmp_path: Path) -> None:
    assert fit(tmp_path / "logs", tmp_path / "storage", epochs=1) is None
    latest = sorted((tmp_path / "storage" / "run").glob("step_*"))[-1]
    (latest / "loader_resume_rank_1.pt").unlink()
    again = fit(tmp_path / "again", tmp_path / "storage", epochs=1) or ""
    assert "loader_resume_rank_1.pt missing; the run that wrote it had 2 ranks" in again


@pytest.mark.parametrize(
    ("prepare", "give_prepared", "expected"),
    [
        ("default", False, "none of its loaders handed out a batch"),
        ("default", True, "a loader from ray.train.torch.prepare_data_loader"),
        (
            "no-sampler",
            False,
            "iterated through ray.train.torch.prepare_data_loader's wrapper, which reads a batch",
        ),
    ],
)
def test_a_loader_through_prepare_data_loader_is_refused_never_resumed_wrongly(
    tmp_path: Path, prepare: str, give_prepared: bool, expected: str
) -> None:
    """By default Ray builds another loader with a DistributedSampler (another order, a position
    nobody saves); with ``add_dist_sampler=False`` its wrapper reads a batch ahead (a resume would
    skip one)."""
    error = fit(
        tmp_path / "logs",
        tmp_path / "storage",
        epochs=1,
        prepare=prepare,
        give_prepared=give_prepared,
    )
    assert expected in (error or "")
