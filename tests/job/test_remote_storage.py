"""Checkpoints on object storage, against a real S3 API server on loopback (moto's,
tests/support/s3.py), and on ``file://`` URLs. Lightning (tests/children/lightning_child.py ``--root
URL``): ``Trainer(default_root_dir=URL)`` with ``ResumeCallback()``, SIGTERM after step 5, then the
same command: the rerun continues with the uninterrupted run's batches and weights, from the
preemption checkpoint on the bucket, or from the newest ``last.ckpt`` there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loader_resume.job.checkpoint_dir import CheckpointDirectoryError, DirectoryLock
from loader_resume.job.remote_lease import RemoteLease
from support import forked
from support.launch import CHILDREN
from support.reference import child_run
from support.s3 import ONE_ATTEMPT, Cuttable, bucket, objects, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with s3_server() as env:
        yield env


def lightning(out: Path, *args: str, expect: int = 0) -> str:
    out.mkdir(parents=True, exist_ok=True)
    done = forked.run(
        [sys.executable, str(CHILDREN / "lightning_child.py"), str(out), "--workers", "2", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == expect, done.stderr[-3000:]
    return done.stderr


def rows(out: Path) -> tuple[list[Any], str]:
    return json.loads((out / "log-0.json").read_text()), (out / "weights-0.txt").read_text()


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], str]:
    """The uninterrupted fit on a local directory (checkpoints every 3 steps), made once per
    session: test_storage_faults.py compares with it too. No loader workers there: the batches do
    not depend on num_workers (the augmentation is keyed), so the 2-worker runs here must match it
    all the same."""
    return rows(child_run(tmp_path_factory, "lightning_child.py", "--every", "3"))


@pytest.mark.parametrize(
    "writer", [[], ["--async-io", "1"]], ids=["synchronous", "AsyncCheckpointIO"]
)
def test_lightning_on_s3_sigterm_writes_the_checkpoint_on_the_bucket_and_the_same_command_continues(
    s3: dict[str, str], full: tuple[list[Any], str], tmp_path: Path, writer: list[str]
) -> None:
    """``--async-io 1``: Lightning's ``AsyncCheckpointIO`` uploads each file from a thread, a second
    late: the preemption checkpoint is on the bucket before the exit all the same."""
    bucket(f"run-a{len(writer)}")
    command = ["--root", f"s3://run-a{len(writer)}/job", "--signal-at", "5", "--append", *writer]
    root = f"s3://run-a{len(writer)}/job"
    said = lightning(tmp_path, *command, expect=143)
    # NOTE: the URL as given (a Path of it reads s3:/)
    assert f"checkpoint written at step 5 ({root}/preempted.ckpt); exiting with 143" in said
    assert "s3:/run" not in said
    stored = objects(root)
    assert f"{root}/preempted.ckpt" in stored and not [url for url in stored if ".tmp" in url], (
        stored
    )
    assert len(rows(tmp_path)[0]) == 5
    assert "s3:/run" not in lightning(tmp_path, *command)
    assert rows(tmp_path) == full
    assert f"{root}/preempted.ckpt" not in objects(root)  # a finished fit leaves none behind


def test_lightning_on_s3_passes_over_a_corrupted_preemption_checkpoint_to_the_newest_last_ckpt(
    s3: dict[str, str], full: tuple[list[Any], str], tmp_path: Path
) -> None:
    """Bytes flipped in the bucket's ``preempted.ckpt``: its CRC-32s, read through fsspec, refuse it
    (named in a warning); Lightning's own search drops the URL's protocol and finds no remote
    ``last.ckpt``: the callback offers the newest one (step 6: every 3 steps), and the rerun
    continues from there."""
    import s3fs

    bucket("run-b")
    lightning(tmp_path / "first", "--root", "s3://run-b/job", "--signal-at", "7", expect=143)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    data = bytearray(fs.cat("run-b/job/preempted.ckpt"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe("run-b/job/preempted.ckpt", bytes(data))
    assert "s3://run-b/job/ckpt/last.ckpt" in objects("s3://run-b/job")
    stderr = lightning(tmp_path / "rerun", "--root", "s3://run-b/job")
    assert "skipping checkpoint s3://run-b/job/preempted.ckpt" in stderr and "CRC-32" in stderr
    resumed, weights = rows(tmp_path / "rerun")
    assert resumed == full[0][6:] and weights == full[1]


def test_lightning_on_s3_refuses_to_start_over_when_the_bucket_holds_checkpoints_it_cannot_resume(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """No preemption checkpoint, no ``last.ckpt`` (``save_last=False``), but step checkpoints: never
    a silent step 0."""
    import s3fs

    bucket("run-c")
    lightning(
        tmp_path / "first",
        "--root",
        "s3://run-c/job",
        "--signal-at",
        "7",
        "--no-save-last",
        expect=143,
    )
    s3fs.S3FileSystem(skip_instance_cache=True).rm("run-c/job/preempted.ckpt")
    stderr = lightning(tmp_path / "rerun", "--root", "s3://run-c/job", "--no-save-last", expect=1)
    assert "resumes nothing, but its remote checkpoint directory holds" in stderr
    assert "s3://run-c/job/ckpt/step=6.ckpt" in stderr


def test_lightning_on_a_file_url_is_the_local_path_locked_and_resumed(
    full: tuple[list[Any], str], tmp_path: Path
) -> None:
    """``default_root_dir="file:///..."`` (Lightning makes it ``file:/...``): the local directory,
    with its lock; nothing goes to a ``./file:`` directory."""
    root = tmp_path / "root"
    command = ["--root", f"file://{root}", "--signal-at", "5", "--append"]
    lightning(tmp_path / "out", *command, expect=143)
    assert (root / "preempted.ckpt").is_file()
    held = DirectoryLock.acquire(root)  # another job holds the local directory: this one is refused
    try:
        assert "is in use by another job" in lightning(tmp_path / "out", *command, expect=1)
    finally:
        held.release()
    lightning(tmp_path / "out", *command)
    assert rows(tmp_path / "out") == full
    assert not list(Path.cwd().glob("file:*")) and not list(tmp_path.glob("**/file:*"))


def test_lightning_on_s3_without_credentials_stops_before_the_first_step_naming_the_url_and_cause(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """No credentials: the fit stops where it looks for its checkpoint, before training, naming the
    URL and the cause (never a run whose preemption save would fail, nor a silent start)."""
    bucket("run-d")
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("AWS_") or name.endswith("URL")
    }
    env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    done = forked.run(
        [
            sys.executable,
            str(CHILDREN / "lightning_child.py"),
            str(tmp_path),
            "--resume-dir",
            "s3://run-d/job",
            "--signal-at",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        "s3://run-d/job/preempted.ckpt: cannot reach the checkpoint storage (NoCredentialsError"
        in done.stderr
    )
    assert not (tmp_path / "log-0.json").exists() and objects("s3://run-d") == []


def test_lightning_on_s3_a_network_error_at_the_preemption_save_exits_74_and_reruns_from_the_last(
    s3: dict[str, str], full: tuple[list[Any], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link to the S3 server is cut mid-job (a relay in between closes every connection and
    refuses new ones): the preemption save fails, exit 74 naming the URL and the cause. With the
    link back, the same command resumes exactly from what was written before it went: the newest
    ``last.ckpt`` (step 3), once the lease the cut job could not remove has ended (its term: 6 s
    here)."""
    monkeypatch.setenv("LOADER_RESUME_LEASE_SECONDS", "6")
    bucket("run-e")
    link = Cuttable(s3["AWS_ENDPOINT_URL"])
    (tmp_path / "out").mkdir()
    command = [
        sys.executable,
        str(CHILDREN / "lightning_child.py"),
        str(tmp_path / "out"),
        "--root",
        "s3://run-e/job",
        "--wait-at",
        "4",
        "--signal-at",
        "5",
        "--workers",
        "2",
    ]
    job = forked.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       env={**os.environ, "AWS_ENDPOINT_URL": link.url, **ONE_ATTEMPT})
    deadline = time.monotonic() + 300
    while not (tmp_path / "out" / "waiting").exists():
        assert time.monotonic() < deadline and job.poll() is None, "training never reached step 4"
        time.sleep(0.02)
    link.cut()  # the job waits after step 4; the save follows step 5
    (tmp_path / "out" / "go").write_text("")
    _, stderr = job.communicate(timeout=600)
    link.restore()
    assert job.returncode == 74, stderr[-3000:]
    assert "NOT written to s3://run-e/job/preempted.ckpt" in stderr and "connect" in stderr.lower()
    assert "s3://run-e/job/preempted.ckpt" not in objects("s3://run-e/job")
    lightning(tmp_path / "rerun", "--root", "s3://run-e/job")
    resumed, weights = rows(tmp_path / "rerun")
    assert resumed == full[0][3:] and weights == full[1]


def test_a_second_job_on_the_same_bucket_directory_is_refused_naming_the_first(
    s3: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first job's lease (S3's conditional create) is held and renewed while it runs (a term of
    6 s: renewed every 2 s): a second job waits, then is refused at setup naming the holder, and
    writes nothing; the first one's release frees the directory."""
    monkeypatch.setenv("LOADER_RESUME_LEASE_SECONDS", "6")
    bucket("run-f")
    first = RemoteLease.acquire("s3://run-f/job")
    assert first is not None and objects("s3://run-f/job") == [
        "s3://run-f/job/.loader_resume.lease.1"
    ]
    try:
        stderr = lightning(tmp_path / "second", "--root", "s3://run-f/job", expect=1)
        assert "checkpoint directory s3://run-f/job is in use by another job (host" in stderr
        assert not (tmp_path / "second" / "log-0.json").exists()
    finally:
        first.release()
    assert objects("s3://run-f/job") == []
    # free again: it runs, and lets go at its end
    lightning(tmp_path / "third", "--root", "s3://run-f/job")
    assert not [url for url in objects("s3://run-f/job") if ".loader_resume.lease" in url]


def test_a_killed_jobs_lease_ends_with_its_term_and_the_rerun_takes_the_directory_over_and_resumes(
    s3: dict[str, str], full: tuple[list[Any], str], tmp_path: Path
) -> None:
    """SIGKILL (no chance to remove the lease) after step 4; the lease's term
    (LOADER_RESUME_LEASE_SECONDS=3) passes, and the same command takes the directory over, saying
    so, and resumes from the newest last.ckpt."""
    bucket("run-g")
    env = {**os.environ, "LOADER_RESUME_LEASE_SECONDS": "3"}
    (tmp_path / "out").mkdir()
    command = [
        sys.executable,
        str(CHILDREN / "lightning_child.py"),
        str(tmp_path / "out"),
        "--root",
        "s3://run-g/job",
        "--wait-at",
        "4",
        "--workers",
        "2",
    ]
    job = forked.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while not (tmp_path / "out" / "waiting").exists():
        assert time.monotonic() < deadline and job.poll() is None, "training never reached step 4"
        time.sleep(0.02)
    job.kill()
    job.wait()
    assert "s3://run-g/job/.loader_resume.lease.1" in objects("s3://run-g/job")
    (tmp_path / "rerun").mkdir()
    done = forked.run(
        [
            sys.executable,
            str(CHILDREN / "lightning_child.py"),
            str(tmp_path / "rerun"),
            "--root",
            "s3://run-g/job",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "taking over s3://run-g/job: its lease .loader_resume.lease.1 ended" in done.stderr
    resumed, weights = rows(tmp_path / "rerun")
    assert resumed == full[0][3:] and weights == full[1]


HOLDER = """
import pathlib, sys, time
from loader_resume.job.remote_lease import RemoteLease
lease = RemoteLease.acquire(sys.argv[1])
out = pathlib.Path(sys.argv[2])
(out / "held").write_text(str(lease.number))
while not (out / "stop").exists():
    time.sleep(0.05)
lease.release()
(out / "lost").write_text(str(lease.lost))
"""


def test_a_lease_being_renewed_is_refused_and_two_jobs_taking_over_an_ended_one_never_both_hold_it(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Term 3 s (renewed every second): a job meeting a renewed lease is refused naming its holder;
    a lease left by a killed job (never renewed) is waited out, and of two jobs taking over at once
    exactly one holds it."""
    import s3fs

    monkeypatch.setenv("LOADER_RESUME_LEASE_SECONDS", "3")
    bucket("run-h")
    first = RemoteLease.acquire("s3://run-h/a")
    assert first is not None
    try:
        with pytest.raises(
            CheckpointDirectoryError, match=r"s3://run-h/a is in use by another job \(host .*, pid"
        ):
            RemoteLease.acquire("s3://run-h/a", wait=2)
    finally:
        first.release()
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(
        "run-h/b/.loader_resume.lease.1", b'{"owner": "a killed job"}'
    )
    outcomes: dict[str, Any] = {}

    def take(name: str) -> None:
        try:
            outcomes[name] = RemoteLease.acquire("s3://run-h/b", wait=2)
        except CheckpointDirectoryError as refused:
            outcomes[name] = refused

    racers = [threading.Thread(target=take, args=(name,)) for name in "xy"]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=60)
    held = [lease for lease in outcomes.values() if isinstance(lease, RemoteLease)]
    assert len(held) == 1 and held[0].number == 2, outcomes
    # the ended one removed
    assert objects("s3://run-h/b") == ["s3://run-h/b/.loader_resume.lease.2"]
    held[0].release()
    assert objects("s3://run-h/b") == []


def test_a_holder_stopped_past_its_term_loses_the_lease_loudly_and_never_removes_the_next_holders(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A real process holds the lease (term 3 s) and is stopped (SIGSTOP) past its term: another job
    takes the directory over; the first, continued (SIGCONT), finds a higher lease at its next
    renewal, says the lease was lost, and on release removes only its own object."""
    monkeypatch.setenv("LOADER_RESUME_LEASE_SECONDS", "3")
    bucket("run-i")
    holder = forked.popen([sys.executable, "-c", HOLDER, "s3://run-i/job", str(tmp_path)],
                          stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "held").exists():
        assert time.monotonic() < deadline and holder.poll() is None, (
            "the holder never took the lease"
        )
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        # waits the silent lease out (3 s), then takes it
        second = RemoteLease.acquire("s3://run-i/job", wait=2)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert second is not None and second.number == 2
    time.sleep(2.5)  # two of the first holder's renewal periods
    (tmp_path / "stop").write_text("")
    _, stderr = holder.communicate(timeout=60)
    assert (tmp_path / "lost").read_text() == "True"
    assert "was taken by another job" in stderr
    # the second's lease stands
    assert "s3://run-i/job/.loader_resume.lease.2" in objects("s3://run-i/job")
    second.release()


def test_lightning_on_s3_a_rerun_after_a_crash_takes_the_newer_last_ckpt_not_an_older_preemption(
    s3: dict[str, str], full: tuple[list[Any], str], tmp_path: Path
) -> None:
    """Preempted at step 5 (preempted.ckpt); the rerun resumes, writes last.ckpt at steps 6 and 9
    and is killed after step 10, leaving the old preemption checkpoint; the next rerun resumes from
    step 9, the newer."""
    bucket("run-j")
    lightning(tmp_path / "first", "--root", "s3://run-j/job", "--signal-at", "5", expect=143)
    (tmp_path / "second").mkdir()
    second = forked.popen(
        [
            sys.executable,
            str(CHILDREN / "lightning_child.py"),
            str(tmp_path / "second"),
            "--root",
            "s3://run-j/job",
            "--wait-at",
            "10",
            "--workers",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "second" / "waiting").exists():
        assert time.monotonic() < deadline and second.poll() is None, (
            "the rerun never reached step 10"
        )
        time.sleep(0.02)
    second.kill()
    second.wait()
    assert "s3://run-j/job/preempted.ckpt" in objects("s3://run-j/job")
    with pytest.MonkeyPatch.context() as env:
        # NOTE: the killed job's lease: ended by the time it looks
        env.setenv("LOADER_RESUME_LEASE_SECONDS", "1")
        time.sleep(1.5)
        lightning(tmp_path / "third", "--root", "s3://run-j/job")
    resumed, weights = rows(tmp_path / "third")
    assert resumed == full[0][9:] and weights == full[1]


def test_lightning_on_a_bucket_that_does_not_exist_is_refused_at_setup_naming_the_url_and_cause(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """ResumeCallback(dirpath="s3://no-such-bucket/job"): taking the directory's lease fails, naming
    the URL and the store's answer, before any step (nothing trained, nothing written)."""
    stderr = lightning(tmp_path, "--resume-dir", "s3://no-such-bucket/job", expect=1)
    assert (
        "checkpoint directory s3://no-such-bucket/job: cannot take its lease (FileNotFoundError"
        in stderr
    )
    assert "bucket does not exist" in stderr and not (tmp_path / "log-0.json").exists()


def test_a_front_door_that_writes_local_directories_refuses_a_url_for_them(tmp_path: Path) -> None:
    """Accelerate's checkpoint_dir as an s3:// URL: refused at enable_resume, naming it (never a
    local ./s3:/ directory that only looks remote)."""
    from accelerate import Accelerator

    from accelerate_resume import enable_resume

    with pytest.raises(
        CheckpointDirectoryError,
        match=r"checkpoint directory s3://bucket/run: a URL, but this front-end "
        r"writes its checkpoints as local directories",
    ):
        enable_resume(Accelerator(cpu=True), {"checkpoint_dir": "s3://bucket/run"})
    assert not Path("s3:").exists()


def test_a_preemption_checkpoint_and_a_last_ckpt_of_the_same_second_are_told_apart_by_their_steps(
    s3: dict[str, str]
) -> None:
    """S3 keeps whole seconds: a rerun that resumed from the preemption checkpoint can write
    ``last.ckpt`` within the same second (seen in a full run). Of two written in one second, the
    later step is resumed from; at the same step, the preemption checkpoint."""
    import io

    import torch

    from lightning_resume.remote import newer
    from loader_resume.job.storage import remote_filesystem

    bucket("run-tie")
    ours, last = "s3://run-tie/job/preempted.ckpt", "s3://run-tie/job/last.ckpt"
    fs, _ = remote_filesystem(ours)

    def write_both(our_step: int, last_step: int) -> None:
        for _ in range(20):  # until both land in one second
            for url, step in ((ours, our_step), (last, last_step)):
                buffer = io.BytesIO()
                torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}}, buffer)
                with fs.open(url.removeprefix("s3://"), "wb") as file:
                    file.write(buffer.getvalue())
            fs.invalidate_cache()
            if fs.modified(ours) == fs.modified(last):
                return
        raise AssertionError("never written within one second")

    write_both(5, 9)
    assert newer(ours, last) == last
    write_both(9, 9)
    assert newer(ours, last) == ours
