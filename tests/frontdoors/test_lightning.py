"""Lightning: a real `lightning.Trainer`, each resume in a fresh process
(tests/children/lightning_child.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from lightning_resume import ResumeCallback
from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_delivers_rest_exactly_once
from support import forked
from support.audit import audited
from support.batch import Done, run_batch
from support.data import Augmented
from support.launch import CHILDREN, progress_of
from support.reference import child_run

CHILD = CHILDREN / "lightning_child.py"


def run(out: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    done = forked.run(
        [sys.executable, str(CHILD), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    return done


def ok(out: Path, *args: str, cwd: Path | None = None) -> dict[str, Any]:
    done = run(out, *args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return finished(out, done.stderr)


def assert_continues(full: dict[str, Any], resumed: dict[str, Any], at: int) -> None:
    """Every rank's steps after the resume equal the uninterrupted run's, and so do the final
    weights."""
    for log, resumed_log in zip(full["logs"], resumed["logs"], strict=True):
        assert resumed_log[0][0] == at
        assert resumed_log == log[at:]
    assert resumed["weights"] == full["weights"]


def finished(out: Path, stderr: str = "") -> dict[str, Any]:
    """A finished run's logs and weights (every rank's), and its stderr."""
    ranks = sorted(out.glob("log-*.json"))
    return {
        "logs": [json.loads(p.read_text()) for p in ranks],
        "weights": [(out / f"weights-{p.stem.split('-')[1]}.txt").read_text() for p in ranks],
        "stderr": stderr,
    }


def outcome(out: Path, done: Done) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    return finished(out, done.stderr)


# The one-device runs that are neither signalled nor the subject of a process start run in two
# processes (tests/support/batch.py): the uninterrupted runs, then every resume from their
# checkpoints and the refusals.
VALIDATION = ["--val-every", "3", "--every", "3", "--onecycle", "--workers", "2"]
REFERENCES = {
    "single": ["--every", "2"],
    "workers": ["--workers", "2"],  # checkpoints every 3 steps
    "mixture": ["--mixture", "--every", "6"],
    "plain": ["--no-callback", "--every", "3"],
    "validation": VALIDATION,
    **{
        f"stream{workers}": ["--stream", "--workers", str(workers), "--every", "3"]
        for workers in (0, 2)
    },
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("references")
    done = run_batch(
        CHILD, [[str(root / name), *args] for name, args in REFERENCES.items()], root / "batch"
    )
    return {
        name: (root / name, outcome(root / name, each))
        for name, each in zip(REFERENCES, done, strict=True)
    }


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted DDP fit (made once per session: test_storage_faults.py compares with it
    too)."""
    out = child_run(tmp_path_factory, "lightning_child.py", "--devices", "2", "--every", "2")
    return out, finished(out)


@pytest.fixture(scope="module")
def resumed(references: dict[str, tuple[Path, dict[str, Any]]], ddp: tuple[Path, dict[str, Any]],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Done]]:
    """Each one-device resume (and refusal) of the tests below, in one fresh process, in this
    order."""
    root = tmp_path_factory.mktemp("resumed")

    def at(name: str, checkpoint: str) -> str:
        return str(references[name][0] / "ckpt" / f"{checkpoint}.ckpt")

    # a job killed after step 11: its last.ckpt is step 10's save
    (root / "last" / "ckpt").mkdir(parents=True)
    shutil.copy(at("single", "step=10"), root / "last" / "ckpt" / "last.ckpt")
    runs = {
        **{
            checkpoint: ["--every", "2", "--resume", at("single", checkpoint)]
            for checkpoint in ("step=6", "step=8", "step=10")
        },
        "last": ["--every", "100", "--resume", "last"],
        "workers": ["--workers", "2", "--resume", at("workers", "step=9")],
        "mixture": ["--mixture", "--resume", at("mixture", "step=6")],
        "ddp-on-one": ["--every", "100", "--resume", str(ddp[0] / "ckpt" / "step=2.ckpt")],
        "validation": [*VALIDATION, "--resume", at("validation", "step=6")],
        **{
            f"stream{w}": [
                "--stream",
                "--workers",
                str(w),
                "--every",
                "3",
                "--resume",
                at(f"stream{w}", "step=6"),
            ]
            for w in (0, 2)
        },
        "plain": ["--resume", at("plain", "step=3")],
        "length": ["--n-resume", "31", "--resume", at("single", "step=6")],  # refused
        "two-callbacks": ["--two-callbacks"],  # refused
    }
    done = run_batch(
        CHILD, [[str(root / name), *args] for name, args in runs.items()], root / "batch"
    )
    return {name: (root / name, each) for name, each in zip(runs, done, strict=True)}


def resume(resumed: dict[str, tuple[Path, Done]], name: str) -> dict[str, Any]:
    return outcome(*resumed[name])


@pytest.mark.parametrize(("checkpoint", "at"), [("step=6", 6), ("step=8", 8), ("step=10", 10)])
def test_resume_from_mid_epoch_and_epoch_end_checkpoints_is_exact(
    references: dict[str, tuple[Path, dict[str, Any]]],
    resumed: dict[str, tuple[Path, Done]],
    checkpoint: str,
    at: int,
) -> None:
    """8 batches an epoch: step 6 is mid-epoch, step 8 the epoch's last batch (no empty epoch), 10
    in epoch 1."""
    assert_continues(references["single"][1], resume(resumed, checkpoint), at)


def test_resume_from_last_is_exact(references: dict[str, tuple[Path, dict[str, Any]]],
                                   resumed: dict[str, tuple[Path, Done]]) -> None:
    """A job killed after step 11: its last.ckpt is the periodic save of step 10
    (save_last=True)."""
    assert_continues(references["single"][1], resume(resumed, "last"), 10)


def test_resume_with_workers_is_exact(references: dict[str, tuple[Path, dict[str, Any]]],
                                      resumed: dict[str, tuple[Path, Done]]) -> None:
    assert_continues(references["workers"][1], resume(resumed, "workers"), 9)


def test_a_mixture_whose_weights_a_callback_changes_resumes_exactly(
    references: dict[str, tuple[Path, dict[str, Any]]], resumed: dict[str, tuple[Path, Done]]
) -> None:
    """A user's callback sets the weights after steps 3 and 9; resumed from the checkpoint of step 6
    (the first change inside it), the same callback makes the second change at the same step."""
    assert_continues(references["mixture"][1], resume(resumed, "mixture"), 6)


def test_ddp_ranks_each_see_half_of_every_epoch_disjoint(ddp: tuple[Path, dict[str, Any]]) -> None:
    logs = ddp[1]["logs"]
    assert len(logs) == 2 and len(logs[0]) == len(logs[1]) == 12
    for epoch in range(3):
        per_rank = [[i for row in log[4 * epoch : 4 * epoch + 4] for i in row[1]] for log in logs]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == list(range(30)) and len(per_rank[0]) == 15


def test_ddp_resume_is_exact_per_rank(ddp: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    resumed = ok(
        tmp_path, "--devices", "2", "--every", "2", "--resume", str(ddp[0] / "ckpt" / "step=2.ckpt")
    )
    assert_continues(ddp[1], resumed, 2)


def test_ddp_checkpoint_resumes_on_one_device_delivering_the_rest_exactly_once(
    ddp: tuple[Path, dict[str, Any]], resumed: dict[str, tuple[Path, Done]]
) -> None:
    on_one = resume(resumed, "ddp-on-one")
    before = [i for log in ddp[1]["logs"] for row in log[:2] for i in row[1]]
    rest: list[int] = []
    for row in on_one["logs"][0]:
        if len(before) + len(rest) >= 30:
            break
        rest += row[1]
    assert_delivers_rest_exactly_once(before, rest, 30)


def test_single_device_checkpoint_resumes_on_two_devices_delivering_the_rest_exactly_once(
    references: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    out, single = references["single"]
    resumed = ok(
        tmp_path, "--devices", "2", "--every", "100", "--resume", str(out / "ckpt" / "step=4.ckpt")
    )
    before = [i for row in single["logs"][0][:4] for i in row[1]]
    rest = [i for log in resumed["logs"] for row in log if row[0] < 6 for i in row[1]]
    assert_delivers_rest_exactly_once(before, rest, 30)


def test_checkpoint_without_our_state_warns_that_the_order_restarts(
    resumed: dict[str, tuple[Path, Done]],
) -> None:
    # resumed from a checkpoint of a fit without ResumeCallback
    stderr = resume(resumed, "plain")["stderr"]
    assert "no loader_resume state" in stderr and "restarts from the start of the epoch" in stderr


def test_checkpoint_from_another_dataset_length_fails_clearly(
    resumed: dict[str, tuple[Path, Done]],
) -> None:
    done = resumed["length"][1]
    assert done.returncode != 0
    assert "loader state field 'dataset_len': saved 30, expected 31" in done.stderr


def test_two_resume_callbacks_are_refused(resumed: dict[str, tuple[Path, Done]]) -> None:
    done = resumed["two-callbacks"][1]
    assert done.returncode != 0 and "more than one ResumeCallback" in done.stderr


def test_a_dataset_split_per_rank_is_refused_under_ddp(tmp_path: Path) -> None:
    done = run(tmp_path, "--devices", "2", "--split-per-rank")
    assert done.returncode != 0
    assert "the ranks' datasets differ" in done.stderr and "split_dataset_by_node" in done.stderr


# --- conversion (in process) ----------------------------------------------------------------------
def _collate(items: list[Any]) -> list[Any]:
    return items


def test_plain_loaders_are_converted_keeping_their_settings() -> None:
    dataset = Augmented(10)
    plain = DataLoader(
        dataset,
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    callback = ResumeCallback(seed=3)
    tree = callback._training.convert({"a": plain, "b": [DataLoader(dataset, batch_size=2)]})
    converted = tree["a"]
    assert isinstance(converted, ResumableDataLoader) and converted.dataset is dataset
    assert (
        converted.batch_size,
        converted.num_workers,
        converted.collate_fn,
        converted.pin_memory,
        converted.drop_last,
        converted.persistent_workers,
        converted.seed,
    ) == (3, 2, _collate, True, True, True, 3)
    assert converted.state_dict()["shuffle"] and not tree["b"][0].state_dict()["shuffle"]
    assert len(callback._training.loaders) == 2


def test_combined_loader_and_custom_sampler_are_converted() -> None:
    dataset = Augmented(10)
    custom = SequentialSampler(range(5))  # not DataLoader's own: kept, as a custom sampler
    combined = CombinedLoader(
        {"x": DataLoader(dataset, batch_size=2, sampler=custom)}, "max_size_cycle"
    )
    callback = ResumeCallback()
    callback._training.convert(combined)
    (loader,) = combined.flattened
    assert isinstance(loader, ResumableDataLoader)
    assert [b["id"].tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert torch.is_tensor(next(iter(loader))["torch"])


# --- preemption: a real SIGTERM from the test, then the same command again ------------------------
def preempted_then_rerun(
    out: Path, devices: int, whole_group: bool, natural: bool = False
) -> dict[str, Any]:
    """SIGTERM mid-epoch (from the test, via os.kill / os.killpg), then rerun the same command.

    ``natural``: ``ResumeCallback()`` with no dirpath, ``Trainer(default_root_dir=out)``, run from
    another working directory: the restart must find the checkpoint in ``default_root_dir`` by
    itself."""
    command = [
        sys.executable,
        str(CHILD),
        str(out),
        "--sleep",
        "0.15",
        "--append",
        "--workers",
        "2",
        "--devices",
        str(devices),
        *(["--no-dirpath"] if natural else []),
    ]
    out.mkdir(parents=True)
    cwd = out.parent / "elsewhere"
    cwd.mkdir()
    first = forked.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=cwd)
    progress = out / "progress-0"
    deadline = time.monotonic() + 120
    while progress_of(progress) < 4:
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 4"
        time.sleep(0.02)
    (os.killpg if whole_group else os.kill)(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)  # a hang under DDP would fail here
    assert first.returncode == 143, stderr[-3000:]
    assert (out / "preempted.ckpt").exists() and not (out / "preempted.ckpt.tmp").exists()
    stopped_at = [len(json.loads((out / f"log-{r}.json").read_text())) for r in range(devices)]
    # stopped mid-training
    assert all(4 <= n < 12 * (3 - devices + 1) for n in stopped_at), stopped_at
    assert not list(cwd.iterdir())  # nothing went to the working directory
    return ok(out, *command[3:], cwd=cwd)


@pytest.mark.parametrize(("devices", "whole_group", "natural"),
                         [(1, False, False), (2, False, False), (2, True, True), (1, False, True)])
def test_sigterm_checkpoints_at_a_step_boundary_and_a_rerun_continues_exactly(
    references: dict[str, tuple[Path, dict[str, Any]]],
    ddp: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    devices: int,
    whole_group: bool,
    natural: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``natural``: what users pick first, ``Trainer(default_root_dir=d,
    callbacks=[ResumeCallback()])``. On two devices the signal to the whole group and the natural
    setup are one case (they are independent: the signal's path to the ranks, where the checkpoint
    is found). The jobs run with 2 workers; batches do not depend on num_workers (the augmentation
    is keyed), so the 2-device job compares with the uninterrupted DDP run. The job's own audit
    (``LOADER_RESUME_AUDIT``) agrees."""
    monkeypatch.setenv("LOADER_RESUME_AUDIT", str(tmp_path / "audit"))
    resumed = preempted_then_rerun(tmp_path / "job", devices, whole_group, natural)
    audited(tmp_path / "audit", [devices, devices])
    full = references["workers"][1] if devices == 1 else ddp[1]
    assert resumed["logs"] == full["logs"]  # the restarted job's log appends to the first run's
    assert resumed["weights"] == full["weights"]
    # a finished fit leaves nothing to resume
    assert not (tmp_path / "job" / "preempted.ckpt").exists()


def test_unknown_signal_name_is_refused() -> None:
    with pytest.raises(ValueError, match="signals: unknown signal 'SIGTERMM'"):
        ResumeCallback(signals=("SIGTERMM",))


def test_validation_mid_epoch_and_estimated_stepping_batches_keep_resume_exact(
    references: dict[str, tuple[Path, dict[str, Any]]], resumed: dict[str, tuple[Path, Done]]
) -> None:
    """Validation every 3 steps (its own shuffled loader) does not move the training position, a
    checkpoint written right after it resumes exactly, and estimated_stepping_batches in
    configure_optimizers (which loads the training loaders early) does not lose the loader state."""
    full = references["validation"][1]
    assert [row[0] for row in full["logs"][0]] == list(range(24))
    assert_continues(full, resume(resumed, "validation"), 6)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_without_len_loses_no_batch_to_lightnings_prefetch(
    references: dict[str, tuple[Path, dict[str, Any]]],
    resumed: dict[str, tuple[Path, Done]],
    workers: int,
) -> None:
    """Lightning fetches one batch ahead from a loader without __len__; the saved state must not
    skip it."""
    assert_continues(references[f"stream{workers}"][1], resume(resumed, f"stream{workers}"), 6)


def test_ddp_keeps_a_custom_sampler_sharded_by_our_rules_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    options = ["--custom-sampler", "--devices", "2", "--every", "2"]
    full = ok(tmp_path / "full", *options)
    for epoch in range(3):
        halves = [
            [i for row in log[4 * epoch : 4 * epoch + 4] for i in row[1]] for log in full["logs"]
        ]
        assert not set(halves[0]) & set(halves[1]) and sorted(halves[0] + halves[1]) == list(
            range(30)
        )
    resumed = ok(
        tmp_path / "resumed", *options, "--resume", str(tmp_path / "full" / "ckpt" / "step=6.ckpt")
    )
    assert_continues(full, resumed, 6)


def test_under_slurm_sigusr1_saves_at_a_step_boundary_not_in_lightnings_handler(
    references: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    """A simulated SLURM job (Lightning detects SLURMEnvironment and arms its auto-requeue handler,
    which would save hpc_ckpt_*.ckpt inside the signal handler, mid-step, and call scontrol). Ours
    saves at the step boundary and requeues once it is written. The fake scontrol records any call:
    the only thing that cannot exist here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "digits",
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
    }
    out = tmp_path / "job"
    out.mkdir()
    command = [
        sys.executable,
        str(CHILD),
        str(out),
        "--sleep",
        "0.15",
        "--append",
        "--workers",
        "2",
    ]
    first = forked.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **slurm})
    progress = out / "progress-0"
    while progress_of(progress) < 4:
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGUSR1)
    stderr = first.communicate(timeout=120)[1]
    assert first.returncode == 143, stderr[-3000:]
    assert not list(out.glob("hpc_ckpt_*.ckpt")) and (out / "preempted.ckpt").exists()
    assert calls.read_text().splitlines() == ["requeue 4242"]
    rerun = forked.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, **slurm}
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    full = references["workers"][1]
    assert json.loads((out / "log-0.json").read_text()) == full["logs"][0]
    assert (out / "weights-0.txt").read_text() == full["weights"][0]


# --- LightningCLI: the callback configured in YAML or on the command line -------------------------
CLI_CHILD = CHILDREN / "lightning_cli_child.py"


def cli_command(out: Path, how: str) -> list[str]:
    """``fit`` with a config file holding the trainer; ``how``: where ResumeCallback is configured.

    ``"yaml"``: in the config's ``trainer.callbacks``, with no dirpath (only
    ``trainer.default_root_dir`` says where things go); ``"argument"``:
    ``--trainer.callbacks+=lightning_resume.ResumeCallback`` with a dirpath."""
    out.mkdir(parents=True, exist_ok=True)
    callback = {"class_path": "lightning_resume.ResumeCallback", "init_args": {"seed": 7}}
    config = {
        "trainer": {
            "default_root_dir": str(out),
            "max_epochs": 3,
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "deterministic": True,
            "callbacks": [callback] if how == "yaml" else [],
        },
        "model": {"out": str(out), "sleep": 0.1, "workers": 2},
    }
    (out / "cli.yaml").write_text(json.dumps(config))  # JSON is YAML
    command = [sys.executable, str(CLI_CHILD), "fit", "--config", str(out / "cli.yaml")]
    if how == "argument":
        command += [
            "--trainer.callbacks+=lightning_resume.ResumeCallback",
            "--trainer.callbacks.seed=7",
            f"--trainer.callbacks.dirpath={out / 'preemption'}",
        ]
    return command


def cli_rows(out: Path) -> list[Any]:
    log = out / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def cli_full(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], str]:
    out = tmp_path_factory.mktemp("cli_full")
    done = forked.run(
        cli_command(out, "yaml"), capture_output=True, text=True, timeout=300, cwd=out
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cli_rows(out), (out / "weights.txt").read_text()


@pytest.mark.parametrize("how", ["yaml", "argument"])
def test_lightning_cli_sigterm_and_the_same_command_again_continues_exactly(
        cli_full: tuple[list[Any], str], tmp_path: Path, how: str) -> None:
    out, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    command = cli_command(out, how)
    elsewhere.mkdir()
    first = forked.popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=elsewhere
    )
    deadline = time.monotonic() + 120
    while len(cli_rows(out)) < 4:
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 4"
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr[-3000:]
    where = out / "preemption" if how == "argument" else out
    assert (where / "preempted.ckpt").exists()
    assert 4 <= len(cli_rows(out)) < len(cli_full[0])
    again = forked.run(command, capture_output=True, text=True, timeout=300, cwd=elsewhere)
    assert again.returncode == 0, again.stderr[-3000:]
    # the rerun's steps continue the first run's: together, the full run
    assert cli_rows(out) == cli_full[0]
    assert (out / "weights.txt").read_text() == cli_full[1]
    assert not (where / "preempted.ckpt").exists()


def test_resume_callback_alone_means_preemption_checkpoints_only() -> None:
    """What users mean by enable_checkpointing=False (which Lightning refuses with any checkpoint
    callback, ours included, before our code runs): with ResumeCallback and no ModelCheckpoint,
    Lightning adds no periodic one."""
    import lightning as L

    callback = ResumeCallback()
    trainer = L.Trainer(accelerator="cpu", callbacks=[callback], logger=False)
    assert trainer.checkpoint_callbacks == [callback]
    plain = L.Trainer(accelerator="cpu", logger=False)
    # the default we replace
    assert [type(c).__name__ for c in plain.checkpoint_callbacks] == ["ModelCheckpoint"]


class _Tiny(L.LightningModule):
    """Records the sample ids of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        self.seen.append(batch[0].flatten().long().tolist())
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def test_step(self, batch: Any, index: int) -> None:
        self.log("test_loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return _ids_loader()

    def test_dataloader(self) -> DataLoader[Any]:
        return _ids_loader()


def _ids_loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=2, shuffle=True)


def _quiet_trainer(root: Path, callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


def test_loaders_handed_to_fit_resume_mid_epoch_too(tmp_path: Path) -> None:
    """fit(model, train_dataloaders=...): those loaders exist before Lightning restores the
    checkpoint's state."""
    full = _Tiny()
    periodic = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1)
    _quiet_trainer(tmp_path, [ResumeCallback(), periodic]).fit(
        full, train_dataloaders=_ids_loader()
    )
    (mid_epoch,) = (tmp_path / "ckpts").glob("*step=3.ckpt")  # 4 steps an epoch
    resumed = _Tiny()
    _quiet_trainer(tmp_path, [ResumeCallback()]).fit(
        resumed, train_dataloaders=_ids_loader(), ckpt_path=mid_epoch
    )
    assert len(full.seen) == 8 and resumed.seen == full.seen[3:]


def test_a_model_checkpoint_listed_after_ours_stays_lightnings_checkpoint_callback(
    tmp_path: Path,
) -> None:
    """Lightning (ckpt_path="best", its launchers, its loggers) reads ModelCheckpoint attributes
    from the first checkpoint callback in the list; listing ResumeCallback first must not make it
    that one."""
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="loss", save_top_k=1)
    trainer = _quiet_trainer(tmp_path, [ResumeCallback(dirpath=str(tmp_path)), best])
    trainer.fit(_Tiny())
    assert trainer.checkpoint_callback is best and best.best_model_path
    trainer.test(ckpt_path="best")
    assert trainer.ckpt_path == best.best_model_path


def test_a_fresh_fit_warns_nothing_about_ckpt_path(tmp_path: Path) -> None:
    """Lightning warns on every fit() without ckpt_path when an OnExceptionCheckpoint is present (it
    then looks for the "last" checkpoint, which is how a restart finds ours); on a fresh fit there
    is nothing to act on."""
    import warnings

    last = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quiet_trainer(tmp_path, [ResumeCallback(), last]).fit(_Tiny())
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "ckpt_path=None" in m or 'ckpt_path="last") is set' in m], said


def test_fit_leaves_the_signal_handlers_as_it_found_them(tmp_path: Path) -> None:
    """Lightning puts its predecessors back at the end of fit(), before our teardown: ours must not
    then put Lightning's own handler back (a later SIGTERM would only be recorded, and the process
    would not end)."""
    import signal

    before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    _quiet_trainer(tmp_path, [ResumeCallback(dirpath=str(tmp_path))]).fit(_Tiny())
    assert {number: signal.getsignal(number) for number in before} == before


def test_a_module_with_validation_step_but_no_validation_loader_still_fits(tmp_path: Path) -> None:
    """The validation loaders' workers are made to ignore our signals only where the module defines
    some: an undefined val_dataloader stays undefined, and Lightning skips the validation loop as
    without us."""

    class NoValLoader(_Tiny):
        def validation_step(self, batch: Any, index: int) -> None:
            self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    model = NoValLoader()
    _quiet_trainer(tmp_path, [ResumeCallback(dirpath=str(tmp_path))]).fit(model)
    assert len(model.seen) == 8


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fit_stopped_by_max_steps_saved_and_extended_continues_with_the_very_next_batch(
    tmp_path: Path, workers: int
) -> None:
    """fit(max_steps=7), trainer.save_checkpoint(...), then fit(ckpt_path=...) with a higher
    max_steps (extending a run): steps 8..12 are the uninterrupted fit's, mid-epoch (8 steps an
    epoch), whatever became of the iterator."""

    def loader() -> DataLoader[Any]:
        return DataLoader(
            TensorDataset(torch.arange(16.0).unsqueeze(1)),
            batch_size=2,
            shuffle=True,
            num_workers=workers,
        )

    def trainer(max_steps: int) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            max_steps=max_steps,
            callbacks=[ResumeCallback(dirpath=str(tmp_path))],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
        )

    full = _Tiny()
    trainer(12).fit(full, train_dataloaders=loader())
    stopped = _Tiny()
    first = trainer(7)
    first.fit(stopped, train_dataloaders=loader())
    first.save_checkpoint(tmp_path / "at-7.ckpt")
    extended = _Tiny()
    trainer(12).fit(extended, train_dataloaders=loader(), ckpt_path=tmp_path / "at-7.ckpt")
    assert len(full.seen) == 12 and stopped.seen == full.seen[:7] and extended.seen == full.seen[7:]
