"""SLURM for real: a one-node cluster of Debian's ``slurmctld``, ``slurmd`` and ``munge``
(``tests/support/slurm.py``) runs batch jobs (``sbatch --requeue``, the training step under
``srun``) and signals them as SLURM does: the time-limit warning (``--signal=USR1@SECONDS``),
``scancel --signal=USR1`` and an administrator's ``scontrol requeue``. Through the Lightning
``Trainer`` (its ``SLURMEnvironment`` requeue kept by ``ResumeCallback``) and a hand-written
Accelerate loop (``slurm_requeue=true``): the job checkpoints at a step boundary, SLURM requeues it,
and the requeued job continues with the uninterrupted run's batches and ends with its weights.

A requeued batch job waits for its ``BeginTime`` (about two minutes on); the tests start it at once
with ``scontrol update JobId=N StartTime=now``, as an administrator may.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.launch import CHILDREN, progress_of
from support.reference import accelerate_run, child_run
from support.slurm import Cluster, cluster

LONG = ["--epochs", "40"]  # 320 steps: long enough to be running when the time-limit warning comes


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def batch_script(out: Path, command: list[str]) -> str:
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --output={out}/slurm-%j.out",
            "#SBATCH --open-mode=append",
            f"srun {' '.join(command)}",
            "",
        ]
    )


def lightning_job(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(CHILDREN / "lightning_child.py"), str(out), "--append", *args]


def accelerate_job(out: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        str(CHILDREN / "accelerate_child.py"),
        str(out),
        *args,
        "slurm_requeue=true",
    ]


def requeued_to_the_end(slurm: Cluster, job: int, out: Path) -> dict[str, str]:
    """The job run to its end, started at once whenever it is requeued; it must complete. Its last
    fields."""
    fields = slurm.to_the_end(job)
    assert fields["JobState"] == "COMPLETED", (
        fields,
        [p.read_text()[-3000:] for p in out.glob("slurm-*.out")],
    )
    return fields


def signal_when(slurm: Cluster, out: Path, step: int, *command: str) -> None:
    deadline = time.monotonic() + 180
    while progress_of(out / "progress-0") < step:
        assert time.monotonic() < deadline, "training never reached the step"
        time.sleep(0.05)
    slurm.run(*command)


def same(out: Path, reference: Path, *names: str) -> None:
    for name in names:
        assert (out / name).read_text() == (reference / name).read_text(), name


def test_lightning_the_time_limit_warning_requeues_and_the_requeued_job_continues_exactly(
    slurm: Cluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``sbatch --requeue --time=2 --signal=USR1@60``: SLURM sends SIGUSR1 to the step between 60
    and 90 s before the limit; the Trainer checkpoints at the next step and requeues (Lightning's
    auto-requeue, kept)."""
    out = tmp_path / "job"
    out.mkdir()
    job = slurm.submit(
        batch_script(out, lightning_job(out, "--sleep", "0.3", *LONG)),
        "--requeue",
        "--time=2",
        "--signal=USR1@60",
    )
    fields = requeued_to_the_end(slurm, job, out)
    assert int(fields["Restarts"]) >= 1
    same(
        out, child_run(tmp_path_factory, "lightning_child.py", *LONG), "log-0.json", "weights-0.txt"
    )


def test_lightning_scancel_signal_usr1_requeues_and_the_requeued_job_continues_exactly(
    slurm: Cluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path / "job"
    out.mkdir()
    job = slurm.submit(batch_script(out, lightning_job(out, "--sleep", "0.2")), "--requeue")
    signal_when(slurm, out, 5, "scancel", "--signal=USR1", str(job))
    fields = requeued_to_the_end(slurm, job, out)
    assert fields["Restarts"] == "1"
    same(
        out,
        child_run(tmp_path_factory, "lightning_child.py", "--every", "3"),
        "log-0.json",
        "weights-0.txt",
    )


@pytest.mark.parametrize("how", ["scancel --signal=USR1", "scontrol requeue"])
def test_accelerate_a_signal_or_an_administrators_requeue_and_the_requeued_job_continues_exactly(
    slurm: Cluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, how: str
) -> None:
    """``scancel --signal=USR1``: the loop checkpoints and requeues itself (``slurm_requeue=true``).
    An administrator's ``scontrol requeue``: SLURM sends the job SIGTERM and requeues it; the loop
    checkpoints and exits 143."""
    out = tmp_path / "job"
    job = slurm.submit(batch_script(out, accelerate_job(out, "--sleep", "0.2")), "--requeue")
    out.mkdir(exist_ok=True)
    signal_when(slurm, out, 5, *how.split(), str(job))
    fields = requeued_to_the_end(slurm, job, out)
    assert fields["Restarts"] == "1"
    # the one checkpoint: the signal's, mid-run
    (written,) = (out / "resume_checkpoints").glob("step_*")
    assert 5 <= int(written.name[5:]) < 24
    same(out, accelerate_run(tmp_path_factory, 1), "log-0.jsonl", "weights-0.txt")
