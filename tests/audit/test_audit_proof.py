"""``loader-resume audit`` says "exactly once" only about what it can prove, and names what it finds
where it is: a job whose logs are not all there is incomplete (exit 3), never "OK"; processes that
read as one rank at the same time are named, with the samples both delivered; ``drop_last`` reads as
dropped; a kill's lost records make "rolled back" a lower bound, said so; one repeated batch is one
finding with a count; a plain loop under ``LOADER_RESUME_AUDIT`` that records nothing says so. Every
attempt is a real process (``tests/children/audit_child.py``, torchrun for one launch), whose own
record of what it was handed is the truth the report is held to."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from loader_resume import ResumableDataLoader
from loader_resume.audit import log as audit_module
from loader_resume.tools.cli import main as cli
from support import forked
from support.audit import CHILD, attempt, audit, by_epoch, side_by_side, verdict
from support.launch import TORCHRUN, free_port


def three_attempts(out: Path) -> list[list[int]]:
    """A job of 3 attempts: A takes a state after step 4 (position 32) and crashes after 6; B
    resumes from it, takes one 3 steps later (position 56) and crashes after 5; C resumes from that
    and finishes 2 epochs. Each attempt's own record, as ids."""
    a = attempt(out, "a", "--save-at", "4", str(out / "s1.pt"), "--steps", "6", expect=3)
    b = attempt(
        out,
        "b",
        "--load",
        str(out / "s1.pt"),
        "--save-at",
        "3",
        str(out / "s2.pt"),
        "--steps",
        "5",
        expect=3,
    )
    c = attempt(out, "c", "--load", str(out / "s2.pt"))
    assert sorted(by_epoch(a[:4] + b[:3] + c)[0]) == list(range(100))  # the truth: exactly once
    return [a, b, c]


def logs_of(out: Path) -> list[Path]:
    """The job's log files, oldest first (one attempt each here)."""
    return sorted((out / "audit").rglob("rank*.jsonl"), key=lambda path: json.loads(
        path.read_text().splitlines()[0])["time"])


def test_a_job_whose_logs_are_not_all_there_is_incomplete_never_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole job passes. Its first attempt's log deleted: the first attempt left resumed from a
    state no log took, exit 3 naming it (as for a job whose audit was turned on late);
    ``--began-before-audit`` checks it from that state on and passes, saying so. The middle
    attempt's log deleted: the last one loaded a state no log took, and the 8 samples before it that
    no log shows are named: exit 3."""
    whole = tmp_path / "whole"
    three_attempts(whole)
    code, report, text = audit(whole, capsys)
    assert code == 0 and report["complete"], text
    first, middle = tmp_path / "first", tmp_path / "middle"
    for copy, lost in ((first, 0), (middle, 1)):
        shutil.copytree(whole, copy)
        logs_of(copy)[lost].unlink()
    code, report, text = audit(first, capsys)
    assert code == 3 and not report["ok"] and not report["complete"] and not report["findings"], (
        text
    )
    ((where, gap),) = [
        ((g["attempt"], g["rank"], g["epoch"], g["position"]), g["message"]) for g in report["gaps"]
    ]
    assert where == (1, None, 0, 32)
    assert "resumed from epoch 0 position 32, a state no attempt in these logs took" in gap
    assert "GAP attempt 1, all ranks, epoch 0, position 32: resumed from" in text
    assert verdict(text) == (
        "INCOMPLETE: nothing found wrong, but the logs do not show the whole job (1 gap, the "
        "first: attempt 1 resumed from epoch 0 position 32, a state no attempt in these logs took)"
    )
    assert "OK" not in text
    code, report, text = audit(first, capsys, "--began-before-audit")
    assert code == 0 and report["ok"] and report["checked_from"] == "epoch 0 position 32", text
    assert (
        verdict(text)
        == "OK: every sample from epoch 0 position 32 on delivered exactly once, across 2 attempts"
    )
    assert (
        report["epochs"][0]["status"] == "ok (from position 32: earlier ones ran before this audit)"
    )
    code, report, text = audit(middle, capsys)
    assert code == 3 and not report["findings"], text
    ((where, count, gap),) = [((g["attempt"], g["epoch"], g["position"]), g["count"], g["message"])
                              for g in report["gaps"]]
    # A delivered up to 48 (6 steps), B's state stood at 56
    assert where == (2, 0, 56) and count == 8
    assert "the log of the attempt that took it is missing" in gap
    assert "8 samples before it, from epoch 0 position 48, are in no log" in gap


def test_a_rank_with_no_log_is_a_gap_not_a_sample_never_delivered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A world of 2, cut after 7 steps (its state from step 4), resumed by a world of 2. Rank 1's
    log of the first attempt deleted: its share of steps 1-4 is not known (32 samples), named as
    such; exit 3."""
    side_by_side(
        tmp_path,
        "first",
        "--save-at",
        "4",
        str(tmp_path / "state-RANK.pt"),
        "--steps",
        "7",
        expect=3,
    )
    side_by_side(tmp_path, "second", "--load", str(tmp_path / "state-RANK.pt"))
    code, report, text = audit(tmp_path, capsys)
    assert code == 0, text
    (lost,) = [path for path in logs_of(tmp_path)[:2] if path.name.startswith("rank00001.")]
    lost.unlink()
    code, report, text = audit(tmp_path, capsys)
    assert code == 3 and not report["findings"], text
    ((where, count, gap),) = [
        ((g["attempt"], g["rank"], g["epoch"], g["position"]), g["count"], g["message"])
        for g in report["gaps"]
    ]
    assert (
        where == (1, 1, 0, 8)
        and count == 32
        and gap.startswith("no log of rank 1: what it was handed is not known")
    )


def torchrun(out: Path, name: str, *args: str) -> int:
    """One launch of ``torchrun --nproc_per_node 2 audit_child.py ... --as-one``: both processes
    build their loader as rank 0 of 1; a step takes 150 ms (training takes time: the two run side by
    side). Its exit code."""
    done = forked.run(
        [
            TORCHRUN,
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--nproc_per_node",
            "2",
            str(CHILD),
            str(out / "audit"),
            str(out / f"{name}-RANK.json"),
            "--as-one",
            "--sleep",
            "0.15",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=180,
    )
    return done.returncode


def test_two_processes_reading_as_one_rank_under_one_launch_are_named_with_the_samples_both_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under one torchrun launch both processes build ``rank=0, world_size=1``: each reads all 100
    samples of both epochs. The audit names the two processes and the 200 samples both delivered;
    with checkpoints and a rerun (each process its own state), both launches are named."""
    plain = tmp_path / "plain"
    assert torchrun(plain, "run") == 0
    seen = [by_epoch(json.loads((plain / f"run-{rank}.json").read_text())) for rank in (0, 1)]
    # the truth: every sample read twice
    assert seen[0] == seen[1] and sorted(seen[0][0]) == list(range(100))
    code, report, text = audit(plain, capsys)
    assert code == 1, text
    (finding,) = report["findings"]
    assert (finding["epoch"], finding["position"], finding["rank"], finding["count"]) == (
        0,
        0,
        0,
        200,
    )
    assert finding["message"].startswith("rank 0 of 1 in two processes at the same time (pid ")
    assert "200 samples delivered by both (epochs 0, 1, from position 0)" in finding["message"]
    assert text.count("FAIL ") == 1 and "OK" not in text
    saved = tmp_path / "saved"
    assert (
        torchrun(saved, "first", "--save-at", "4", str(saved / "state-RANK.pt"), "--steps", "7")
        != 0
    )
    assert torchrun(saved, "second", "--load", str(saved / "state-RANK.pt")) == 0
    code, report, text = audit(saved, capsys)
    assert code == 1, text
    # 7 steps; 21 steps
    assert [(f["attempt"], f["count"]) for f in report["findings"]] == [(2, 56), (4, 168)]
    assert all("in two processes at the same time" in f["message"] for f in report["findings"])


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (1, 2), (2, 0), (2, 2)])
def test_drop_last_reads_as_dropped_and_the_epochs_as_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world: int, workers: int
) -> None:
    """250 samples, batches of 8, ``drop_last=True``: one process drops 2 a pass (248 delivered),
    two drop 10 (each rank's 125 make 15 batches). Cut after 20 steps (a state after 12), resumed:
    every epoch "ok", the dropped ones counted from where they begin, the last epoch not
    "partial"."""
    job = ["--n", "250", "--drop-last", "--workers", str(workers)]
    cut = ["--save-at", "12", str(tmp_path / "state-RANK.pt"), "--steps", "20"]
    if world == 1:
        seen = [
            attempt(tmp_path, "first", *job, *[a.replace("RANK", "0") for a in cut], expect=3)[:12]
            + attempt(tmp_path, "second", *job, "--load", str(tmp_path / "state-0.pt"))
        ]
    else:
        first = side_by_side(tmp_path, "first", *job, *cut, expect=3)
        rest = side_by_side(tmp_path, "second", *job, "--load", str(tmp_path / "state-RANK.pt"))
        seen = [first[rank][:12] + rest[rank] for rank in (0, 1)]
    delivered, dropped = (248, 2) if world == 1 else (240, 10)
    for epoch in (0, 1):  # the truth
        ids = [i for rank in seen for i in by_epoch(rank)[epoch]]
        assert len(ids) == len(set(ids)) == delivered
    code, report, text = audit(tmp_path, capsys)
    assert code == 0, text
    assert [
        (e["delivered"], e["dropped"], e["dropped_from"], e["status"]) for e in report["epochs"]
    ] == [(delivered, dropped, delivered, "ok")] * 2
    assert f"{dropped} (from {delivered})" in text and "left" not in text and "partial" not in text


def test_rolled_back_after_a_kill_is_said_to_be_a_lower_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state after step 3, then the process SIGKILLs itself after step 6: the records of steps 4-6
    die with it (they are written at the next state), so the audit counts fewer steps rolled back
    than were redone, and says so. The same job crashing with an exception writes them at exit: 3,
    exact."""
    for case, end in (("killed", "--kill-at"), ("crashed", "--steps")):
        out = tmp_path / case
        first = attempt(
            out,
            "first",
            "--save-at",
            "3",
            str(out / "state.pt"),
            end,
            "6",
            expect=-9 if case == "killed" else 3,
        )
        rest = attempt(out, "second", "--load", str(out / "state.pt"))
        assert len(first) == 6 and rest[:3] == first[3:]  # the truth: 3 steps redone
        code, report, text = audit(out, capsys)
        assert code == 0, text
        rerun = report["attempts"][1]
        if case == "killed":
            assert rerun["rolled_back"] < 3 and not rerun["rolled_back_exact"]
            assert f"{rerun['rolled_back']} or more" in text.splitlines()[3]
        else:
            assert (
                rerun["rolled_back"] == 3 and rerun["rolled_back_exact"] and "or more" not in text
            )


def test_one_batch_recorded_twice_is_one_finding_with_its_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log with one batch record repeated (8 samples): one finding, where it is, how many, one
    FAIL line; two batches repeated, apart: two."""
    attempt(tmp_path, "only")
    (log,) = logs_of(tmp_path)
    lines = log.read_text().splitlines(keepends=True)
    third = [index for index, line in enumerate(lines) if line.startswith('{"t":"b"')][2]
    log.write_text("".join([*lines[:third + 1], lines[third], *lines[third + 1:]]))
    code, report, text = audit(tmp_path, capsys)
    assert code == 1
    (finding,) = report["findings"]
    assert (
        finding["attempt"],
        finding["rank"],
        finding["epoch"],
        finding["position"],
        finding["count"],
    ) == (1, 0, 0, 16, 8)
    assert (
        "delivered twice in one attempt (ranks 0 and 0), with no resume between: 8 samples"
        in finding["message"]
    )
    assert text.count("FAIL ") == 1 and "FAIL attempt 1, rank 0, epoch 0, position 16:" in text
    sixth = [index for index, line in enumerate(lines) if line.startswith('{"t":"b"')][5]
    log.write_text(
        "".join(
            [
                *lines[: third + 1],
                lines[third],
                *lines[third + 1 : sixth + 1],
                lines[sixth],
                *lines[sixth + 1 :],
            ]
        )
    )
    code, report, text = audit(tmp_path, capsys)  # two batches repeated, apart: two findings
    assert code == 1 and [(f["position"], f["count"]) for f in report["findings"]] == [
        (16, 8),
        (40, 8),
    ]


def test_a_plain_loop_under_the_audit_variable_says_once_that_it_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``LOADER_RESUME_AUDIT`` turns the audit on for the front doors' loaders; one the user's code
    builds without ``audit=`` records nothing, and says so once a process, naming the variable and
    the fix."""
    monkeypatch.setenv("LOADER_RESUME_AUDIT", str(tmp_path / "audit"))
    monkeypatch.setattr(audit_module, "_SAID_UNAUDITED", False)
    with caplog.at_level(logging.WARNING, logger="loader_resume.audit.log"):
        for _ in range(2):
            loader = ResumableDataLoader(list(range(8)), batch_size=2, shuffle=True, seed=1)
            assert sorted(i for batch in loader for i in batch.tolist()) == list(range(8))
    (said,) = [record.getMessage() for record in caplog.records]
    assert said.startswith(
        f"LOADER_RESUME_AUDIT={tmp_path / 'audit'} is set, but a ResumableDataLoader of list was "
        "built without audit=: its batches are not recorded"
    )
    assert (
        "audit=os.environ.get('LOADER_RESUME_AUDIT')" in said and not (tmp_path / "audit").exists()
    )
    caplog.clear()
    audited = ResumableDataLoader(list(range(8)), batch_size=2, audit=tmp_path / "audit")
    list(audited)
    assert not caplog.records and list((tmp_path / "audit").rglob("rank*.jsonl"))


def test_a_stream_whose_logs_are_not_all_there_is_incomplete_and_a_batch_that_skips_items_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stream of two ranks, two workers each: cut after 5 steps (a state after 2), resumed. Rank
    1's first log deleted: a gap naming it. The first attempt's logs deleted: a gap; with
    ``--began-before-audit``, each worker is checked from the batch its state stood at. A batch
    record that moves the stream on by more than a batch holds (8 items skipped) fails, naming the
    worker, the batch and how many."""
    stream = ["--stream", "--workers", "2", "--epochs", "1"]
    side_by_side(
        tmp_path,
        "first",
        *stream,
        "--save-at",
        "2",
        str(tmp_path / "state-RANK.pt"),
        "--steps",
        "5",
        expect=3,
    )
    side_by_side(tmp_path, "second", *stream, "--load", str(tmp_path / "state-RANK.pt"))
    code, report, text = audit(tmp_path, capsys)
    assert code == 0 and [row["delivered"] for row in report["epochs"]] == [50, 50, 50, 50], text
    # the first attempt's (they load no state), rank 0's then rank 1's
    first = sorted(path for path in logs_of(tmp_path) if '"t":"load"' not in path.read_text())
    cases = {name: tmp_path / "cases" / name for name in ("rank", "early", "attempt", "skip")}
    for name, copy in cases.items():
        shutil.copytree(tmp_path / "audit", copy / "audit")
        lost = {"rank": first[1:], "early": first[1:], "attempt": first, "skip": []}[name]
        for path in lost:
            (copy / path.relative_to(tmp_path)).unlink()
    # the rerun's rank 1 began before its rank 0 (the order ranks start in is the launcher's): still
    # a restart
    rerun = {
        json.loads(path.read_text().splitlines()[0])["rank"]: path
        for path in logs_of(cases["early"])
        if '"t":"load"' in path.read_text()
    }
    lines = rerun[1].read_text().splitlines(keepends=True)
    begun = json.loads(rerun[0].read_text().splitlines()[0])["time"] - 0.01
    rerun[1].write_text(
        json.dumps(dict(json.loads(lines[0]), time=begun), separators=(",", ":"))
        + "\n"
        + "".join(lines[1:])
    )
    for name in ("rank", "early"):
        code, report, text = audit(cases[name], capsys)
        assert code == 3 and not report["findings"], text
        assert [(g["attempt"], g["rank"]) for g in report["gaps"]] == [
            (1, 1)
        ] and "no log of rank 1" in text
    code, report, text = audit(cases["attempt"], capsys)
    assert code == 3 and not report["findings"] and [g["attempt"] for g in report["gaps"]] == [1], (
        text
    )
    code, report, text = audit(cases["attempt"], capsys, "--began-before-audit")
    assert code == 0, text
    assert all(
        row["status"] == "ok (from batch 2: earlier ones are not in these logs)"
        for row in report["epochs"]
    )
    log = next(path for path in logs_of(cases["skip"]) if '"w":1,"b":3,' in path.read_text())
    lines = log.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"w":1,"b":3,' in line)
    # worker 1's batch 3 and after: 8 items further on than they were
    for i in range(at, len(lines)):
        record = json.loads(lines[i])
        if record.get("w") == 1:
            lines[i] = json.dumps(dict(record, i=record["i"] + 8), separators=(",", ":")) + "\n"
    log.write_text("".join(lines))
    code, report, text = audit(cases["skip"], capsys)
    assert code == 1, text
    ((where, count, message),) = [
        ((f["epoch"], f["position"]), f["count"], f["message"]) for f in report["findings"]
    ]
    assert where == (0, 3) and count == 8
    assert (
        message
        == "worker 1: batch 3 moved the stream 16 items on, more than a batch holds (8): 8 items "
           "skipped"
    )


def test_a_log_with_records_that_are_not_records_is_refused_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    attempt(tmp_path, "only")
    (log,) = logs_of(tmp_path)
    lines = log.read_text().splitlines()
    for bad, said in (
        ("null", "line 3 is not a record"),
        ('{"t":"b","e":0}', "line 3: a 'b' record without s, end"),
    ):
        log.write_text("\n".join([*lines[:2], bad, *lines[2:]]) + "\n")
        capsys.readouterr()
        assert cli(["audit", str(tmp_path / "audit")]) == 2
        assert f"{log}: {said}" in capsys.readouterr().err
