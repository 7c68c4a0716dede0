"""Checkpoints under real storage faults (issue: a full disk, a read-only mount, a double launch,
flipped bits).

Accelerate jobs (``tests/children/accelerate_child.py``, one process or two under ``accelerate
launch``) whose checkpoint directory is a small tmpfs that fills up, or turns read-only under a bind
mount; a second real job on the same directory; bytes flipped on disk. The core's atomic write under
the same faults: ``torch.save``, safetensors and plain writes into a full tmpfs, and two real
processes writing the same checkpoint names at once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loader_resume.job.checkpoint import (
    CHECKPOINT_FORMAT,
    MANIFEST,
    complete_checkpoints,
    is_temporary,
    verify,
    write_sealed,
)
from loader_resume.job.checkpoint_dir import (
    FAILED_SAVE_EXIT_CODE,
    CheckpointDirectoryError,
    DirectoryLock,
)
from support import forked
from support.batch import Done, run_batch
from support.launch import CHILDREN, command, forked_ranks, logs, progress_of, run, trained, weights
from support.mounts import read_only, tmpfs
from support.reference import accelerate_run, child_run


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Uninterrupted runs on 1 and 2 processes (made once per session: other modules compare with
    them too)."""
    return {processes: accelerate_run(tmp_path_factory, processes) for processes in (1, 2)}


def checkpoints(out: Path) -> list[str]:
    return [path.name for path in complete_checkpoints(out / "resume_checkpoints")]


def leftovers(out: Path) -> list[str]:
    return [path.name for path in (out / "resume_checkpoints").iterdir() if is_temporary(path)]


def after(rows: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return [row for row in trained(rows) if row["step"] > step]


def test_a_preemption_save_on_a_full_disk_exits_74_on_every_rank_and_the_rerun_continues_exactly(
    full: dict[int, Path], tmp_path: Path
) -> None:
    """The disk fills after step 7's batch; the agreed save at the signal fails: never reported as
    written, no exit 143, nothing partial left. The rerun continues from the newest complete
    checkpoint (step 6)."""
    with tmpfs(tmp_path / "resume_checkpoints", "2m"):
        stderr = run(tmp_path, 2, "--fill-disk-at", "7", "--signal-at", "7", "save_every_n_steps=3",
                     expect=FAILED_SAVE_EXIT_CODE)
        assert stderr.count("could NOT be written") == 2 and "exiting with 74, not 143" in stderr, (
            stderr[-3000:]
        )
        assert "checkpoint written at step 7" not in stderr
        assert (
            "no space left on device" in stderr and str(tmp_path / "resume_checkpoints") in stderr
        )
        assert (
            checkpoints(tmp_path) == ["step_000000003", "step_000000006"]
            and leftovers(tmp_path) == []
        )
        (tmp_path / "resume_checkpoints" / "filler").unlink()
        run(tmp_path, 2, "--log-dir", "rerun")
    assert logs(tmp_path / "rerun") == [after(rows, 6) for rows in logs(full[2])]
    assert weights(tmp_path / "rerun") == weights(full[2])


def test_periodic_saves_on_a_full_disk_are_logged_with_the_cause_and_training_goes_on(
    full: dict[int, Path], tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "resume_checkpoints", "2m"):
        stderr = run(tmp_path, 2, "--fill-disk-at", "7", "save_every_n_steps=3")
        assert stderr.count("checkpoint at step 9 NOT written to") == 2, stderr[-3000:]
        assert "(no space left on device, or over quota: " in stderr
        assert (
            checkpoints(tmp_path) == ["step_000000003", "step_000000006"]
            and leftovers(tmp_path) == []
        )
    assert logs(tmp_path) == logs(full[2]) and weights(tmp_path) == weights(full[2])


def test_a_save_whose_directory_vanishes_leaves_nothing_and_training_goes_on(
    full: dict[int, Path], tmp_path: Path
) -> None:
    stderr = run(tmp_path, 1, "--vanish-at", "6", "save_every_n_steps=3")
    assert "checkpoint at step 6 NOT written to" in stderr, stderr[-3000:]
    assert (
        checkpoints(tmp_path) == ["step_000000018", "step_000000021"] and leftovers(tmp_path) == []
    )
    assert logs(tmp_path) == logs(full[1]) and weights(tmp_path) == weights(full[1])


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_at_start_naming_it(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "resume_checkpoints"
    with read_only(directory):
        stderr = run(tmp_path, 2, expect=1)
    assert f"checkpoint directory {directory} cannot be written" in stderr, stderr[-3000:]
    assert "Read-only file system" in stderr and "refused on the main process" in stderr
    assert not list(tmp_path.glob("log-*.jsonl"))  # refused before training


def test_a_directory_turned_read_only_mid_run_makes_the_preemption_save_fail_loudly(
    tmp_path: Path,
) -> None:
    """The issue's case: periodic saves fail on a read-only mount, then SIGTERM: exit 74, never
    143."""
    job = forked.popen(
        command(tmp_path, 1, "--sleep", "0.1", "save_every_n_steps=2"),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while progress_of(tmp_path / "progress-0") < 3:
        assert time.monotonic() < deadline and job.poll() is None, "training never reached step 3"
        time.sleep(0.02)
    with read_only(tmp_path / "resume_checkpoints"):
        time.sleep(0.5)  # a periodic save or two fail meanwhile
        os.killpg(job.pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    assert job.returncode == FAILED_SAVE_EXIT_CODE, stderr[-3000:]
    assert (
        "NOT written" in stderr
        and "Read-only file system" in stderr
        and "could NOT be written" in stderr
    )
    assert "exiting with 143" not in stderr
    # the saves before the mount are whole
    assert leftovers(tmp_path) == [] and checkpoints(tmp_path)


def test_a_second_job_on_a_directory_in_use_is_refused_by_name_and_a_killed_one_blocks_nothing(
    full: dict[int, Path], tmp_path: Path
) -> None:
    first = forked.popen(
        command(tmp_path, 1, "--sleep", "1", "save_every_n_steps=2"),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while progress_of(tmp_path / "progress-0") < 2:
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 2"
        time.sleep(0.02)
    second = forked.run(
        command(tmp_path, 1, "--log-dir", "second"), capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 1, second.stderr[-3000:]
    holder = (tmp_path / "pid-0").read_text()
    assert f"is in use by another job (pid {holder} on " in second.stderr, second.stderr[-3000:]
    assert first.poll() is None  # the first job goes on, undisturbed
    os.killpg(first.pid, signal.SIGKILL)  # then dies without a word: its lock goes with it
    first.communicate()
    stale = tmp_path / "resume_checkpoints" / ".step_000000099.tmp-1234-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a model")
    started = time.monotonic()
    stderr = run(tmp_path, 1, "--log-dir", "rerun")
    assert time.monotonic() - started < 60 and "in use" not in stderr
    assert f"deleting {stale}: left by a write interrupted in an earlier job" in stderr
    assert leftovers(tmp_path) == [] and weights(tmp_path / "rerun") == weights(full[1])


def test_an_automatic_resume_skips_a_corrupted_newest_checkpoint_for_the_one_before(
    full: dict[int, Path], tmp_path: Path
) -> None:
    run(tmp_path, 1, "--signal-at", "12", "save_every_n_steps=5", "keep=3", expect=143)
    assert checkpoints(tmp_path) == ["step_000000005", "step_000000010", "step_000000012"]
    newest = tmp_path / "resume_checkpoints" / "step_000000012"
    model = next(newest.glob("model*"))
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in a weight
    model.write_bytes(bytes(data))
    stderr = run(tmp_path, 1, "--log-dir", "rerun")
    assert (
        f"skipping checkpoint {newest}: {model}:" in stderr
        and "does not match the manifest" in stderr
    )
    assert (
        f"resuming from {tmp_path / 'resume_checkpoints' / 'step_000000010'}, the newest" in stderr
    )
    assert logs(tmp_path / "rerun") == [after(rows, 10) for rows in logs(full[1])]
    assert weights(tmp_path / "rerun") == weights(full[1])


# --- the core's atomic write ----------------------------------------------------------------------
def _save_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(1 << 20)}, str(path / "model.safetensors"))


def _save_torch(path: Path) -> None:
    torch.save({"weight": torch.ones(1 << 20)}, path / "optimizer.bin")


def _save_plain(path: Path) -> None:
    (path / "plain.bin").write_bytes(bytes(4 << 20))


@pytest.mark.parametrize("writer", [_save_torch, _save_safetensors, _save_plain])
def test_any_write_failure_on_a_full_disk_leaves_no_temporary_and_the_previous_checkpoint(
    tmp_path: Path, writer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.save fails with RuntimeError on a full disk, safetensors with its own error, plain
    writes with OSError: each is a failed save, agreed, logged with the cause."""
    root = tmp_path / "checkpoints"
    with tmpfs(root, "2m"):
        assert write_sealed(
            root / "step_000000001",
            lambda d: (d / "small.txt").write_text("x"),
            main=True,
            agree=lambda flag: flag,
            step=1,
        )
        with caplog.at_level(logging.ERROR):
            written = write_sealed(
                root / "step_000000002", writer, main=True, agree=lambda flag: flag, step=2
            )
        assert not written
        assert (
            "checkpoint at step 2 NOT written to" in caplog.text
            and "no space left on device" in caplog.text
        )
        assert sorted(path.name for path in root.iterdir()) == ["step_000000001"]
        verify(root / "step_000000001")


def _sealed_on_rank(rank: int, out: str, fails: str) -> None:
    import torch.distributed as dist

    from loader_resume.distributed import any_rank

    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{out}/store", 2), rank=rank, world_size=2
    )

    def write(directory: Path) -> None:
        if rank == 1 and fails == "disk":
            raise OSError(errno.ENOSPC, "No space left on device")
        if rank == 1 and fails == "bug":
            raise ValueError("a bug")
        (directory / f"rank{rank}.txt").write_text("x")
    try:
        outcome = str(
            write_sealed(
                Path(out, "step_000000005"),
                write,
                main=rank == 0,
                agree=any_rank,
                step=5,
                token="t",
            )
        )
    except (ValueError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()
    Path(out, f"outcome-{rank}").write_text(outcome)


@pytest.mark.parametrize(
    ("fails", "expected"),
    [
        ("", ["True", "True"]),
        ("disk", ["False", "False"]),
        (
            "bug",
            [
                "RuntimeError: checkpoint at step 5 NOT written to {out}/step_000000005: another "
                "process failed with an error that is not the storage's (its log names it)",
                "ValueError: a bug",
            ],
        ),
    ],
)
def test_a_write_failing_on_one_of_two_real_ranks_is_agreed_and_a_bug_is_raised_after_the_agreement(
    tmp_path: Path, fails: str, expected: list[str]
) -> None:
    """Two gloo processes, the second fails inside its part (a full disk, or a bug): the first
    learns it at the next agreement instead of waiting forever, the partial directory is removed; a
    bug stops both (raised as itself on its process, named on the other), where a full disk is a
    failed save both return."""
    forked_ranks(_sealed_on_rank, str(tmp_path), fails)
    outcomes = [(tmp_path / f"outcome-{rank}").read_text() for rank in range(2)]
    assert outcomes == [text.format(out=tmp_path) for text in expected]
    assert [path.name for path in complete_checkpoints(tmp_path)] == (
        ["step_000000005"] if not fails else []
    )
    assert not [path for path in tmp_path.iterdir() if is_temporary(path)]


_RACER = """
import sys
from pathlib import Path
from loader_resume.job.checkpoint import write_sealed
root, me = Path(sys.argv[1]), sys.argv[2]
def write(directory):
    for name in ("a", "b", "c", "d"):
        (directory / name).write_text(me * 50000)
for attempt in range(30):
    write_sealed(root / f"step_{attempt % 3:09d}", write, main=True, agree=lambda flag: flag,
                 step=attempt, keep=10)
"""


def test_two_real_writers_of_the_same_names_never_seal_a_mixed_checkpoint(tmp_path: Path) -> None:
    """Without the directory lock (the core's write alone): each write has a directory of its own,
    so a sealed checkpoint holds one writer's four files, never a mix or a part."""
    writers = [
        forked.popen(
            [sys.executable, "-c", _RACER, str(tmp_path), me], stderr=subprocess.PIPE, text=True
        )
        for me in "XY"
    ]
    for writer in writers:
        _, stderr = writer.communicate(timeout=120)
        assert writer.returncode == 0, stderr[-3000:]
    sealed = complete_checkpoints(tmp_path)
    assert len(sealed) == 3
    for checkpoint in sealed:
        verify(checkpoint)
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        assert sorted(manifest["files"]) == ["a", "b", "c", "d"]
        assert len({(checkpoint / name).read_text() for name in "abcd"}) == 1


def test_the_lock_dies_with_its_process_and_is_not_inherited_by_a_fork(tmp_path: Path) -> None:
    """A DataLoader worker forked while the job holds its directory does not keep the lock past the
    job; other code of the holder reading the lock file (an upload of the directory) does not let it
    go."""
    holder = forked.popen(
        [
            sys.executable,
            "-c",
            (
                "import os, sys, time\nfrom pathlib import Path\nfrom "
                "loader_resume.job.checkpoint_dir import LOCK_FILE, "
                "DirectoryLock\nDirectoryLock.acquire(Path(sys.argv[1]))\n"
                # opened and closed by other code of the holder
                "Path(sys.argv[1], LOCK_FILE).read_text()\nif os.fork() == 0:\n    time.sleep(60); "
                "os._exit(0)\n"  # a child that outlives its parent
                "print('held', flush=True); time.sleep(60)\n"
            ),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(
            CheckpointDirectoryError, match=r"is in use by another job \(pid \d+ on "
        ):
            DirectoryLock.acquire(tmp_path, wait=0.5)
        holder.kill()  # the parent only: the forked child lives on
        holder.wait()
        lock = DirectoryLock.acquire(tmp_path, wait=5)
        lock.release()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)


# --- Lightning: ResumeCallback's preemption checkpoint and every checkpoint file Lightning loads
LIGHTNING_CHILD = CHILDREN / "lightning_child.py"


def lightning(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    return forked.run(
        [sys.executable, str(LIGHTNING_CHILD), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def lightning_weights(out: Path) -> list[str]:
    return [path.read_text() for path in sorted(out.glob("weights-*.txt"))]


@pytest.fixture(scope="module")
def lightning_full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted DDP fit (test_lightning.py's too; its checkpoints every 2 steps change
    nothing here)."""
    return child_run(tmp_path_factory, "lightning_child.py", "--devices", "2", "--every", "2")


@pytest.fixture(scope="module")
def lightning_single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted one-device fit, checkpointing every 3 steps."""
    return child_run(tmp_path_factory, "lightning_child.py", "--every", "3")


def test_lightning_a_failed_preemption_save_exits_74_on_both_ranks_and_leaves_nothing(
    lightning_full: Path, tmp_path: Path
) -> None:
    """DDP on two ranks; the callback's directory is a tmpfs that fills after step 5, then SIGTERM:
    no preempted.ckpt, no temporary file, exit 74; the rerun resumes from ModelCheckpoint's
    last.ckpt exactly."""
    out, directory = tmp_path / "job", tmp_path / "resume"
    args = ["--devices", "2", "--resume-dir", str(directory)]
    with tmpfs(directory, "1m"):
        done = lightning(out, *args, "--fill-disk-at", "5", "--signal-at", "5")
        assert done.returncode == FAILED_SAVE_EXIT_CODE, done.stderr[-3000:]
        assert (
            done.stderr.count("could NOT be written") == 2
            and "no space left on device" in done.stderr
        )
        # no preempted.ckpt, no temporary
        assert sorted(path.name for path in directory.iterdir()) == ["filler"]
        (directory / "filler").unlink()
        rerun = lightning(out, *args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (
        f"Restoring states from the checkpoint path at {out / 'ckpt' / 'last.ckpt'}" in rerun.stderr
    )
    assert lightning_weights(out) == lightning_weights(lightning_full)


LIGHTNING_DAMAGES = ["flip", "truncate", "format"]


@pytest.fixture(scope="module")
def lightning_damaged(
    lightning_single: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Done]]:
    """A resume from a copy of the fit's step=6.ckpt, one bit flipped or its second half cut, each:
    one process for both (tests/support/batch.py)."""
    root = tmp_path_factory.mktemp("lightning_damaged")
    runs = []
    for damage in LIGHTNING_DAMAGES:
        target = root / damage / "step=6.ckpt"
        target.parent.mkdir()
        data = bytearray((lightning_single / "ckpt" / "step=6.ckpt").read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        elif damage == "truncate":
            del data[len(data) // 2:]
        target.write_bytes(bytes(data))
        if damage == "format":  # a whole checkpoint whose loader_resume entry another release wrote
            checkpoint = torch.load(target, weights_only=True)
            checkpoint["loader_resume"]["format"] = 99
            torch.save(checkpoint, target)
        runs.append([str(root / damage / "again"), "--resume", str(target)])
    done = run_batch(LIGHTNING_CHILD, runs, root / "batch")
    return {
        damage: (root / damage / "step=6.ckpt", each)
        for damage, each in zip(LIGHTNING_DAMAGES, done, strict=True)
    }


@pytest.mark.parametrize("damage", LIGHTNING_DAMAGES)
def test_lightning_a_changed_or_truncated_checkpoint_is_refused_naming_the_file(
    lightning_damaged: dict[str, tuple[Path, Done]], damage: str
) -> None:
    target, refused = lightning_damaged[damage]
    assert refused.returncode != 0
    expected = {
        "flip": "does not match the CRC-32 stored",
        "truncate": "not a complete torch checkpoint",
        "format": f"['loader_resume']: format 99; expected {CHECKPOINT_FORMAT} (written by another",
    }[damage]
    assert f"CheckpointError: {target}: " in refused.stderr and expected in refused.stderr, (
        refused.stderr[-3000:]
    )


def test_lightning_an_automatic_resume_passes_over_a_corrupted_preemption_checkpoint(
    lightning_single: Path, tmp_path: Path
) -> None:
    out = tmp_path / "job"
    stopped = lightning(out, "--signal-at", "7")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    preempted = out / "preempted.ckpt"
    data = bytearray(preempted.read_bytes())
    data[len(data) // 2] ^= 0x01
    preempted.write_bytes(bytes(data))
    rerun = lightning(out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"skipping checkpoint {preempted} at the automatic resume" in rerun.stderr
    assert (
        f"Restoring states from the checkpoint path at {out / 'ckpt' / 'last.ckpt'}" in rerun.stderr
    )
    assert lightning_weights(out) == lightning_weights(lightning_single)
    # the same, with no other checkpoint to fall back on: refused, not started over
    again = tmp_path / "alone"
    assert lightning(again, "--signal-at", "7").returncode == 143
    shutil.rmtree(again / "ckpt")
    data = bytearray((again / "preempted.ckpt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (again / "preempted.ckpt").write_bytes(bytes(data))
    refused = lightning(again)
    assert (
        refused.returncode != 0 and "there is no other checkpoint to resume from" in refused.stderr
    )


# --- Fabric: FabricResume's checkpoints (the same core write, through fabric.save) ----------------
FABRIC_CHILD = CHILDREN / "fabric_child.py"


def fabric(out: Path, *args: str, expect: int = 0) -> str:
    done = forked.run(
        [sys.executable, str(FABRIC_CHILD), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == expect, done.stderr[-3000:]
    return done.stderr


def test_fabric_a_preemption_save_on_a_full_disk_exits_74_and_a_corrupted_newest_is_passed_over(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    full = child_run(tmp_path_factory, "fabric_child.py", "--devices", "2")  # test_fabric.py's too
    out = tmp_path / "job"
    with tmpfs(out / "resume_checkpoints", "1m"):
        stderr = fabric(
            out,
            "--devices",
            "2",
            "--save-every",
            "3",
            "--fill-disk-at",
            "7",
            "--signal-at",
            "7",
            expect=FAILED_SAVE_EXIT_CODE,
        )
        assert stderr.count("could NOT be written") == 2 and "no space left on device" in stderr
        assert checkpoints(out) == ["step_000000003", "step_000000006"] and leftovers(out) == []
        (out / "resume_checkpoints" / "filler").unlink()
        newest = out / "resume_checkpoints" / "step_000000006" / "checkpoint.ckpt"
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0x01
        newest.write_bytes(bytes(data))
        stderr = fabric(out, "--devices", "2")
    assert f"skipping checkpoint {newest.parent}: {newest}:" in stderr
    assert f"resuming from {out / 'resume_checkpoints' / 'step_000000003'}, the newest" in stderr
    assert weights(out) == weights(full)
