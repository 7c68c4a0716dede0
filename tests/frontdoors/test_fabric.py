"""Lightning Fabric under ``FabricResume``, with real processes: Fabric's own launcher on 2 CPU
ranks (gloo) and 1 device, real SIGTERMs, reruns of the same command.

Every test compares with an uninterrupted run of the same command: the batch log (sample ids and a
fingerprint of each batch's values, the LR, the step) and the final weights must be identical.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_resume import FabricResume
from loader_resume.job.checkpoint_dir import LOCK_FILE
from loader_resume.testing import assert_delivers_rest_exactly_once
from support import forked
from support.audit import audited
from support.launch import CHILDREN, logs, progress_of, trained, weights
from support.reference import child_run

CHILD = CHILDREN / "fabric_child.py"
N, EPOCHS = 30, 3


def run(out: Path, devices: int, *args: str, expect: int = 0) -> str:
    """The Fabric child on ``devices`` processes (Fabric launches the other ranks itself); its
    stderr."""
    done = forked.run([sys.executable, str(CHILD), str(out), "--devices", str(devices), *args],
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == expect, done.stderr[-3000:]
    return done.stderr


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs: 2 ranks (map-style and a stream), 1 device."""
    # test_storage_faults.py's too
    runs = {"2": child_run(tmp_path_factory, "fabric_child.py", "--devices", "2")}
    for name, devices, args in (("2-stream", 2, ("--stream",)), ("1", 1, ())):
        out = tmp_path_factory.mktemp(f"full{name}")
        run(out, devices, *args)
        runs[name] = out
    # 30 items, 2 ranks, batches of 4: 4 a rank and epoch
    assert len(trained(logs(runs["2"])[0])) == EPOCHS * 4
    return runs


def checkpoints(out: Path) -> list[str]:
    return sorted(
        path.name for path in (out / "resume_checkpoints").iterdir() if path.name != LOCK_FILE
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_mid_epoch_then_the_same_command_continues_exactly(
    full: dict[str, Path], tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGTERM from outside to the whole process group (ranks and DataLoader workers), as a
    scheduler sends it: one checkpoint at the next step boundary, exit 143, and the rerun's batches
    and weights are the uninterrupted run's. Batches do not depend on num_workers, so both compare
    with the same run. The job's own audit (``LOADER_RESUME_AUDIT``) agrees."""
    monkeypatch.setenv("LOADER_RESUME_AUDIT", str(tmp_path / "audit"))
    first = forked.popen(
        [
            sys.executable,
            str(CHILD),
            str(tmp_path),
            "--devices",
            "2",
            "--workers",
            str(workers),
            "--sleep",
            "0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while progress_of(tmp_path / "progress-0") < 5:
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 5"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)  # a hang between the ranks would fail here
    assert first.returncode == 143, stderr[-3000:]
    assert "was built without audit=" not in stderr  # FabricResume's loaders read the variable
    stopped = trained(logs(tmp_path)[0])
    assert checkpoints(tmp_path) == [f"step_{len(stopped):09d}"] and 5 <= len(stopped) < EPOCHS * 4
    run(tmp_path, 2, "--workers", str(workers))
    assert logs(tmp_path) == logs(full["2"])  # the rerun's log appends to the first run's
    assert weights(tmp_path) == weights(full["2"])
    audited(tmp_path / "audit", [2, 2])


def test_an_iterable_dataset_resumes_exactly_on_every_rank(
    full: dict[str, Path], tmp_path: Path
) -> None:
    run(tmp_path, 2, "--stream", "--signal-at", "6", expect=143)
    assert checkpoints(tmp_path) == ["step_000000006"]
    run(tmp_path, 2, "--stream")
    assert logs(tmp_path) == logs(full["2-stream"]) and weights(tmp_path) == weights(
        full["2-stream"]
    )


def test_fabric_save_and_load_of_the_users_own_carry_every_ranks_loader_state(
    full: dict[str, Path], tmp_path: Path
) -> None:
    """``fabric.save(path, {..., "loader": loader})`` on a stream: Fabric writes rank 0's copy only,
    and rank 1's loader still gets its own state back from ``fabric.load``."""
    run(tmp_path, 2, "--stream", "--save-at", "5")
    assert not (tmp_path / "resume_checkpoints").exists() or not checkpoints(tmp_path)
    run(tmp_path, 2, "--stream", "--load", str(tmp_path / "explicit.ckpt"))
    assert logs(tmp_path) == logs(full["2-stream"]) and weights(tmp_path) == weights(
        full["2-stream"]
    )


def test_one_device_resumes_exactly(full: dict[str, Path], tmp_path: Path) -> None:
    run(tmp_path, 1, "--signal-at", "10", expect=143)  # 8 batches an epoch: the second epoch
    assert checkpoints(tmp_path) == ["step_000000010"]
    run(tmp_path, 1)
    assert logs(tmp_path) == logs(full["1"]) and weights(tmp_path) == weights(full["1"])


def test_a_mixture_whose_weights_change_resumes_exactly(tmp_path: Path) -> None:
    """Weights set after optimizer steps 3 and 9 (the loop's own calls); SIGTERM after batch 6: the
    checkpoint holds the first change, the rerun makes the second at the same step."""
    run(tmp_path / "full", 1, "--mixture")
    run(tmp_path / "cut", 1, "--mixture", "--signal-at", "6", expect=143)
    run(tmp_path / "cut", 1, "--mixture")
    uninterrupted = logs(tmp_path / "full")[0]
    assert logs(tmp_path / "cut") == [uninterrupted] and weights(tmp_path / "cut") == weights(
        tmp_path / "full"
    )


def test_two_ranks_checkpoint_resumes_on_one_delivering_the_rest_exactly_once(
    tmp_path: Path,
) -> None:
    run(tmp_path, 2, "--signal-at", "6", expect=143)  # rank 0's 6th batch: the second epoch
    cut = [trained(rows) for rows in logs(tmp_path)]
    epoch = cut[0][-1]["epoch"]
    assert epoch == 1
    for path in tmp_path.glob("log-*.jsonl"):
        path.unlink()
    run(tmp_path, 1)
    (resumed,) = [trained(rows) for rows in logs(tmp_path)]
    before = [i for rows in cut for row in rows if row["epoch"] == epoch for i in row["ids"]]
    after = [i for row in resumed if row["epoch"] == epoch for i in row["ids"]]
    assert_delivers_rest_exactly_once(before, after, N)
    for later in range(epoch + 1, EPOCHS):
        assert sorted(i for row in resumed if row["epoch"] == later for i in row["ids"]) == list(
            range(N)
        )
    assert resumed[0]["step"] == cut[0][-1]["step"] + 1


@pytest.fixture
def fabric_resume(tmp_path: Path) -> Iterator[tuple[Fabric, FabricResume]]:
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    resume = FabricResume(fabric, checkpoint_dir=tmp_path / "checkpoints")
    yield fabric, resume
    resume.close()


def test_bad_use_is_refused_naming_what_was_expected(fabric_resume: tuple[Fabric, FabricResume],
                                                     tmp_path: Path) -> None:
    fabric, resume = fabric_resume
    with pytest.raises(ValueError, match="already has one"):
        FabricResume(fabric)
    with pytest.raises(ValueError, match="check_every_n_steps=0"):
        FabricResume(fabric, check_every_n_steps=0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    with pytest.raises(ValueError, match="holds no optimizer"):
        resume.restore({"model": model})
    loader = fabric.setup_dataloaders(DataLoader(list(range(8)), batch_size=2))
    with pytest.raises(TypeError, match="not a torch DataLoader"):
        fabric.setup_dataloaders(list(range(8)))
    with pytest.raises(ValueError, match="state has a key 'loader_resume'"):
        fabric.save(tmp_path / "x.ckpt", {"model": model, "loader_resume": 1})
    fabric.save(tmp_path / "plain.ckpt", {"model": model, "loader": 3})
    # a plain value where the loader goes
    with pytest.raises(Exception, match="expected a reference to checkpoint"):
        fabric.load(tmp_path / "plain.ckpt", {"model": model, "loader": loader})


def test_loaders_are_refused_before_launch_on_several_devices(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")  # fabric.launch() forgotten
    resume = FabricResume(fabric, checkpoint_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"call fabric.launch\(\) first"):
        fabric.setup_dataloaders(DataLoader(list(range(8)), batch_size=2))
    resume.close()


def test_a_checkpoint_written_without_it_loads_with_a_warning(
    fabric_resume: tuple[Fabric, FabricResume], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fabric, _ = fabric_resume
    model = fabric.setup(torch.nn.Linear(2, 1))
    torch.save({"model": model.module.state_dict(), "epoch": 4}, tmp_path / "stock.ckpt")
    state = {"model": model, "epoch": 0}
    with caplog.at_level("WARNING", logger="lightning_resume"):
        fabric.load(tmp_path / "stock.ckpt", state)
    assert state["epoch"] == 4  # Fabric's own behaviour for plain values is kept
    assert any("has no loader_resume entry" in r.getMessage() for r in caplog.records)
