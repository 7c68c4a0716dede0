"""``TorchFTResume`` under real TorchFT: a lighthouse (``torchft_lighthouse``) and three replica
groups, one process each, gloo on loopback. Groups are SIGKILLed between steps and during the
gradient exchange, restarted (they rejoin through TorchFT's recovery) or never restarted; every
sample is trained exactly once per epoch (the tail of an epoch padded as documented), each with the
augmentation it draws in a run without failures, and the weights are equal on every group at every
committed step."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from accounting import EPOCHS, N, assert_exactly_once, assert_weights_agree

CHILD = Path(__file__).parent / "children" / "group.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def lighthouse(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "lighthouse.log").open("w")
    process = subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas", "2", "--bind", f"127.0.0.1:{port}",
         "--join_timeout_ms", "500", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1500"],
        stdout=log, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    process.kill()
    process.wait()


def start(out: Path, group: int, lighthouse: str, *options: str,
          torchrun: bool = False) -> subprocess.Popen[bytes]:
    """A group's process (``torchrun``: launched by torchrun, one process, one restart)."""
    log = (out / f"group-{group}.out").open("ab")
    launcher = [sys.executable]
    if torchrun:
        launcher = [str(TORCHRUN), "--nproc_per_node", "1", "--max-restarts", "1",
                    "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return subprocess.Popen(
        [*launcher, str(CHILD), str(out), str(group), lighthouse, "--epochs", str(EPOCHS),
         "--samples", str(N), "--audit", str(out / "audit"), *options],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True)


def audit(out: Path) -> dict[str, Any]:
    """``loader-resume audit`` on the job's log (every group's processes, every run): its exit
    code and JSON report."""
    done = subprocess.run([str(Path(sys.executable).parent / "loader-resume"), "audit",
                           str(out / "audit"), "--json"], capture_output=True, text=True)
    return {"exit": done.returncode, "reports": json.loads(done.stdout or "[]"),
            "stderr": done.stderr}


def run_job(out: Path, lighthouse: str, faults: dict[int, list[str]], *, restart: set[int],
            workers: int = 0) -> list[dict[str, Any]]:
    """Three groups (``faults``: a group's options for its first process); a group in
    ``restart`` is started again, with no fault, once its first process died."""
    out.mkdir()
    common = ["--workers", str(workers)]
    processes = {g: start(out, g, lighthouse, *common, *faults.get(g, [])) for g in range(3)}
    deadline = time.monotonic() + 240
    restarted: set[int] = set()
    while time.monotonic() < deadline:
        for group, process in list(processes.items()):
            code = process.poll()
            if code == -signal.SIGKILL and group in restart and group not in restarted:
                restarted.add(group)
                processes[group] = start(out, group, lighthouse, *common)
        if all(process.poll() is not None for process in processes.values()):
            break
        time.sleep(0.2)
    for group, process in processes.items():
        if process.poll() is None:
            process.kill()
        expected = -signal.SIGKILL if group in faults and group not in restart else 0
        assert process.wait() == expected, (group, (out / f"group-{group}.out").read_text()[-3000:])
    return [json.loads(line) for path in sorted(out.glob("log-*.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], str]:
    """The noise each (epoch, sample) draws in a run without failures."""
    out = tmp_path_factory.mktemp("reference")
    port = free_port()
    light = subprocess.Popen(
        [str(LIGHTHOUSE), "--min_replicas", "2", "--bind", f"127.0.0.1:{port}",
         "--join_timeout_ms", "500", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1500"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        rows = run_job(out / "job", f"http://127.0.0.1:{port}", {}, restart=set())
    finally:
        light.kill()
        light.wait()
    assert all(row["committed"] for row in rows if row["t"] == "end")
    assert_weights_agree(rows)
    assert audit(out / "job")["exit"] == 0
    return assert_exactly_once(rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_group_killed_between_steps_and_restarted_trains_every_sample_once(
        tmp_path: Path, lighthouse: str, reference: dict[tuple[int, int], str],
        workers: int) -> None:
    rows = run_job(tmp_path / "job", lighthouse, {2: ["--kill-at", "6"]}, restart={2},
                   workers=workers)
    pids = {row["pid"] for row in rows if row["group"] == 2}
    assert len(pids) == 2, "the group was killed and ran again"
    worlds = [row["participant"][1] for row in rows if row["t"] == "take" and row["group"] == 0]
    assert 2 in worlds and worlds[-1] == 3, "the quorum shrank to 2 groups and grew back to 3"
    assert assert_exactly_once(rows) == reference
    assert_weights_agree(rows)
    assert audit(tmp_path / "job")["exit"] == 0


def test_groups_launched_by_torchrun_one_restarted_by_it_train_every_sample_once(
        tmp_path: Path, lighthouse: str, reference: dict[tuple[int, int], str]) -> None:
    """Each group under its own torchrun (one process, ``--max-restarts 1``; the manager takes
    torchrun's store, rank and world size); group 2's process SIGKILLed between steps, and
    torchrun starts it again."""
    out = tmp_path / "job"
    out.mkdir()
    groups = [start(out, group, lighthouse, *(["--kill-at", "6"] if group == 2 else []),
                    torchrun=True) for group in range(3)]
    assert finish(groups, out) == [0, 0, 0]
    rows = rows_of(out)
    assert len({row["pid"] for row in rows if row["group"] == 2}) == 2, "torchrun restarted it"
    assert assert_exactly_once(rows) == reference
    assert_weights_agree(rows)
    assert audit(out)["exit"] == 0


def test_a_group_killed_during_the_gradient_exchange_gives_the_step_back(
        tmp_path: Path, lighthouse: str, reference: dict[tuple[int, int], str]) -> None:
    rows = run_job(tmp_path / "job", lighthouse, {1: ["--die-in-exchange", "5"]}, restart={1})
    failed = [row for row in rows if row["t"] == "end" and not row["committed"]]
    assert failed, "the groups left saw the step fail"
    assert assert_exactly_once(rows) == reference
    assert_weights_agree(rows)
    assert audit(tmp_path / "job")["exit"] == 0


def test_a_group_that_never_returns_leaves_its_samples_to_the_others(
        tmp_path: Path, lighthouse: str, reference: dict[tuple[int, int], str]) -> None:
    rows = run_job(tmp_path / "job", lighthouse, {0: ["--kill-at", "4"]}, restart=set())
    assert assert_exactly_once(rows) == reference
    assert_weights_agree(rows)
    assert audit(tmp_path / "job")["exit"] == 0


def whole_job(out: Path, lighthouse: str, *options: str) -> list[subprocess.Popen[bytes]]:
    out.mkdir(exist_ok=True)
    return [start(out, group, lighthouse, "--checkpoint-dir", str(out / "checkpoints"), *options)
            for group in range(3)]


def wait_for_step(out: Path, step: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        path = out / "log-0.jsonl"
        if path.exists() and any(json.loads(line).get("step", -1) >= step
                                 for line in path.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never came")


def finish(processes: list[subprocess.Popen[bytes]], out: Path) -> list[int]:
    codes = []
    for group, process in enumerate(processes):
        try:
            codes.append(process.wait(timeout=180))
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError((out / f"group-{group}.out").read_text()[-3000:]) from None
    return codes


def rows_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(out.glob("log-*.jsonl"))
            for line in path.read_text().splitlines()]


def killed_at(out: Path, lighthouse: str, step: int) -> None:
    """A job saving every 3 steps, every group SIGKILLed once group 0 reached ``step``."""
    first = whole_job(out, lighthouse, "--save-every", "3")
    wait_for_step(out, step)
    for process in first:
        process.kill()
    assert finish(first, out) == [-signal.SIGKILL] * 3


def test_every_group_killed_resumes_the_job_from_the_periodic_checkpoint(
        tmp_path: Path, lighthouse: str, reference: dict[tuple[int, int], str]) -> None:
    out = tmp_path / "job"
    killed_at(out, lighthouse, 8)
    kept = sorted((out / "checkpoints").glob("step_*"))
    saved = int(kept[-1].name.removeprefix("step_"))
    assert saved % 3 == 0 and saved >= 6
    attempt_one = {row["pid"] for row in rows_of(out)}
    assert finish(whole_job(out, lighthouse, "--save-every", "3"), out) == [0, 0, 0]
    rows = rows_of(out)
    starts = [row for row in rows if row["t"] == "start" and row["pid"] not in attempt_one]
    assert {row["loaded_from"] for row in starts} == {str(kept[-1])}
    assert {row["step"] for row in starts} == {saved}
    saved_weights = {row["weights"] for row in rows if row["t"] == "end" and row["committed"]
                     and row["pid"] in attempt_one and row["step"] == saved - 1}
    assert {row["weights"] for row in starts} == saved_weights
    # what the finished model trained on: the first job's steps the checkpoint holds, then the
    # second job's
    kept_rows = [row for row in rows if row["pid"] not in attempt_one or row["step"] < saved]
    assert assert_exactly_once(kept_rows) == reference
    assert_weights_agree(kept_rows)
    checked = audit(out)
    assert checked["exit"] == 0, checked
    lives = checked["reports"][0]["attempts"]
    trained_past = {row["step"] for row in rows if row["t"] == "end" and row["committed"]
                    and row["pid"] in attempt_one and row["step"] >= saved}
    assert lives[0]["resumed"] == "(fresh)" and lives[1]["resumed"].startswith("epoch ")
    # NOTE: the kill may fall between a step's commit and the child's row of it
    assert lives[0]["rolled_back"] == 0
    assert len(trained_past) <= lives[1]["rolled_back"] <= len(trained_past) + 1


def test_the_audit_fails_a_job_restarted_afresh_after_its_checkpoints_were_lost(
        tmp_path: Path, lighthouse: str) -> None:
    """Every group killed, the checkpoints deleted, the job started again: it trains from the
    start (every sample is seen again), and the audit names the silent restart."""
    out = tmp_path / "job"
    killed_at(out, lighthouse, 5)
    shutil.rmtree(out / "checkpoints")
    assert finish(whole_job(out, lighthouse, "--save-every", "3"), out) == [0, 0, 0]
    checked = audit(out)
    assert checked["exit"] == 1
    (finding,) = checked["reports"][0]["findings"]
    assert finding["message"].startswith("started afresh although earlier groups saved checkpoints")
    assert finding["attempt"] == 2


@pytest.mark.parametrize("sent, options", [
    ("process", []),
    ("process group", ["--workers", "2"]),  # its DataLoader workers receive it too
    ("process", ["--own-allreduce"]),  # the gradients averaged by the script's own calls
])
def test_sigterm_to_one_group_stops_every_group_at_one_checkpoint_and_the_rerun_continues(
        tmp_path: Path, lighthouse: str, reference: dict[tuple[int, int], str], sent: str,
        options: list[str]) -> None:
    out = tmp_path / "job"
    first = whole_job(out, lighthouse, *options)
    wait_for_step(out, 5)
    if sent == "process group":
        os.killpg(first[1].pid, signal.SIGTERM)
    else:
        first[1].send_signal(signal.SIGTERM)
    assert finish(first, out) == [143, 143, 143]
    (kept,) = sorted((out / "checkpoints").glob("step_*"))
    attempt_one = {row["pid"] for row in rows_of(out)}
    last = max(row["step"] for row in rows_of(out) if row["t"] == "end" and row["committed"])
    assert kept.name == f"step_{last + 1:09d}", "the checkpoint is the last committed step's"
    assert finish(whole_job(out, lighthouse, *options), out) == [0, 0, 0]
    rows = rows_of(out)
    assert {row["step"] for row in rows if row["t"] == "start"
            and row["pid"] not in attempt_one} == {last + 1}
    assert assert_exactly_once(rows) == reference, "no step lost or repeated across the stop"
    assert_weights_agree(rows)
    checked = audit(out)
    assert checked["exit"] == 0, checked
    assert [life["rolled_back"] for life in checked["reports"][0]["attempts"]] == [0, 0]


def test_what_cannot_be_kept_exact_is_refused_by_name(lighthouse: str, tmp_path: Path) -> None:
    """Each refused setting names itself (a real Manager, before any quorum)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import (
        DataLoader,
        DistributedSampler,
        IterableDataset,
        Sampler,
        TensorDataset,
    )
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from torchft_resume import TorchFTResume

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    made: list[Manager] = []

    def manager(**options: Any) -> Manager:
        made.append(Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None,
                       min_replica_size=1, lighthouse_addr=lighthouse, replica_id="refused",
                       store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                       **options))
        return made[-1]

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

    class Endless(Sampler[int]):  # NOTE: no __len__
        def __iter__(self) -> Iterator[int]:
            return iter(range(8))

    data = TensorDataset(torch.arange(8.0))
    model = torch.nn.Linear(1, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = manager(use_async_quorum=False)
    cases = [
        (dict(manager=manager(use_async_quorum=True), loader=DataLoader(data)),
         "use_async_quorum=True"),
        (dict(manager=sync, loader=DataLoader(
            data, sampler=DistributedSampler(data, num_replicas=2, rank=0))),
         "a loader already sharded (DistributedSampler)"),
        (dict(manager=sync, loader=DataLoader(Stream())), "an IterableDataset"),
        (dict(manager=sync, loader=DataLoader(data, num_workers=2, in_order=False)),
         "DataLoader(in_order=False)"),
        (dict(manager=sync, loader=DataLoader(data), optimizer=Optimizer(sync, plain)),
         "torchft's Optimizer"),
        (dict(manager=sync, loader=DataLoader(data), model=model, optimizer=plain,
              checkpoint_dir="s3://bucket/run"), "checkpoint_dir='s3://bucket/run'): a URL"),
        (dict(manager=sync, loader=DataLoader(data, sampler=Endless()), audit=tmp_path),
         "the loader's sampler (Endless) has no length"),
    ]
    for arguments, named in cases:
        with pytest.raises(ValueError, match=re.escape(named)):
            TorchFTResume(**arguments)
    for each in made:
        each.shutdown(wait=False)
