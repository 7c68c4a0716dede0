"""``audit=DIR`` and ``loader-resume audit DIR``: a job's own record of what each rank was handed,
checked after the fact. Each attempt is a real process (``tests/children/audit_child.py``; a world
of 2 is two processes side by side); the attempts write what they saw themselves, so what the audit
says is compared with the truth, not with itself. Jobs made wrong on purpose (a pass skipped, a
state from another run, a resume that did not load) fail, naming where. The front doors' SIGTERM and
rerun with ``--audit``: ``tests/job/test_remote_copy.py`` (on S3) and the SIGKILL chaos of
``tests/faults/chaos/test_kill9.py`` (under torchrun)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from loader_resume import ResumableDataLoader
from loader_resume.tools.cli import main as cli
from support import forked
from support.audit import CHILD, N, attempt, audit, by_epoch, side_by_side, verdict
from support.mounts import fill, tmpfs


def test_a_job_cut_at_two_ranks_and_resumed_on_one_passes_and_says_where_it_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """World 2 (two processes) crashes after 7 steps, its last state taken after step 4; a world of
    1 resumes from it and finishes two epochs. The batches that count (each attempt's up to where
    the next resumed) hold every sample once per epoch, and the audit says so, where the resume was
    (4 steps of 2 ranks of 8) and what was redone."""
    ranks = side_by_side(
        tmp_path,
        "first",
        "--save-at",
        "4",
        str(tmp_path / "state-RANK.pt"),
        "--steps",
        "7",
        expect=3,
    )
    rest = attempt(tmp_path, "second", "--load", str(tmp_path / "state-0.pt"))
    counted = by_epoch([batch for rank in ranks for batch in rank[:4]] + rest)
    assert {epoch: sorted(ids) for epoch, ids in counted.items()} == {
        0: list(range(N)),
        1: list(range(N)),
    }
    code, report, text = audit(tmp_path, capsys)
    assert code == 0, text
    assert [
        (a["world"], a["batches"], a["resumed"], a["rolled_back"]) for a in report["attempts"]
    ] == [(2, 14, "(fresh)", 0), (1, len(rest), "epoch 0 position 64", 3)]
    assert [(e["epoch"], e["delivered"], e["status"]) for e in report["epochs"]] == [
        (0, N, "ok"),
        (1, N, "ok"),
    ]
    assert (
        report["ok"]
        and verdict(text) == "OK: every sample delivered exactly once, across 2 attempts"
    )


def test_a_pass_skipped_by_a_wrong_state_fails_naming_the_first_sample_never_seen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A library made wrong on purpose (its states after a ``break`` describe the next pass: the
    rule this project once had): the loop breaks after 3 batches, saves, and the job is rerun from
    that state. Epoch 0's samples from position 24 on are never seen, and the loop never said it
    left the pass."""
    first = attempt(
        tmp_path, "first", "--break-at", "3", str(tmp_path / "state.pt"), "--regression"
    )
    rest = attempt(tmp_path, "second", "--load", str(tmp_path / "state.pt"))
    assert len(by_epoch(first + rest)[0]) == 24  # the truth: the rest of epoch 0 was skipped
    code, report, text = audit(tmp_path, capsys)
    assert code == 1
    (finding,) = report["findings"]
    assert (finding["epoch"], finding["position"]) == (
        0,
        24,
    ) and "never delivered: 76 samples" in finding["message"]
    # attempt 1 had to deliver them
    assert (finding["attempt"], finding["rank"], finding["count"]) == (1, 0, 76)
    assert "FAIL attempt 1, rank 0, epoch 0, position 24: never delivered" in text
    assert verdict(text).startswith("FAILED: 1 finding, the first: never delivered: 76 samples")
    # the same loop with this library: it continues the pass (the default that loses nothing)
    for name, said in (("default", ()), ("said", ("--pass-ended",))):
        again = tmp_path / name
        again.mkdir()
        attempt(again, "first", "--break-at", "3", str(again / "state.pt"), *said)
        attempt(again, "second", "--load", str(again / "state.pt"))
        code, report, _ = audit(again, capsys)
        assert code == 0, report
        # the loop said it leaves the pass (pass_ended=True): the samples it left are named, not a
        # fault
        if said:
            assert (
                report["epochs"][0]["status"]
                == "left at position 24: the loop left it (pass_ended=True)"
            )


def test_passes_the_loop_leaves_itself_are_named_and_a_resume_follows_the_state_it_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every pass left after 3 batches (as ``limit_train_batches``), no restart: each epoch is left
    where the loop left it. Then a lineage: attempt 1 takes states after steps 4 and 8 and crashes
    after 9; attempt 2 resumes from the first and crashes 2 steps later; attempt 3 resumes from the
    second (attempt 1's), and finishes."""
    limited = tmp_path / "limited"
    limited.mkdir()
    attempt(limited, "only", "--limit", "3", "--epochs", "3")
    code, report, _ = audit(limited, capsys)
    left = "left at position 24: the loop began the next pass before its end"
    assert code == 0 and [row["status"] for row in report["epochs"]] == [
        left,
        left,
        "partial: the job stopped at position 24",
    ]
    first = attempt(tmp_path, "first", "--save-at", "4", str(tmp_path / "s4.pt"), "--save-at", "8",
                    str(tmp_path / "s8.pt"), "--steps", "9", expect=3)
    attempt(tmp_path, "second", "--load", str(tmp_path / "s4.pt"), "--steps", "2", expect=3)
    rest = attempt(tmp_path, "third", "--load", str(tmp_path / "s8.pt"))
    assert sorted(by_epoch(first[:8] + rest)[0]) == list(range(N))  # the truth
    code, report, text = audit(tmp_path, capsys)
    assert code == 0, text
    assert [(a["resumed"], a["rolled_back"]) for a in report["attempts"]] == [
        ("(fresh)", 0), ("epoch 0 position 32", 5), ("epoch 0 position 64", 1)]


def test_a_state_from_another_run_fails_naming_it_and_the_samples_it_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job crashes after step 5 (its state from step 3); its rerun loads a state another run
    took at step 6."""
    other = tmp_path / "other"
    other.mkdir()
    attempt(other, "run", "--save-at", "6", str(other / "state.pt"), "--steps", "6", expect=3)
    attempt(
        tmp_path, "first", "--save-at", "3", str(tmp_path / "state.pt"), "--steps", "5", expect=3
    )
    attempt(tmp_path, "second", "--load", str(other / "state.pt"))
    code, report, text = audit(tmp_path, capsys)
    # the logs cannot tell another run's state from the log of an attempt in between that is
    # missing: never "OK"
    assert code == 3 and not report["findings"] and not report["ok"] and not report["complete"]
    ((where, gap),) = [
        ((g["attempt"], g["epoch"], g["position"], g["count"]), g["message"])
        for g in report["gaps"]
    ]
    # step 6 (40..47): in no attempt
    assert where == (2, 0, 48, 8) and "no earlier attempt in these logs took" in gap
    assert (
        "another run's checkpoint" in gap
        and "8 samples before it, from epoch 0 position 40, are in no log" in gap
    )
    assert "GAP attempt 2, all ranks, epoch 0, position 48: loaded a state" in text
    assert verdict(text).startswith(
        "INCOMPLETE: nothing found wrong, but the logs do not show the whole job"
    )


def test_a_rerun_that_loaded_nothing_fails_though_every_sample_was_seen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """States were taken (a checkpoint), but the rerun started from the beginning (it did not find
    it). Unless the only state was the attempt's last record (a job killed in its first save has no
    checkpoint): said, not failed."""
    attempt(
        tmp_path, "first", "--save-at", "3", str(tmp_path / "state.pt"), "--steps", "5", expect=3
    )
    attempt(tmp_path, "second")
    code, report, _ = audit(tmp_path, capsys)
    assert code == 1 and [
        (f["attempt"], f["rank"], f["epoch"], f["position"]) for f in report["findings"]
    ] == [(2, None, 0, 0)]
    assert "started from the beginning" in report["findings"][0]["message"]
    killed = tmp_path / "killed"
    killed.mkdir()
    attempt(killed, "first", "--save-at", "3", str(killed / "state.pt"), "--steps", "3", expect=3)
    attempt(killed, "second")
    code, report, _ = audit(killed, capsys)
    assert code == 0 and [note.split(":")[0] for note in report["notes"]] == [
        "attempt 2 started from the beginning"
    ]


def test_a_stream_with_two_workers_resumed_passes_and_a_rerun_from_an_older_state_rolls_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An iterable dataset with a state, two workers: the worker batches continue where the state
    said."""
    stream = ["--stream", "--workers", "2", "--epochs", "1"]
    first = attempt(
        tmp_path,
        "first",
        *stream,
        "--save-at",
        "4",
        str(tmp_path / "state.pt"),
        "--steps",
        "7",
        expect=3,
    )
    rest = attempt(tmp_path, "second", *stream, "--load", str(tmp_path / "state.pt"))
    assert sorted(by_epoch(first[:4] + rest)[0]) == list(range(N))
    code, report, text = audit(tmp_path, capsys)
    assert code == 0, text
    # 50 ids each, 8 a batch: 7 batches, 50 samples
    assert [(e["worker"], e["batches"], e["delivered"]) for e in report["epochs"]] == [
        (0, 7, 50),
        (1, 7, 50),
    ]
    # a third run from the first one's state (the second one's work lost with its checkpoints): all
    # of it redone
    again = attempt(tmp_path, "third", *stream, "--load", str(tmp_path / "state.pt"))
    assert again == rest
    code, report, text = audit(tmp_path, capsys)
    assert code == 0, text
    assert [a["rolled_back"] for a in report["attempts"]] == [0, 3, len(rest)]


def test_a_record_torn_by_a_kill_is_ignored_and_named_and_a_damaged_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    attempt(
        tmp_path, "first", "--save-at", "3", str(tmp_path / "state.pt"), "--steps", "5", expect=3
    )
    attempt(tmp_path, "second", "--load", str(tmp_path / "state.pt"))
    (log, *_) = sorted((tmp_path / "audit").rglob("rank*.jsonl"))
    text = log.read_text()
    # a kill in the middle of a write: half a line, no newline
    log.write_text(text + text.splitlines()[-3][:17])
    code, report, _ = audit(tmp_path, capsys)
    assert code == 0 and report["notes"] == [
        f"{log}: its last line was cut short (a kill while writing): ignored"
    ]
    lines = text.splitlines()
    lines[2] = lines[2][:-9]
    log.write_text("\n".join(lines) + "\n")
    assert cli(["audit", str(tmp_path / "audit")]) == 2
    assert f"{log}: line 3 is damaged" in capsys.readouterr().err
    assert cli(["audit", str(tmp_path / "nothing")]) == 2
    assert f"{tmp_path / 'nothing'}: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli(["audit", str(tmp_path / "empty")]) == 2
    assert "no audit logs" in capsys.readouterr().err
    log.write_bytes(bytes(range(256)) * 4)  # random bytes, not text
    assert cli(["audit", str(tmp_path / "audit")]) == 2
    assert f"{log}: not an audit log (byte 128 is not UTF-8 text" in capsys.readouterr().err


def test_a_full_disk_under_the_audit_never_stops_training_and_its_records_follow_once_room(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The audit directory on a tmpfs with one free page: its writes fail about halfway through the
    16 epochs (No space left on device). The job goes on with the same batches as with room, says so
    once, and keeps the records: with room made after 150 batches they are written then, and the
    audit sees every epoch whole; with none, they are never written, the job's last error says so,
    and the log ends at its last whole record (no torn line): the audit sees the epochs written, as
    it would for a job that stopped there."""
    expected = attempt(tmp_path / "room", "job", "--epochs", "16")
    for case in ("freed", "full"):
        with tmpfs(tmp_path / case / "disk", "16k") as disk:
            filler = disk / "filler"
            filler.write_bytes(bytes(12288))  # one page of the four left free
            command = [
                sys.executable,
                str(CHILD),
                str(disk / "audit"),
                str(tmp_path / case / "job.json"),
                "--epochs",
                "16",
                *(["--free-after", "150", str(filler)] if case == "freed" else []),
            ]
            done = forked.run(command, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            assert json.loads((tmp_path / case / "job.json").read_text()) == expected
            assert (
                done.stderr.count("could not write") == 1
                and "No space left on device" in done.stderr
            )
            capsys.readouterr()
            code = cli(["audit", str(disk / "audit"), "--json"])
            (report,) = json.loads(capsys.readouterr().out)
            assert not report["notes"], report["notes"]  # no line cut short
            statuses = [row["status"] for row in report["epochs"]]
            if case == "freed":
                assert "written now" in done.stderr and "never written" not in done.stderr
                assert code == 0 and statuses == ["ok"] * 16
            else:
                assert "records were never written" in done.stderr
                assert code == 0 and 0 < len(statuses) < 16  # the log ends where the writes stopped


def test_records_dropped_after_failed_writes_fail_the_audit_naming_how_many(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept records are bounded (``UNWRITTEN_LIMIT``, here 200 characters): an epoch on a full disk
    is dropped, a ``lost`` record takes its place once there is room again, and the audit fails,
    naming how many."""
    from loader_resume.audit import log as audit_module

    monkeypatch.setattr(audit_module, "UNWRITTEN_LIMIT", 200)
    with tmpfs(tmp_path / "disk", "16k") as disk:
        filler = disk / "filler"
        (disk / "audit").mkdir()
        fill(filler)
        loader = ResumableDataLoader(
            list(range(40)), batch_size=4, shuffle=True, seed=5, audit=disk / "audit"
        )
        assert len([batch for batch in loader]) == 10  # epoch 0: its records dropped
        filler.unlink()
        assert len([batch for batch in loader]) == 10  # epoch 1: written, after the lost record
        capsys.readouterr()
        code = cli(["audit", str(disk / "audit"), "--json"])
        (report,) = json.loads(capsys.readouterr().out)
        # done before the unmount
        for key in [key for key in audit_module._LOGS if key[0].startswith(str(disk))]:
            log = audit_module._LOGS.pop(key)
            log.close()
            audit_module._OPEN.remove(log)
    assert code == 1 and any(
        "records were dropped after failed writes" in f["message"] for f in report["findings"]
    )


def test_audit_is_refused_where_it_cannot_follow_and_costs_nothing_when_off(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="in_order=True to audit"):
        ResumableDataLoader(list(range(8)), num_workers=1, in_order=False, audit=tmp_path)
    with pytest.raises(ValueError, match="expected a directory or an fsspec URL"):
        ResumableDataLoader(list(range(8)), audit="")
    loader = ResumableDataLoader(list(range(8)), batch_size=2, audit=tmp_path / "never")
    assert not (tmp_path / "never").exists()  # nothing written until a batch is handed over
    batches = iter(loader)
    next(batches), next(batches)
    # its header, at once; the batches are buffered
    (log,) = (tmp_path / "never").rglob("rank00000.*.jsonl")
    assert [json.loads(line)["t"] for line in log.read_text().splitlines()] == ["begin", "at"]
    loader.state_dict()  # the batches before a state are written with it
    assert [json.loads(line)["t"] for line in log.read_text().splitlines()][2:] == [
        "pass",
        "b",
        "b",
        "state",
        "at",
    ]
    list(batches)  # an epoch's last batch is written at once
    assert [json.loads(line)["t"] for line in log.read_text().splitlines()][7:] == ["b", "b", "at"]
    plain = ResumableDataLoader(list(range(8)), batch_size=2)
    assert plain._position.setup.audit is None and os.listdir(tmp_path) == ["never"]
