"""``loader-resume audit`` on a job whose groups come and go while it runs (TorchFT's replica
groups; ``torchft_resume`` writes these logs, ``tests_torchft`` audits real jobs): the logs here are
written through the same writer (``quorum_log``) with the records a group's process writes, so each
rule is held to one small job: a step counts when any participant committed it, a step given back
is read again by the next one, a whole-job restart rolls back what the lives before it committed
past its checkpoint; and each way such a job goes wrong is named (a step's samples read twice, a
step given back but never read again, a participant's records missing, a restart that loaded no
checkpoint although there were some, a checkpoint no process of the logs saved)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loader_resume import ResumableDataLoader
from loader_resume.audit import log as audit_module
from loader_resume.audit.log import quorum_log, state_digest
from loader_resume.tools.cli import main as cli

N, BATCH = 24, 2


class Items(list[int]):
    """The dataset (its class names the loader's folder)."""


def state(epoch: int = 0, position: int = 0) -> dict[str, Any]:
    loader = ResumableDataLoader(Items(range(N)), batch_size=BATCH, shuffle=True, seed=3,
                                 keying="sample")
    return dict(loader.state_dict(), epoch=epoch, position=position)


@pytest.fixture(autouse=True)
def _warning_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: quorum_log turns off, for its process, the warning of loaders built without audit=
    monkeypatch.setattr(audit_module, "_SAID_UNAUDITED", False)


def opened(directory: Path, count: int) -> list[audit_module.AuditLog]:
    """The logs of ``count`` group processes starting now."""
    return [quorum_log(directory, Items(range(N)), state(), f"group{number}")
            for number in range(count)]


def write(logs: list[audit_module.AuditLog], *records: list[dict[str, Any]]) -> None:
    """The processes' records in turn, each written at once as the groups' writer does (record i
    of every process before record i + 1 of any: the steps go together)."""
    for index in range(max(map(len, records))):
        for log, written in zip(logs, records, strict=True):
            if index < len(written):
                log.record(written[index])
                log.flush()


def ended(logs: list[audit_module.AuditLog], *, killed: tuple[int, ...] = ()) -> None:
    """Each process's exit (``killed``: those that write no end record)."""
    for number, log in enumerate(logs):
        if number not in killed:
            log.close()
        audit_module._OPEN.remove(log)


def processes(directory: Path, *records: list[dict[str, Any]],
              killed: tuple[int, ...] = ()) -> None:
    """Group processes running at once, from start to exit."""
    logs = opened(directory, len(records))
    write(logs, *records)
    ended(logs, killed=killed)


def take(step: int, epoch: int, start: int, rank: int, world: int, ok: bool | None = True,
         ) -> list[dict[str, Any]]:
    """A participant's records of one step of ``world`` batches from ``start`` (``ok`` None: the
    process died before the outcome)."""
    end = start + world * BATCH
    records: list[dict[str, Any]] = [{"t": "b", "step": step, "e": epoch, "s": start,
                                      "end": end, "r": rank, "w": world}]
    if end >= N:
        records[0].update(end=start + -(-(N - start) // world) * world, l=1)
    if ok is not None:
        records.append({"t": "c", "step": step, "ok": int(ok)})
    return records


def epoch_of(world: int, epoch: int, first_step: int, rank: int, start: int = 0) -> list[Any]:
    """A participant's records of the rest of an epoch from ``start``, every step committed."""
    records, step = [], first_step
    for position in range(start, N, world * BATCH):
        records += take(step, epoch, position, rank, world)
        step += 1
    return records


def audited(directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = cli(["audit", str(directory), "--json"])
    (report,) = json.loads(capsys.readouterr().out)
    return code, report


def test_a_job_whose_groups_left_and_rejoined_reads_as_exactly_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """3 groups; group c dies after step 1, the two others take 2 steps, c's new process rejoins
    and all 3 finish the epoch; a step given back (c's death during it) is read again."""
    a = take(0, 0, 0, 0, 3) + take(1, 0, 6, 0, 3) + take(2, 0, 12, 0, 2, ok=False)
    b = take(0, 0, 0, 1, 3) + take(1, 0, 6, 1, 3) + take(2, 0, 12, 1, 2, ok=False)
    a += take(2, 0, 12, 0, 2) + take(3, 0, 16, 0, 2) + take(4, 0, 20, 0, 2)
    b += take(2, 0, 12, 1, 2) + take(3, 0, 16, 1, 2) + take(4, 0, 20, 1, 2)
    processes(tmp_path, a + epoch_of(3, 1, 5, 0), b + epoch_of(3, 1, 5, 1),
              take(0, 0, 0, 2, 3) + take(1, 0, 6, 2, 3), epoch_of(3, 1, 5, 2), killed=(2,))
    code, report = audited(tmp_path, capsys)
    assert (code, report["findings"], report["gaps"]) == (0, [], [])
    assert [row["status"] for row in report["epochs"]] == ["ok", "ok"]
    assert len(report["attempts"]) == 1


def test_a_participant_that_died_after_its_step_committed_counts_through_the_others(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # NOTE: b's last outcome never written
    processes(tmp_path, epoch_of(2, 0, 0, 0), epoch_of(2, 0, 0, 1)[:-1], killed=(1,))
    assert audited(tmp_path, capsys)[0] == 0


@pytest.mark.parametrize(("fault", "message"), [
    ("read twice", "delivered twice: 4 samples of step 1 again in step 2"),
    ("given back, never read again", "never delivered: 4 samples"),
    ("outcome lost", "never delivered: 4 samples"),
])
def test_a_group_whose_samples_went_wrong_fails_naming_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, message: str) -> None:
    """Two groups, 6 steps of 4 samples; step 2 goes wrong on both: it reads step 1's positions
    again, or it is given back and the next step goes on past it, or every participant's outcome
    of it is lost (no one recorded a commit: it does not count)."""
    groups = []
    for rank in range(2):
        records = take(0, 0, 0, rank, 2) + take(1, 0, 4, rank, 2)
        if fault == "read twice":
            records += take(2, 0, 4, rank, 2) + take(3, 0, 8, rank, 2)
        elif fault == "given back, never read again":
            records += take(2, 0, 8, rank, 2, ok=False) + take(2, 0, 12, rank, 2)
        else:
            records += take(2, 0, 8, rank, 2, ok=None) + take(3, 0, 12, rank, 2)
        groups.append(records + epoch_of(2, 0, 4, rank, start=16 if fault != "read twice" else 12))
    processes(tmp_path, *groups)
    code, report = audited(tmp_path, capsys)
    assert code == 1
    assert [finding["message"] for finding in report["findings"]][:1] == [message]


def test_a_participant_with_no_records_of_a_committed_step_is_a_gap(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    processes(tmp_path, epoch_of(2, 0, 0, 0))
    code, report = audited(tmp_path, capsys)
    assert code == 3 and report["findings"] == []
    assert report["gaps"][0]["message"].startswith(
        "step 0 counts, but participant 1 of 2 has no record of it")


def whole_job_restarted(directory: Path, load: dict[str, Any] | None) -> None:
    """Life 1: two groups commit steps 0-3 (16 samples), one saves at step 2 (8 samples), both
    are killed; life 2 starts from ``load`` (or afresh) and ends the epoch."""
    save = {"t": "save", "step": 2, "e": 0, "pos": 8, "d": state_digest(state(0, 8))}
    first = [take(0, 0, 0, rank, 2) + take(1, 0, 4, rank, 2) + [save] * (rank == 0)
             + take(2, 0, 8, rank, 2) + take(3, 0, 12, rank, 2) for rank in range(2)]
    processes(directory, *first, killed=(0, 1))
    loaded = [] if load is None else [{"t": "load", **load}]
    start, step = (0, 0) if load is None else (load["pos"], load["step"])
    processes(directory, *[loaded + epoch_of(2, 0, step, rank, start=start) for rank in range(2)])


def test_a_whole_job_restart_rolls_back_what_was_trained_past_its_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole_job_restarted(tmp_path, {"step": 2, "e": 0, "pos": 8, "d": state_digest(state(0, 8))})
    code, report = audited(tmp_path, capsys)
    assert (code, report["findings"], report["gaps"]) == (0, [], [])
    assert [(life["resumed"], life["rolled_back"]) for life in report["attempts"]] == [
        ("(fresh)", 0), ("epoch 0 position 8", 2)]


def test_a_whole_job_restart_from_no_checkpoint_or_an_unknown_one_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole_job_restarted(tmp_path / "afresh", None)
    code, report = audited(tmp_path / "afresh", capsys)
    assert code == 1
    assert report["findings"][0]["message"] == (
        "started afresh although earlier groups saved checkpoints (the newest at step 2): its "
        "checkpoint was not found")
    other = state(0, 8) | {"seed": 4}
    whole_job_restarted(tmp_path / "other", {"step": 2, "e": 0, "pos": 8,
                                             "d": state_digest(other)})
    code, report = audited(tmp_path / "other", capsys)
    assert code == 3
    assert report["gaps"][0]["message"].startswith(
        "resumed from step 2, a checkpoint no group in these logs saved")


def test_a_job_whose_logs_begin_at_a_checkpoint_is_incomplete_never_wrong(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first processes in the logs loaded a checkpoint of step 3 (12 samples in): the samples
    before it are in no log, a gap, not "never delivered"."""
    load = {"t": "load", "step": 3, "e": 0, "pos": 12, "d": state_digest(state(0, 12))}
    processes(tmp_path, *[[load, *epoch_of(2, 0, 3, rank, start=12)] for rank in range(2)])
    code, report = audited(tmp_path, capsys)
    assert (code, report["findings"]) == (3, [])
    assert report["gaps"][0]["message"].startswith(
        "resumed from step 3, a checkpoint no group in these logs saved (the logs of the job "
        "before it are missing")
    assert report["epochs"][0]["status"] == "ok (from position 12: earlier ones are in no log)"


def test_a_sampler_of_fewer_positions_than_the_dataset_is_checked_over_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sampler of 12 of the 24 items: each step's record carries the epoch's 12 units; all 12
    delivered is "ok", one step lost is named."""
    def sampled(rank: int, lose: bool) -> list[dict[str, Any]]:
        records = []
        for step, start in enumerate(range(0, 12, 4)):
            if lose and step == 1:
                continue
            records += [dict(record, u=12) if record["t"] == "b" else record
                        for record in take(step, 0, start, rank, 2)]
        return records
    processes(tmp_path / "whole", sampled(0, False), sampled(1, False))
    code, report = audited(tmp_path / "whole", capsys)
    assert (code, report["findings"], report["epochs"][0]["delivered"]) == (0, [], 12)
    processes(tmp_path / "lost", sampled(0, True), sampled(1, True))
    code, report = audited(tmp_path / "lost", capsys)
    assert code == 1 and report["findings"][0]["message"] == "never delivered: 4 samples"


def test_a_restarted_process_that_died_before_its_first_step_begins_no_life(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After the whole job died, a process starts and dies while loading the checkpoint (its log
    holds no step); the job then restarts from the checkpoint: one restart, exact."""
    save = {"t": "save", "step": 2, "e": 0, "pos": 8, "d": state_digest(state(0, 8))}
    processes(tmp_path, *[take(0, 0, 0, rank, 2) + take(1, 0, 4, rank, 2) + [save] * (rank == 0)
                          + take(2, 0, 8, rank, 2) for rank in range(2)], killed=(0, 1))
    processes(tmp_path, [], killed=(0,))
    load = {"t": "load", "step": 2, "e": 0, "pos": 8, "d": save["d"]}
    processes(tmp_path, *[[load, *epoch_of(2, 0, 2, rank, start=8)] for rank in range(2)])
    code, report = audited(tmp_path, capsys)
    assert (code, report["findings"], report["gaps"]) == (0, [], [])
    assert [life["rolled_back"] for life in report["attempts"]] == [0, 1]


def test_a_job_that_lost_its_state_while_a_restarted_group_was_starting_restarts_from_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Groups a, b, c commit steps 0-1 (a checkpoint at step 2, 12 samples in); a dies, b and c
    commit steps 2-3 without it; a2 starts and loads the checkpoint while b and c are alive, then
    b and c die before a2 took a step; b2 and c2 load the checkpoint too, and the three go on from
    step 2: what b and c committed after the checkpoint was rolled back, though a process of the
    job was alive throughout."""
    save = {"t": "save", "step": 2, "e": 0, "pos": 12, "d": state_digest(state(0, 12))}
    load = {"t": "load", "step": 2, "e": 0, "pos": 12, "d": save["d"]}
    abc = opened(tmp_path, 3)
    write(abc, *[take(0, 0, 0, rank, 3) + take(1, 0, 6, rank, 3) + [save] * (rank == 0)
                 for rank in range(3)])
    ended(abc[:1], killed=(0,))
    (a2,) = opened(tmp_path, 1)
    write([a2], [load])
    write(abc[1:], *[take(2, 0, 12, rank, 2) + take(3, 0, 16, rank, 2) for rank in range(2)])
    ended(abc[1:], killed=(0, 1))
    b2c2 = opened(tmp_path, 2)
    write(b2c2, [load], [load])
    write([a2, *b2c2], *[take(2, 0, 12, rank, 3) + take(3, 0, 18, rank, 3) for rank in range(3)])
    ended([a2, *b2c2])
    code, report = audited(tmp_path, capsys)
    assert (code, report["findings"], report["gaps"]) == (0, [], [])
    assert [(life["resumed"], life["rolled_back"]) for life in report["attempts"]] == [
        ("(fresh)", 0), ("epoch 0 position 12", 2)]
