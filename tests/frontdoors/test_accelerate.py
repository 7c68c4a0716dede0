"""Accelerate: `enable_resume` in real processes — one (`python`), two (`accelerate launch
--multi_gpu --num_processes 2` with `Accelerator(cpu=True)`, gloo; the child asserts the world
size).

Each case is a failure measured with Accelerate's own resume support (see the issue): wrong samples
after `load_state`, the epoch counter lost under two processes, prefetch before `load_state` with
workers, augmentations that never match, a changed worker count, a changed process count, SIGTERM
saving nothing.
"""

from __future__ import annotations

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
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader

from accelerate_resume import (
    AcceleratedResumableDataLoader,
    ResumeConfig,
    enable_resume,
    load_config,
)
from loader_resume import ResumableDataLoader
from loader_resume.job.checkpoint import MANIFEST
from loader_resume.testing import assert_delivers_rest_exactly_once
from support import forked
from support.audit import audited
from support.batch import Done, run_batch
from support.data import Augmented
from support.launch import (
    ACCELERATE_CHILD,
    command,
    free_port,
    logs,
    progress_of,
    run,
    trained,
    weights,
)
from support.reference import accelerate_run

ROOT = Path(__file__).resolve().parents[2]
N, EPOCHS = 30, 3  # 1 process: 8 batches an epoch; 2 processes: 4 per rank


EVAL = ["--eval-n", "13"]
ONE_PROCESS = {  # the uninterrupted one-process runs
    "1": EVAL, "workers": [*EVAL, "--workers", "2"], "stream": ["--stream", "--workers", "2"],
    "accumulate": ["--accumulate", "2", "--items", "26", "--workers", "2"],
    "periodic": ["save_every_n_steps=5", "keep=2"],
}
# processes, workers, the step of save_state
SAVE_LOAD = [(1, 0, 10), (1, 2, 10), (2, 0, 6), (2, 2, 6)]
DAMAGES = ["flip", "truncate", "edit"]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Path]:
    """Uninterrupted runs: with an evaluation after each epoch on 1 process (0 and 2 workers) and on
    2; a stream at 2 workers; accumulation 2 over 7 batches an epoch; periodic checkpoints. The
    one-process runs run in one process (tests/support/batch.py)."""
    root = tmp_path_factory.mktemp("full")
    done = run_batch(
        ACCELERATE_CHILD,
        [[str(root / name), *args] for name, args in ONE_PROCESS.items()],
        root / "batch",
    )
    for name, each in zip(ONE_PROCESS, done, strict=True):
        assert each.returncode == 0, f"{name}: {each.stderr[-3000:]}"
    runs: dict[Any, Path] = {1 if name == "1" else name: root / name for name in ONE_PROCESS}
    runs[2] = root / "2"
    run(runs[2], 2, *EVAL)
    return runs


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-process jobs stopped by their own hand, each a process of its own (they end with os._exit
    or a signal): save_state then a crash, a loop's break then save_state, a SIGTERM (copied before
    any rerun)."""
    root = tmp_path_factory.mktemp("stopped")
    runs = {}
    for processes, workers, at in SAVE_LOAD:
        name = f"save-{processes}-{workers}"
        run(root / name, processes, *EVAL, "--workers", str(workers), "--save-at", str(at))
        runs[name] = root / name
    for name, options in (("break-map", EVAL), ("break-stream", ["--stream"])):
        run(root / name, 1, "--workers", "2", *options, "--break-at", "5")
        runs[name] = root / name
    for name, processes, options in (
        ("preempted1", 1, [*EVAL, "--signal-at", "11"]),
        ("preempted2", 2, [*EVAL, "--signal-at", "6"]),
        ("accumulate", 1, [*ONE_PROCESS["accumulate"], "--signal-at", "8"]),
        ("stream", 1, ["--stream", "--workers", "2", "--signal-at", "11"]),
    ):
        run(root / name, processes, *options, expect=143)
        runs[name] = root / name
    return runs


@pytest.fixture(scope="module")
def resumed(
    stopped: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Done]]:
    """Every one-process continuation of a stopped job (load_state, the automatic resume, the same
    command again) and the refusals, in one fresh process (tests/support/batch.py), each in a copy
    of the job it continues, changed as its test says."""
    root = tmp_path_factory.mktemp("resumed")

    def copy(name: str, of: str) -> Path:
        shutil.copytree(stopped[of], root / name)
        return root / name

    runs: list[tuple[Path, list[str]]] = []
    for _, workers, _ in [case for case in SAVE_LOAD if case[0] == 1]:
        out = copy(f"load-1-{workers}", f"save-1-{workers}")
        runs.append((out, [*EVAL, "--workers", str(workers), "--load", str(out / "explicit")]))
    for name, options in (("break-map", EVAL), ("break-stream", ["--stream"])):
        out = copy(name, name)
        runs.append((out, ["--workers", "2", *options, "--load", str(out / "explicit")]))
    out = copy("2-on-1", "preempted2")
    for path in out.glob("log-*.jsonl"):
        path.unlink()
    runs.append((out, EVAL))
    out = copy("skip", "preempted1")
    checkpoints = out / "resume_checkpoints"
    (sealed,) = checkpoints.iterdir()
    # killed before it was sealed and renamed
    shutil.copytree(sealed, checkpoints / ".step_000000099.tmp")
    shutil.copytree(sealed, checkpoints / "step_000000098")
    (checkpoints / "step_000000098" / MANIFEST).unlink()
    runs.append((out, EVAL))
    for damage in DAMAGES:
        out = copy(f"damaged-{damage}", "preempted1")
        (sealed,) = (out / "resume_checkpoints").iterdir()
        spoil(sealed / ("model.safetensors" if damage == "flip" else "loader_resume.pt"), damage)
        runs.append((out, EVAL))
    runs.append((copy("another-dataset", "preempted1"), ["--items", "20"]))
    # the same command again
    runs.append((copy("accumulate", "accumulate"), ONE_PROCESS["accumulate"]))
    runs.append((copy("stream", "stream"), ["--stream", "--workers", "2"]))
    done = run_batch(ACCELERATE_CHILD, [[str(out), *args] for out, args in runs], root / "batch")
    return {out.name: (out, each) for (out, _), each in zip(runs, done, strict=True)}


def spoil(target: Path, damage: str) -> None:
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # an edited state: a valid file, another position
        state = torch.load(target, weights_only=True)
        state["loaders"][0]["ranks"][0]["position"] = 0
        torch.save(state, target)
        data = bytearray(target.read_bytes())
    target.write_bytes(bytes(data))


def finished(resumed: dict[str, tuple[Path, Done]], name: str, expect: int = 0) -> tuple[Path, str]:
    out, done = resumed[name]
    assert done.returncode == expect, f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return out, done.stderr


# --- real runs ------------------------------------------------------------------------------------
def test_two_processes_shard_every_epoch_disjointly_and_gather_for_metrics_drops_the_padding(
    full: dict[Any, Path],
) -> None:
    ranks = logs(full[2])
    for epoch in range(EPOCHS):
        seen = [
            [i for row in trained(rows) if row["epoch"] == epoch for i in row["ids"]]
            for rows in ranks
        ]
        assert len(seen[0]) == len(seen[1]) == N // 2 and sorted(seen[0] + seen[1]) == list(
            range(N)
        )
    evaluations = [row["eval"] for row in ranks[0] if "eval" in row]
    # 13 items over 2 ranks x 4: the padded item is dropped
    assert evaluations == [list(range(13))] * EPOCHS


def test_batches_do_not_depend_on_num_workers(full: dict[Any, Path]) -> None:
    assert logs(full["workers"]) == logs(full[1]) and weights(full["workers"]) == weights(full[1])


@pytest.mark.parametrize(("processes", "workers", "at"), SAVE_LOAD)
def test_save_state_then_load_state_in_a_fresh_process_is_exact(
    full: dict[Any, Path],
    stopped: dict[str, Path],
    resumed: dict[str, tuple[Path, Done]],
    tmp_path: Path,
    processes: int,
    workers: int,
    at: int,
) -> None:
    """The user's own save_state / load_state, in the second epoch (the epoch counter must
    survive)."""
    assert trained(logs(stopped[f"save-{processes}-{workers}"])[0])[-1]["epoch"] == 1
    if processes == 1:
        out, _ = finished(resumed, f"load-1-{workers}")
    else:
        out = tmp_path
        shutil.copytree(stopped[f"save-{processes}-{workers}"], out, dirs_exist_ok=True)
        run(out, processes, *EVAL, "--workers", str(workers), "--load", str(out / "explicit"))
    assert logs(out) == logs(full[processes])
    assert weights(out) == weights(full[processes])


@pytest.mark.parametrize("stream", [False, True])
def test_a_loop_that_breaks_then_save_state_continues_its_pass_in_a_fresh_process(
    full: dict[Any, Path],
    stopped: dict[str, Path],
    resumed: dict[str, tuple[Path, Done]],
    stream: bool,
) -> None:
    """A stop flag's ``break`` at step 5 (mid-epoch), then ``accelerator.save_state`` after the
    loop: the loop left the pass, its generator is closed, nothing ran out. ``load_state`` in a
    fresh process continues with the very next batch; a stream's batch fetched ahead of the loop is
    not lost."""
    name = "break-stream" if stream else "break-map"
    assert trained(logs(stopped[name])[0])[-1]["step"] == 5
    out, _ = finished(resumed, name)
    reference = full["stream"] if stream else full[1]
    assert logs(out) == logs(reference) and weights(out) == weights(reference)


def preempt(out: Path, processes: int, whole_group: bool, *args: str) -> None:
    """A real SIGTERM from the test, mid-epoch, to rank 0 or to the whole process group."""
    first = forked.popen(
        command(out, processes, "--sleep", "0.1", *args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    progress = out / "progress-0"
    deadline = time.monotonic() + 120
    while progress_of(progress) < 5:
        assert time.monotonic() < deadline and first.poll() is None, "training never reached step 5"
        time.sleep(0.02)
    if whole_group:
        os.killpg(first.pid, signal.SIGTERM)
    else:
        os.kill(int((out / "pid-0").read_text()), signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)  # a hang between the ranks would fail here
    assert first.returncode == 143 if processes == 1 else first.returncode != 0, stderr[-3000:]
    # signalled itself, the launcher lets its ranks finish and reports
    if processes > 1 and not whole_group:
        assert "exitcode  : 143" in stderr, stderr[-3000:]


@pytest.mark.parametrize("whole_group", [False, True])
def test_sigterm_mid_epoch_checkpoints_at_a_step_boundary_and_the_same_command_continues(
    full: dict[Any, Path], tmp_path: Path, whole_group: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the job's own audit agrees, last
    monkeypatch.setenv("LOADER_RESUME_AUDIT", str(tmp_path / "audit"))
    preempt(tmp_path, 2, whole_group, *EVAL, "--workers", "2")
    checkpoints = sorted(p.name for p in (tmp_path / "resume_checkpoints").iterdir())
    stopped = trained(logs(tmp_path)[0])
    assert checkpoints == [f"step_{len(stopped):09d}"] and 5 <= len(stopped) < EPOCHS * 4
    run(tmp_path, 2, *EVAL, "--workers", "2")
    assert logs(tmp_path) == logs(full[2])  # the rerun's log appends to the first run's
    assert weights(tmp_path) == weights(full[2])
    audited(tmp_path / "audit", [2, 2])


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_process_count_delivering_the_rest_exactly_once(
    stopped: dict[str, Path],
    resumed: dict[str, tuple[Path, Done]],
    tmp_path: Path,
    before: int,
    after: int,
) -> None:
    cut = [trained(rows) for rows in logs(stopped[f"preempted{before}"])]
    epoch = cut[0][-1]["epoch"]
    assert epoch == 1
    if after == 1:
        out, _ = finished(resumed, "2-on-1")
    else:
        out = tmp_path
        shutil.copytree(stopped[f"preempted{before}"], out, dirs_exist_ok=True)
        for path in out.glob("log-*.jsonl"):
            path.unlink()
        run(out, after, *EVAL)
    resumed_rows = [trained(rows) for rows in logs(out)]
    before_cut = [i for rows in cut for row in rows if row["epoch"] == epoch for i in row["ids"]]
    after_cut = [
        i for rows in resumed_rows for row in rows if row["epoch"] == epoch for i in row["ids"]
    ]
    assert_delivers_rest_exactly_once(before_cut, after_cut, N)
    for later in range(epoch + 1, EPOCHS):
        assert sorted(
            i for rows in resumed_rows for row in rows if row["epoch"] == later for i in row["ids"]
        ) == list(range(N))
    assert (
        min(row["step"] for rows in resumed_rows for row in rows)
        == max(row["step"] for row in cut[0]) + 1
    )


def test_automatic_resume_skips_an_interrupted_save_and_an_unsealed_directory_with_a_warning(
    full: dict[Any, Path], resumed: dict[str, tuple[Path, Done]]
) -> None:
    out, stderr = finished(resumed, "skip")
    root = out / "resume_checkpoints"
    assert (
        f"deleting {root / '.step_000000099.tmp'}: left by a write interrupted in an earlier job"
        in stderr
    )
    assert not (root / ".step_000000099.tmp").exists()
    assert "step_000000098: it has no loader_resume_manifest.json" in stderr
    assert logs(out) == logs(full[1]) and weights(out) == weights(full[1])


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_the_file(
    resumed: dict[str, tuple[Path, Done]], damage: str
) -> None:
    out, stderr = finished(resumed, f"damaged-{damage}", expect=1)
    (sealed,) = (out / "resume_checkpoints").iterdir()
    target = sealed / ("model.safetensors" if damage == "flip" else "loader_resume.pt")
    assert f"CheckpointError: {target}:" in stderr and "refusing to load it" in stderr


def test_gradient_accumulation_is_never_split_and_resume_is_exact(
    full: dict[Any, Path], stopped: dict[str, Path], resumed: dict[str, tuple[Path, Done]]
) -> None:
    """26 items, 4 a batch: 7 batches an epoch, so the last accumulation is cut short by the epoch's
    end; the signal comes after micro-batch 8, which does not sync."""
    stopped_rows = logs(stopped["accumulate"])[0]
    # waited for the step
    assert not stopped_rows[7]["sync"] and len(stopped_rows) == 9 and stopped_rows[-1]["sync"]
    out, _ = finished(resumed, "accumulate")
    assert logs(out) == logs(full["accumulate"])
    assert weights(out) == weights(full["accumulate"])
    syncs = [row["sync"] for row in logs(full["accumulate"])[0][:7]]
    assert syncs == [False, True, False, True, False, True, True]  # the epoch's end syncs


def test_iterable_dataset_with_workers_resumes_exactly_after_sigterm(
    full: dict[Any, Path], resumed: dict[str, tuple[Path, Done]]
) -> None:
    out, _ = finished(resumed, "stream")
    assert logs(out) == logs(full["stream"])
    assert weights(out) == weights(full["stream"])


def test_periodic_checkpoints_keep_the_newest(full: dict[Any, Path]) -> None:
    assert sorted(p.name for p in (full["periodic"] / "resume_checkpoints").iterdir()) == [
        "step_000000015",
        "step_000000020",
    ]


def test_accelerate_launch_hands_loader_resume_variables_to_every_rank(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``LOADER_RESUME_SAVE_EVERY_N_STEPS=5 accelerate launch ...`` on 2 processes: 12 steps,
    checkpoints at 5 and 10 (every rank must take part in each save), the same batches as without
    them; a misspelt variable stops the launch at once, naming it."""
    run(
        tmp_path / "job",
        2,
        env={"LOADER_RESUME_SAVE_EVERY_N_STEPS": "5", "LOADER_RESUME_KEEP": "2"},
    )
    assert sorted(p.name for p in (tmp_path / "job" / "resume_checkpoints").iterdir()) == [
        "step_000000005",
        "step_000000010",
    ]
    plain = accelerate_run(tmp_path_factory, 2)
    assert logs(tmp_path / "job") == logs(plain)
    stderr = run(tmp_path / "typo", 2, expect=1, env={"LOADER_RESUME_SAVE_EVERY_N_STEP": "5"})
    assert (
        "LOADER_RESUME_SAVE_EVERY_N_STEP: unknown (did you mean LOADER_RESUME_SAVE_EVERY_N_STEPS?)"
        in stderr
    )


def test_checkpoint_of_another_dataset_fails_clearly(resumed: dict[str, tuple[Path, Done]]) -> None:
    _, stderr = finished(resumed, "another-dataset", expect=1)
    assert "StateError" in stderr and "dataset_len" in stderr and "30" in stderr and "20" in stderr


@pytest.mark.parametrize(
    "stateful", [False, True], ids=["DataLoaderShard", "use_stateful_dataloader"]
)
def test_a_resumable_loader_given_to_a_stock_accelerator_is_refused_on_every_rank(
    tmp_path: Path, stateful: bool
) -> None:
    """Without enable_resume, Accelerate would rebuild the loader into its own (measured: a
    DataLoaderShard over a plain DataLoader, or over a StatefulDataLoader): prepare() refuses it on
    both ranks, naming the call to make; a loader enable_resume converted is kept as it is by
    Accelerate's own prepare_data_loader."""
    accelerate = Path(sys.executable).with_name("accelerate")
    done = forked.run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            str(ROOT / "tests" / "children" / "accelerate_stock_child.py"),
            str(tmp_path),
            *(["--stateful"] if stateful else []),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(tmp_path.glob("replaced-*.txt"))
    for rank in (0, 1):
        message = (tmp_path / f"refused-{rank}.txt").read_text()
        assert (
            "enable_resume(accelerator) was not called" in message and "DataLoaderShard" in message
        )
        assert (tmp_path / f"kept-{rank}.txt").read_text() == "True"


# --- in-process: configuration and prepare -------------------------------------------------------
@pytest.fixture
def accelerator(tmp_path: Path) -> Any:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    yield accelerator
    for number, handler in handlers.items():  # what an enable_resume left installed
        signal.signal(number, handler)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_bare_enable_resume_is_fully_armed(accelerator: Any, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    resume = enable_resume(accelerator)
    assert resume.config == ResumeConfig()
    assert resume.checkpoint_dir == tmp_path / "resume_checkpoints"
    for number in (signal.SIGTERM, signal.SIGUSR1):
        assert signal.getsignal(number) == resume.preemption._on_signal
    assert {"prepare", "load_state"} <= vars(accelerator).keys()  # wrapped on this instance
    resume.close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert not {"prepare", "load_state"} & vars(accelerator).keys()  # Accelerate's own again


def test_split_batches_is_refused_naming_what_is_expected(tmp_path: Path) -> None:
    """Per-process batch sizes are what the loaders shard; an Accelerator that splits each batch is
    refused."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, project_dir=str(tmp_path),
                                  dataloader_config=DataLoaderConfiguration(split_batches=True))
        with pytest.raises(
            ValueError, match=r"split_batches=True\) is not supported; expected per-process batch"
        ):
            enable_resume(accelerator)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_the_shipped_yaml_holds_the_defaults() -> None:
    assert load_config(ROOT / "configs" / "accelerate_resume.yaml") == ResumeConfig()


def test_a_config_typo_fails_at_enable_resume_naming_the_key(
    accelerator: Any, tmp_path: Path
) -> None:
    path = tmp_path / "resume.yaml"
    path.write_text("save_every_n_step: 50\n")
    with pytest.raises(
        ValueError,
        match="unknown key 'save_every_n_step' \\(did you mean 'save_every_n_steps'\\?\\)",
    ):
        enable_resume(accelerator, path)
    with pytest.raises(
        ValueError, match="keep: Value 'many' of type 'str' could not be converted to Integer"
    ):
        enable_resume(accelerator, {"keep": "many"})
    with pytest.raises(ValueError, match="keying='batches'; expected one of"):
        enable_resume(accelerator, None, ["keying=batches"])


def test_environment_variables_set_fields_between_the_yaml_file_and_the_argument(
    tmp_path: Path,
) -> None:
    """argument > LOADER_RESUME_<FIELD> > the YAML file ($LOADER_RESUME_CONFIG, or a path argument)
    > default."""
    path, other = tmp_path / "resume.yaml", tmp_path / "other.yaml"
    path.write_text("save_every_n_steps: 50\nkeep: 5\nkeying: sample\n")
    other.write_text("exit_code: 99\n")
    environ = {
        "LOADER_RESUME_CONFIG": str(path),
        "LOADER_RESUME_SAVE_EVERY_N_STEPS": "7",
        "LOADER_RESUME_KEEP": "3",
        "LOADER_RESUME_SIGNALS": "[SIGUSR1]",
        "UNRELATED": "x",
    }
    config = load_config({"keep": 4}, environ=environ)
    assert (config.save_every_n_steps, config.keep, config.keying, config.signals, config.seed) == \
        (7, 4, "sample", ["SIGUSR1"], 0)
    assert load_config(None, ["keep=9"], environ=environ).keep == 9
    # a path argument replaces $LOADER_RESUME_CONFIG
    from_path = load_config(other, environ=environ)
    assert (from_path.exit_code, from_path.keying, from_path.save_every_n_steps) == (99, "batch", 7)


def test_the_lease_term_variable_is_ours_and_not_a_field_and_its_typo_is_named() -> None:
    """LOADER_RESUME_LEASE_SECONDS (the term of a lease on S3, read by loader_resume) is accepted
    beside the fields; a misspelt one fails naming it."""
    config = load_config(
        None, environ={"LOADER_RESUME_LEASE_SECONDS": "30", "LOADER_RESUME_KEEP": "3"}
    )
    assert config.keep == 3 and not hasattr(config, "lease_seconds")
    with pytest.raises(
        ValueError, match=r"LOADER_RESUME_LEASE_SECOND: unknown \(did you mean LOADER_RESUME_LEASE_"
    ):
        load_config(None, environ={"LOADER_RESUME_LEASE_SECOND": "30"})


def test_a_misspelt_variable_fails_at_enable_resume_naming_it_and_the_closest(
    accelerator: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOADER_RESUME_SAVE_EVERY_N_STEP", "100")
    with pytest.raises(ValueError, match="LOADER_RESUME_SAVE_EVERY_N_STEP: unknown \\(did you mean "
                                         "LOADER_RESUME_SAVE_EVERY_N_STEPS\\?\\)"):
        enable_resume(accelerator)
    monkeypatch.delenv("LOADER_RESUME_SAVE_EVERY_N_STEP")
    monkeypatch.setenv("LOADER_RESUME_KEEP", "many")
    with pytest.raises(
        ValueError, match="LOADER_RESUME_KEEP='many': Value 'many' of type 'str' could not be"
    ):
        enable_resume(accelerator)


def test_switched_off_from_the_environment_accelerate_is_left_stock(
    accelerator: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("LOADER_RESUME_ENABLED", "0")
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level("WARNING", logger="accelerate_resume.hook"):
        resume = enable_resume(accelerator, {"save_every_n_steps": 1})
    assert "switched off" in caplog.text
    assert signal.getsignal(signal.SIGTERM) == before
    loader = accelerator.prepare(DataLoader(list(range(10)), batch_size=2))
    assert not isinstance(loader, AcceleratedResumableDataLoader)
    assert type(loader).__module__.startswith("accelerate.")  # Accelerate's own DataLoaderShard
    # switched off: stock, no error
    ours = accelerator.prepare(ResumableDataLoader(list(range(10)), batch_size=2))
    assert type(ours).__module__.startswith("accelerate.")
    assert list(resume.epochs(2)) == [0, 1] and resume.save() is None
    assert not (tmp_path / "resume_checkpoints").exists()


def test_switched_off_a_remote_copy_is_not_set_up_and_switched_on_a_bad_one_is_refused(
    accelerator: Any,
) -> None:
    """Switched off (``LOADER_RESUME_ENABLED=0`` over a configuration naming a remote copy) nothing
    of ours is set up; switched on, a remote copy that is not a URL is refused naming it, and
    nothing of ours stays installed."""
    off = enable_resume(accelerator, {"enabled": False, "remote": "/not/a/url"})
    off.close()
    with pytest.raises(ValueError, match="/not/a/url"):
        enable_resume(accelerator, {"remote": "/not/a/url"})
    enable_resume(accelerator).close()  # the refused one left nothing behind


def test_epochs_resumes_at_its_first_epoch_not_when_it_is_called(
    accelerator: Any, tmp_path: Path
) -> None:
    """``resume.epochs(n)`` may be built before ``prepare`` registers the model: the resume happens
    at its first epoch, so the checkpoint is loaded into what was prepared by then."""
    model = torch.nn.Linear(2, 2)
    first = enable_resume(accelerator, {"checkpoint_dir": str(tmp_path / "c")})
    model, _optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        model.weight.fill_(3.0)
    saved = first.save()
    first.close()
    second = enable_resume(accelerator, {"checkpoint_dir": str(tmp_path / "c")})
    with torch.no_grad():
        model.weight.fill_(0.0)
    epochs = second.epochs(1)
    assert second.loaded_from is None
    assert next(epochs) == 0 and second.loaded_from == saved
    assert bool((model.weight == 3.0).all())
    second.close()


def test_closing_a_switched_off_resume_leaves_a_later_one_in_place(accelerator: Any) -> None:
    from loader_resume.thirdparty import accelerator_mode

    off = enable_resume(accelerator, {"enabled": False})
    on = enable_resume(accelerator)
    off.close()
    assert accelerator_mode(accelerator) == "resume"
    on.close()
    assert accelerator_mode(accelerator) is None


def test_with_enable_resume_accelerates_own_prepare_data_loader_refuses_an_unconverted_loader(
    accelerator: Any,
) -> None:
    enable_resume(accelerator, {"auto_resume": False})
    with pytest.raises(
        TypeError, match=r"converts loaders in accelerator.prepare\(\); pass the loader there"
    ):
        accelerator.prepare_data_loader(ResumableDataLoader(list(range(10)), batch_size=2))


def test_an_unresolvable_interpolation_in_a_variable_is_named() -> None:
    with pytest.raises(
        ValueError,
        match="LOADER_RESUME_CHECKPOINT_DIR\\): Interpolation key 'SLURM_JOB_ID' not found",
    ):
        load_config(environ={"LOADER_RESUME_CHECKPOINT_DIR": "/ckpt/${SLURM_JOB_ID}"})


def test_command_line_dotlist_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "resume.yaml"
    path.write_text("save_every_n_steps: 50\nkeying: sample\n")
    config = load_config(path, ["save_every_n_steps=7", "signals=[SIGUSR2]", "keying=off"])
    assert (config.save_every_n_steps, config.signals, config.keying) == (7, ["SIGUSR2"], "off")


def test_prepare_converts_loaders_and_prepares_models_and_optimizers_as_accelerate_does(
    accelerator: Any, tmp_path: Path
) -> None:
    resume = enable_resume(accelerator, {"seed": 3})
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(
        Augmented(10), batch_size=4, shuffle=True, drop_last=True, collate_fn=_collate
    )
    prepared_model, prepared_optimizer, prepared_loader = accelerator.prepare(
        model, optimizer, loader
    )
    assert type(prepared_model) is type(model) and isinstance(
        prepared_optimizer, AcceleratedOptimizer
    )
    assert isinstance(prepared_loader, AcceleratedResumableDataLoader)
    assert (prepared_loader.seed, prepared_loader.drop_last, prepared_loader.collate_fn) == (
        3,
        True,
        _collate,
    )
    # not Accelerate's shard
    assert prepared_loader.dataset is loader.dataset and accelerator._dataloaders == []
    batches = list(prepared_loader)
    assert len(batches) == 2 and all(b["torch"].device == accelerator.device for b in batches)
    # no GPU: another device shows placement
    prepared_loader.attach_accelerate(resume, torch.device("meta"), False)
    assert all(b["torch"].device.type == "meta" for b in prepared_loader)
    # a single object comes back alone, as with Accelerate
    assert accelerator.prepare(loader).world_size == 1
    assert resume.step == 0


def _collate(items: list[Any]) -> Any:
    return torch.utils.data.default_collate(items)


def test_a_mixture_whose_weights_change_resumes_exactly_on_two_processes(tmp_path: Path) -> None:
    """Weights set after optimizer steps 3 and 9 by the loop itself, on both ranks; SIGTERM on rank
    0 after its 6th batch: the checkpoint holds the first change, the rerun makes the second at the
    same step."""
    run(tmp_path / "full", 2, "--mixture", "--workers", "2")
    run(tmp_path / "cut", 2, "--mixture", "--workers", "2", "--signal-at", "6", expect=143)
    cut = [trained(rows) for rows in logs(tmp_path / "cut")]
    run(tmp_path / "cut", 2, "--mixture", "--workers", "2")
    uninterrupted = logs(tmp_path / "full")
    assert 0 < len(cut[0]) < len(trained(uninterrupted[0]))
    assert logs(tmp_path / "cut") == uninterrupted and weights(tmp_path / "cut") == weights(
        tmp_path / "full"
    )
