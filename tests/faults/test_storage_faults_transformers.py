"""``ResumableTrainer`` (the transformers Trainer) under real storage faults: its ``output_dir`` on
a small tmpfs that fills up, or read-only under a bind mount; a second real job on the same
``output_dir``; a checkpoint whose bytes were changed or cut on disk.

The child (``tests/children/transformers_child.py``) checkpoints every step and keeps two; one
optimizer step is one micro-batch per rank here, so a rank's batch log has one line per step.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from loader_resume.job.checkpoint import CHECKPOINT_FORMAT
from loader_resume.job.checkpoint_dir import FAILED_SAVE_EXIT_CODE
from support import forked
from support.batch import Done, run_batch
from support.launch import forked_ranks, logs, weights
from support.mounts import read_only, tmpfs
from support.trainer_launch import CHILD, ENV, command, run


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Uninterrupted runs on one and two processes."""
    runs = {}
    for processes in (1, 2):
        runs[processes] = tmp_path_factory.mktemp(f"trainer-full{processes}")
        run(runs[processes], processes)
    return runs


def checkpoints(out: Path) -> list[str]:
    return sorted(
        (path.name for path in (out / "run").glob("checkpoint-*")), key=lambda name: int(name[11:])
    )


def keep_steps(out: Path, steps: int) -> None:
    """Cut each rank's batch log back to its first ``steps`` steps (what a resume from
    ``checkpoint-<steps>`` does again)."""
    for log in out.glob("log-*.jsonl"):
        log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:steps]))


def test_a_preemption_save_on_a_full_disk_exits_74_on_every_rank_and_the_rerun_continues_exactly(
    full: dict[int, Path], tmp_path: Path
) -> None:
    """The disk fills at the end of step 5, when rank 0 also gets SIGTERM: the agreed checkpoint-5
    cannot be written. Every rank says so and exits 74 (never 143, "written, resumable"); no partial
    checkpoint-5 stays; the same command continues from checkpoint-4 with the uninterrupted run's
    batches and weights."""
    same = ["--resume", "true"]
    with tmpfs(tmp_path / "run", "2m"):
        stderr = run(
            tmp_path,
            2,
            *same,
            "--fill-disk-at",
            "5",
            "--signal-at",
            "5",
            expect=FAILED_SAVE_EXIT_CODE,
        )
        assert stderr.count("the checkpoint at step 5 could NOT be written") == 2, stderr[-4000:]
        assert "exiting with 74, not 143" in stderr and "exiting with 143" not in stderr
        assert (
            "no space left on device" in stderr and f"{tmp_path / 'run' / 'checkpoint-5'}" in stderr
        )
        assert checkpoints(tmp_path) == ["checkpoint-3", "checkpoint-4"]
        (tmp_path / "run" / "filler").unlink()
        keep_steps(tmp_path, 4)
        run(tmp_path, 2, *same)
    assert logs(tmp_path) == logs(full[2]) and weights(tmp_path) == weights(full[2])


def test_a_periodic_save_on_a_full_disk_stops_every_rank_naming_the_cause_and_leaves_the_one_before(
    tmp_path: Path
) -> None:
    """As Trainer fails on a save that fails, but agreed: every rank stops with the path and the
    cause, nothing partial stays, the checkpoints before are whole."""
    with tmpfs(tmp_path / "run", "2m"):
        stderr = run(tmp_path, 2, "--fill-disk-at", "5", expect=1)
        assert stderr.count("checkpoint at step 5 NOT written to") == 2, stderr[-4000:]
        assert "(no space left on device, or over quota: " in stderr
        assert "CheckpointError" in stderr and "the newest complete checkpoint is still" in stderr
        assert checkpoints(tmp_path) == ["checkpoint-3", "checkpoint-4"]


def test_an_output_dir_that_cannot_be_written_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with read_only(directory):
        stderr = run(tmp_path, 2, expect=1)
    assert f"checkpoint directory {directory} cannot be written" in stderr, stderr[-4000:]
    assert "Read-only file system" in stderr
    # refused before training
    assert all(not log.read_text() for log in tmp_path.glob("log-*.jsonl"))


def test_a_second_job_on_an_output_dir_in_use_is_refused_and_a_killed_one_blocks_nothing(
    full: dict[int, Path], tmp_path: Path
) -> None:
    first = forked.popen(
        command(tmp_path, 1, "--sleep", "1", "--resume", "true"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 120
        while (
            not (tmp_path / "log-0.jsonl").is_file() or not (tmp_path / "log-0.jsonl").read_text()
        ):
            assert time.monotonic() < deadline and first.poll() is None, (
                "the first job never trained"
            )
            time.sleep(0.05)
        second = tmp_path / "second"
        second.mkdir()
        (second / "run").symlink_to(tmp_path / "run")  # another job, the same output_dir
        stderr = run(second, 1, "--resume", "true", expect=1)
        assert f"checkpoint directory {tmp_path / 'run'} is in use by another job" in stderr, (
            stderr[-4000:]
        )
        assert f"pid {first.pid} on " in stderr
        assert first.poll() is None and not (second / "log-0.jsonl").read_text()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    done = [
        name
        for name in checkpoints(tmp_path)
        if (tmp_path / "run" / name / "trainer_state.json").is_file()
    ]
    keep_steps(tmp_path, int(done[-1][11:]))
    run(tmp_path, 1, "--resume", "true")  # the killed job's lock is gone with it
    assert logs(tmp_path) == logs(full[1]) and weights(tmp_path) == weights(full[1])


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process crashed right after the checkpoint of step 10 (checkpoints 9 and 10 kept)."""
    out = tmp_path_factory.mktemp("trainer-crashed")
    run(out, 1, "--crash-at", "10")
    return out


DAMAGES = [
    ("optimizer.pt", "flip", "does not match the CRC-32 stored"),
    ("loader_resume_0.pt", "flip", "does not match the CRC-32 stored"),
    ("model.safetensors", "cut", "model.safetensors"),
    ("trainer_state.json", "cut", "trainer_state.json"),
    (
        "loader_resume_0.pt",
        "format",
        f"format 99; expected {CHECKPOINT_FORMAT} (written by another",
    ),
]


def damage(path: Path, how: str) -> None:
    """``flip``: one bit in the middle of the largest record of a ``torch.save`` zip file (its data,
    not the padding between records); ``cut``: the file's second half gone; ``format``: rewritten as
    another release's."""
    if how == "format":  # a whole file another release wrote
        state = torch.load(path, weights_only=True)
        torch.save(dict(state, format=99), path)
        return
    data = bytearray(path.read_bytes())
    if how == "flip":
        with zipfile.ZipFile(path) as archive:
            largest = max(archive.infolist(), key=lambda info: info.compress_size)
        names, extra = struct.unpack(
            "<HH", data[largest.header_offset + 26 : largest.header_offset + 30]
        )
        data[largest.header_offset + 30 + names + extra + largest.compress_size // 2] ^= 0x01
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def damaged(
    crashed: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Done, Done]]:
    """For each damage, a copy of the crashed run with that file of its newest checkpoint
    (checkpoint-10) damaged: a resume naming that checkpoint, then an automatic resume (its batch
    log cut back to step 9, which it does again). Every one of these runs in one fresh process
    (tests/support/batch.py), in this order."""
    root = tmp_path_factory.mktemp("damaged")
    runs = []
    for file, how, _ in DAMAGES:
        out = root / f"{file}-{how}"
        shutil.copytree(crashed, out)
        newest = out / "run" / "checkpoint-10"
        damage(newest / file, how)
        keep_steps(out, 9)
        runs += [[str(out / "named"), "--processes", "1", "--resume", str(newest)],
                 [str(out), "--processes", "1", "--resume", "true"]]
    done = run_batch(CHILD, runs, root / "batch")
    return {f"{file}-{how}": (root / f"{file}-{how}", done[2 * index], done[2 * index + 1])
            for index, (file, how, _) in enumerate(DAMAGES)}


@pytest.mark.parametrize(("file", "how", "named"), DAMAGES)
def test_a_damaged_newest_checkpoint_is_passed_over_at_an_automatic_resume_and_refused_when_named(
    full: dict[int, Path],
    damaged: dict[str, tuple[Path, Done, Done]],
    file: str,
    how: str,
    named: str,
) -> None:
    out, refused, resumed = damaged[f"{file}-{how}"]
    newest = out / "run" / "checkpoint-10"
    assert refused.returncode == 1, refused.stderr[-4000:]
    assert f"CheckpointError: {newest / file}: " in refused.stderr and named in refused.stderr, (
        refused.stderr[-4000:]
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"skipping {newest}: {newest / file}: " in resumed.stderr, resumed.stderr[-4000:]
    assert logs(out) == logs(full[1]) and weights(out) == weights(full[1])


def _write_on_rank(rank: int, store: str, failures: dict[int, tuple[int, str]], out: str) -> None:
    """One rank's write of three parts with a point after each of the first two (as
    ResumableTrainer's: the model, the last per-rank file); ``failures[rank]``: before which part
    this rank fails, and how."""
    import errno

    import torch.distributed as dist

    from loader_resume.distributed import any_rank
    from transformers_resume.saving import AgreedWrite, SaveFailed

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    directory = Path(out, "checkpoint-5")
    written: list[int] = []
    write = AgreedWrite(any_rank)

    def parts() -> None:
        directory.mkdir(exist_ok=True)
        for part in range(3):
            part_fails, how = failures.get(rank, (-1, ""))
            if part == part_fails:
                raise (
                    OSError(errno.ENOSPC, "No space left on device")
                    if how == "disk"
                    else ValueError("a bug")
                )
            written.append(part)
            if part < 2:
                write.point()
    try:
        write.run(
            parts, directory, main=rank == 0, step=5, newest=lambda: Path(out, "checkpoint-4")
        )
        outcome = "written"
    except SaveFailed as failed:
        outcome = f"SaveFailed: {failed}"
    except ValueError as error:
        outcome = f"ValueError: {error}"
    finally:
        dist.destroy_process_group()
    Path(out, f"outcome-{rank}").write_text(f"{written} {outcome}")


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        ({}, ["[0, 1, 2] written"] * 2),
        (
            {0: (0, "disk")},
            [
                "[] SaveFailed: checkpoint at step 5 NOT written to {d}: OSError: [Errno 28] No "
                "space left on device (no space left on device, or over quota",
                "[0] SaveFailed: checkpoint at step 5 NOT written to {d}: it failed on another "
                "process; the newest complete checkpoint is still {o}",
            ],
        ),
        (
            {1: (2, "disk")},
            [
                "[0, 1, 2] SaveFailed: checkpoint at step 5 NOT written to {d}: it failed on "
                "another process",
                "[0, 1] SaveFailed: checkpoint at step 5 NOT written to {d}: OSError: [Errno 28]",
            ],
        ),
        ({0: (1, "disk"), 1: (0, "disk")}, ["[0] SaveFailed: ", "[] SaveFailed: "]),
        (
            {1: (1, "bug")},
            [
                "[0, 1] SaveFailed: checkpoint at step 5 NOT written to {d}: it failed on another "
                "process",
                "[0] ValueError: a bug",
            ],
        ),
    ],
)
def test_ranks_failing_at_different_points_of_a_write_all_stop_there_and_nothing_hangs(
    tmp_path: Path, failures: dict[int, tuple[int, str]], expected: list[str]
) -> None:
    """Two real gloo processes; a rank fails before one part of the write (a full disk, or a bug),
    the other goes on to the next point: both learn it there, the partial directory is gone, a bug
    is raised as itself."""
    import transformers_resume.saving  # noqa: F401 (imported once, before the ranks are forked)

    forked_ranks(_write_on_rank, str(tmp_path / "store"), failures, str(tmp_path))
    for rank, start in enumerate(expected):
        start = start.format(d=tmp_path / "checkpoint-5", o=tmp_path / "checkpoint-4")
        assert (tmp_path / f"outcome-{rank}").read_text().startswith(start), (
            tmp_path / f"outcome-{rank}"
        ).read_text()
    assert (tmp_path / "checkpoint-5").is_dir() == (not failures)
