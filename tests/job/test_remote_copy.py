"""A remote copy of sealed checkpoints (``loader_resume.job.remote_copy``) for the front doors that
write local directories, against a real S3 API server on loopback (moto's, tests/support/s3.py).
Accelerate (tests/children/accelerate_child.py on 2 processes, ``accelerate launch``) with
``remote=s3://...`` and Fabric (tests/children/fabric_child.py, 2 devices) with
``FabricResume(remote=...)``: SIGTERM mid-epoch, the machine's disk lost (the local checkpoint
directory deleted), the same command again: it downloads the copy and continues with the
uninterrupted run's batches and weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs

from loader_resume.audit.check import audit_directory
from loader_resume.job.checkpoint import MANIFEST, seal, verify
from loader_resume.job.remote_copy import RemoteCopy, RemoteCopyError
from support import forked
from support.launch import CHILDREN, ROOT, command, logs, progress_of, run, trained, weights
from support.s3 import ONE_ATTEMPT, Cuttable, bucket, objects, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    with s3_server() as env:
        yield env


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full")
    run(out, 2)
    return out


def preempted(out: Path, remote: str) -> list[str]:
    """A 2-process job SIGTERMed after its 6th step with ``remote``; its local checkpoints, then
    deleted (the disk went with the machine)."""
    run(out, 2, "--signal-at", "6", f"remote={remote}", expect=143)
    local = sorted(p.name for p in (out / "resume_checkpoints").glob("step_*"))
    shutil.rmtree(out / "resume_checkpoints")
    return local


def test_accelerate_sigterm_copies_the_checkpoint_to_s3_and_a_rerun_on_a_new_disk_continues_exactly(
    s3: dict[str, str], full: Path, tmp_path: Path
) -> None:
    bucket("copy-a")
    local = preempted(tmp_path, "s3://copy-a/job")
    stopped = len(trained(logs(tmp_path)[0]))
    assert local == [f"step_{stopped:09d}"]
    stored = objects("s3://copy-a/job")
    assert f"s3://copy-a/job/{local[0]}/{MANIFEST}" in stored and not [
        u for u in stored if "lease" in u
    ], stored
    run(tmp_path, 2, "remote=s3://copy-a/job")
    assert logs(tmp_path) == logs(full)  # the rerun's log appends to the first run's
    assert weights(tmp_path) == weights(full)
    # downloaded whole, then sealed
    assert (tmp_path / "resume_checkpoints" / local[0] / MANIFEST).is_file()


def test_an_upload_killed_before_its_manifest_is_skipped_by_name_and_the_rerun_takes_the_one_before(
    s3: dict[str, str], full: Path, tmp_path: Path
) -> None:
    """A newer remote directory without its manifest (what a kill during the upload leaves) is
    passed over with a warning naming it; the rerun resumes exactly from the complete one before it.
    The variable ``LOADER_RESUME_REMOTE`` is the config field's."""
    bucket("copy-b")
    (done,) = preempted(tmp_path, "s3://copy-b/job")
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    partial = f"copy-b/job/step_{int(done[5:]) + 1:09d}"
    for path in fs.find(f"copy-b/job/{done}"):
        if not path.endswith(MANIFEST):
            fs.copy(path, path.replace(f"copy-b/job/{done}", partial))
    stderr = run(tmp_path, 2, env={"LOADER_RESUME_REMOTE": "s3://copy-b/job"})
    assert f"skipping s3://{partial}: it has no {MANIFEST}" in stderr
    assert logs(tmp_path) == logs(full) and weights(tmp_path) == weights(full)


def test_a_job_killed_during_an_upload_leaves_a_copy_that_a_rerun_passes_over_for_the_one_before(
    s3: dict[str, str], full: Path, tmp_path: Path
) -> None:
    """A real kill during an upload: the job copies a checkpoint every 3 steps; once one copy is
    complete, the link stops answering the PUT of a manifest (every other file of that checkpoint is
    on the bucket by then, the manifest going last), and the job's processes are SIGKILLed there. On
    a new machine (the local checkpoints deleted), the same command passes that directory over,
    naming it, and resumes exactly from the complete copy before it."""
    bucket("copy-k")
    link = Cuttable(s3["AWS_ENDPOINT_URL"])
    same = ["remote=s3://copy-k/job", "save_every_n_steps=3"]
    env = {**os.environ, "AWS_ENDPOINT_URL": link.url, "LOADER_RESUME_LEASE_SECONDS": "6"}
    job = forked.popen(command(tmp_path, 2, "--sleep", "0.2", *same), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    # looks at the bucket directly, not through the link
    copy = RemoteCopy("s3://copy-k/job", tmp_path / "unused")
    deadline = time.monotonic() + 300
    try:
        while not copy.complete():
            assert time.monotonic() < deadline and job.poll() is None, "no complete copy was made"
            time.sleep(0.05)
        # the next manifest's upload
        link.stall = re.compile(rb"^PUT \S*/" + re.escape(MANIFEST.encode()) + rb"[ ?]")
        assert link.stalled.wait(timeout=120) and job.poll() is None, (
            "no upload reached its manifest"
        )
        os.killpg(job.pid, signal.SIGKILL)  # the launcher; each rank runs in a session of its own
        for rank in (0, 1):
            os.kill(int((tmp_path / f"pid-{rank}").read_text()), signal.SIGKILL)
        job.communicate(timeout=60)
    finally:
        link.close()
    (complete,) = copy.complete()
    partial = sorted(
        {url.split("/")[4] for url in objects("s3://copy-k/job") if "/step_" in url} - {complete}
    )
    assert len(partial) == 1 and partial[0] > complete, (complete, partial)
    assert [url for url in objects(f"s3://copy-k/job/{partial[0]}")], (
        "the killed upload left its files"
    )
    shutil.rmtree(tmp_path / "resume_checkpoints")
    stderr = run(tmp_path, 2, "--log-dir", "rerun", *same, env={"LOADER_RESUME_LEASE_SECONDS": "6"})
    assert f"skipping s3://copy-k/job/{partial[0]}: it has no {MANIFEST}" in stderr
    resumed_at = int(complete.removeprefix("step_"))
    for rerun, uninterrupted in zip(logs(tmp_path / "rerun"), logs(full), strict=True):
        assert trained(rerun) == [row for row in trained(uninterrupted) if row["step"] > resumed_at]
    assert weights(tmp_path / "rerun") == weights(full)


def test_an_upload_cut_at_the_preemption_save_exits_74_and_a_rerun_there_resumes_from_its_disk(
    s3: dict[str, str], full: Path, tmp_path: Path
) -> None:
    """The link to the store is cut mid-job (a relay that closes every connection), then rank 0 gets
    SIGTERM: the checkpoint is sealed locally but its upload fails, so every process exits 74 (not
    143: nothing that outlives the machine was written) naming the URL, and no complete copy is on
    the bucket. On the same machine, with the link back, the same command resumes exactly from the
    local checkpoint."""
    bucket("copy-d")
    link = Cuttable(s3["AWS_ENDPOINT_URL"])
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": link.url,
        "LOADER_RESUME_LEASE_SECONDS": "6",
        **ONE_ATTEMPT,
    }
    job = forked.popen(
        command(tmp_path, 2, "--sleep", "0.2", "remote=s3://copy-d/job"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while progress_of(tmp_path / "progress-0") < 3:
        assert time.monotonic() < deadline and job.poll() is None, "training never reached step 3"
        time.sleep(0.02)
    link.cut()
    # the launcher reports its ranks' exit codes
    os.kill(int((tmp_path / "pid-0").read_text()), signal.SIGTERM)
    _, stderr = job.communicate(timeout=600)
    link.restore()
    assert job.returncode != 0 and "exitcode  : 74" in stderr, stderr[-3000:]
    assert (
        "but NOT copied: RemoteCopyError: upload" in stderr and "to s3://copy-d/job/step_" in stderr
    )
    assert not [url for url in objects("s3://copy-d/job") if url.endswith(MANIFEST)]
    (local,) = [p.name for p in (tmp_path / "resume_checkpoints").glob("step_*")]
    # sealed at the step the job stopped after
    assert int(local[5:]) == len(trained(logs(tmp_path)[0]))
    done = forked.run(
        command(tmp_path, 2, "remote=s3://copy-d/job"),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert logs(tmp_path) == logs(full) and weights(tmp_path) == weights(full)


def test_a_bucket_that_does_not_exist_is_refused_at_start_naming_the_url(
    s3: dict[str, str], tmp_path: Path
) -> None:
    stderr = run(tmp_path, 2, "remote=s3://no-such-bucket/job", expect=1)
    assert "s3://no-such-bucket/job" in stderr
    assert not (tmp_path / "log-0.jsonl").exists()  # refused before the first step


def sealed(directory: Path, files: dict[str, bytes]) -> Path:
    building = directory.with_name(f".{directory.name}.building")
    for name, data in files.items():
        (building / name).parent.mkdir(parents=True, exist_ok=True)
        (building / name).write_bytes(data)
    seal(building, directory)
    return directory


def test_the_copy_keeps_the_newest_and_downloads_only_what_is_newer_than_the_local_ones(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """Uploads keep the newest ``keep`` remote copies (nested files too); a download brings the
    complete remote ones newer than the newest local one, byte for byte (they verify against their
    manifests)."""
    bucket("copy-c")
    local = tmp_path / "local"
    copy = RemoteCopy("s3://copy-c/job", local, keep=2)
    for step in (1, 2, 3):
        copy.upload(
            sealed(
                local / f"step_{step:09d}", {"a.bin": bytes([step]) * 100, "sub/b.bin": b"x" * step}
            )
        )
    assert copy.complete() == ["step_000000002", "step_000000003"]
    fresh = tmp_path / "fresh"
    made = RemoteCopy("s3://copy-c/job", fresh, keep=2).download_newer()
    assert [p.name for p in made] == ["step_000000002", "step_000000003"]
    for path in made:
        verify(path)
    assert (fresh / "step_000000003" / "sub" / "b.bin").read_bytes() == b"xxx"
    # nothing newer than step 3
    assert RemoteCopy("s3://copy-c/job", fresh, keep=2).download_newer() == []


def test_a_local_path_is_not_a_remote_copy_and_an_unreachable_store_is_named(
    s3: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="expected an fsspec URL"):
        RemoteCopy("file:///tmp/x", tmp_path)
    checkpoint = sealed(tmp_path / "step_000000001", {"a.bin": b"a"})
    with pytest.raises(
        RemoteCopyError, match=r"upload .* to s3://no-such-bucket-2/job/step_000000001: "
    ):
        RemoteCopy("s3://no-such-bucket-2/job", tmp_path).upload(checkpoint)


def fabric(out: Path, *args: str, expect: int = 0) -> str:
    done = forked.run(
        [sys.executable, str(CHILDREN / "fabric_child.py"), str(out), "--devices", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == expect, done.stderr[-3000:]
    return done.stderr


def test_fabric_sigterm_copies_the_checkpoint_to_s3_and_a_rerun_on_a_new_disk_continues_exactly(
    s3: dict[str, str], tmp_path: Path
) -> None:
    bucket("copy-f")
    fabric(tmp_path / "full")
    job = tmp_path / "job"
    fabric(job, "--signal-at", "5", "--remote", "s3://copy-f/job", expect=143)
    (local,) = [p.name for p in (job / "resume_checkpoints").glob("step_*")]
    shutil.rmtree(job / "resume_checkpoints")
    stored = objects("s3://copy-f/job")
    assert f"s3://copy-f/job/{local}/{MANIFEST}" in stored and not [
        u for u in stored if "lease" in u
    ], stored
    fabric(job, "--remote", "s3://copy-f/job")
    assert logs(job) == logs(tmp_path / "full") and weights(job) == weights(tmp_path / "full")


def test_a_plain_loop_with_a_remote_copy_stopped_and_rerun_on_a_new_disk_continues_exactly(
    s3: dict[str, str], tmp_path: Path
) -> None:
    """``examples/plain_digits.py --remote s3://...`` (``start_remote_copy``, ``fetch_newer``,
    ``RemoteCopy.upload`` after each seal): SIGTERM mid-epoch, the local checkpoints deleted, the
    same command: the uninterrupted run's batches and final weights."""
    bucket("copy-p")

    def command(out: Path, *args: str) -> list[str]:
        out.mkdir(exist_ok=True)
        return [
            sys.executable,
            str(ROOT / "examples" / "plain_digits.py"),
            "--out",
            str(out),
            "--epochs",
            "1",
            "--batch-log",
            str(out),
            *args,
        ]

    # the last write of each step wins (a rerun appends)
    def steps(out: Path) -> dict[int, list[Any]]:
        rows = [json.loads(line) for line in (out / "log-0.jsonl").read_text().splitlines()]
        return {row["step"]: [row["epoch"], row["ids"], row["batch"]] for row in rows}

    full = forked.run(command(tmp_path / "full"), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    job = tmp_path / "job"
    same = ["--remote", "s3://copy-p/job", "--audit", "s3://copy-p/audit"]
    first = forked.popen(
        command(job, *same, "--sleep", "0.05"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while (
        not (job / "log-0.jsonl").exists()
        or len((job / "log-0.jsonl").read_text().splitlines()) < 5
    ):
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 5"
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr[-3000:]
    (local,) = [p.name for p in (job / "checkpoints").glob("step_*")]
    assert f"s3://copy-p/job/{local}/{MANIFEST}" in objects("s3://copy-p/job")
    shutil.rmtree(job / "checkpoints")
    written = len((job / "log-0.jsonl").read_text().splitlines())
    again = forked.run(command(job, *same), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((job / "log-0.jsonl").read_text().splitlines()[written])
    # it continued from the bucket's copy
    assert resumed["step"] == int(local.removeprefix("step_")) + 1
    assert steps(job) == steps(tmp_path / "full")
    assert again.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    assert full.stdout.splitlines()[-1].startswith("final weights digest: ")
    # the loader's audit, kept in the bucket too (audit=s3://...): the rerun resumed at the bucket's
    # checkpoint
    (report,) = audit_directory("s3://copy-p/audit")
    assert report.ok, report.findings
    assert [(a["world"], a["resumed"]) for a in report.attempts] == [
        (1, "(fresh)"), (1, f"epoch 0 position {64 * int(local.removeprefix('step_'))}")]
    assert [(row["epoch"], row["delivered"], row["status"]) for row in report.epochs] == [
        (0, 1797, "ok")
    ]
