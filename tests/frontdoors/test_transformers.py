"""The transformers ``Trainer`` under ``ResumableTrainer``, with real processes: one process,
``torchrun --nproc_per_node 2`` and ``accelerate launch --multi_gpu --num_processes 2`` (gloo, CPU),
a crash right after a checkpoint, then ``train(resume_from_checkpoint=True)``.

Each test compares with an uninterrupted run: the batch log (sample ids and a fingerprint of each
micro-batch's values, augmentations drawn from torch, numpy and random in the dataset) and the final
weights must be identical, and the resumed run reads no batch it does not train on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from loader_resume.job.checkpoint import MANIFEST
from support import forked
from support.audit import audited
from support.batch import Done, run_batch
from support.launch import logs, weights
from support.s3 import bucket, objects, s3_server
from support.trainer_launch import CHILD, ENV, ITEMS, command, run


def reads(out: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(out.glob("reads-*.txt"))]


ONE_PROCESS = {
    "1": [],
    "1-acc3": ["--accumulate", "3"],
    "1-stream": ["--stream"],
    "stock": ["--stock"],
}
"""The uninterrupted one-process runs: accumulation 1 and 3, a stream, a stock Trainer."""
# accumulation, workers, crash after the save of
ONE_PROCESS_CASES = [(1, 0, 10), (3, 2, 4), (1, 0, 8), (3, 2, 6)]
CRASHES = {**{f"{a}-{w}-{c}": ["--accumulate", str(a), "--workers", str(w), "--crash-at", str(c)]
              for a, w, c in ONE_PROCESS_CASES},
           "stream": ["--stream", "--crash-at", "10"], "stock": ["--stock", "--crash-at", "10"]}
"""One process crashed right after a checkpoint (``os._exit``: each a process of its own)."""


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted one-process runs (one batch process, tests/support/batch.py), and two
    processes (accumulation 3, torchrun)."""
    root = tmp_path_factory.mktemp("full")
    done = run_batch(
        CHILD,
        [[str(root / name), "--processes", "1", *args] for name, args in ONE_PROCESS.items()],
        root / "batch",
    )
    for name, each in zip(ONE_PROCESS, done, strict=True):
        assert each.returncode == 0, f"{name}: {each.stderr[-3000:]}"
    runs = {name: root / name for name in ONE_PROCESS}
    runs["2-acc3"] = root / "2-acc3"
    run(runs["2-acc3"], 2, "--accumulate", "3")
    return runs


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runs = {}
    for name, args in CRASHES.items():
        runs[name] = tmp_path_factory.mktemp(f"crashed-{name}")
        run(runs[name], 1, *args)
    return runs


@pytest.fixture(scope="module")
def crashed(crashes: dict[str, Path]) -> Path:
    """One process crashed right after the checkpoint of step 10 (checkpoints 9 and 10 kept)."""
    return crashes["1-0-10"]


@pytest.fixture(scope="module")
def crashed_on_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two processes, accumulation 3, crashed right after the checkpoint of step 3, by each
    launcher; rank 1 writes its last file of each checkpoint late (a slow disk)."""
    runs = {}
    for launcher in ("torchrun", "accelerate"):
        out = tmp_path_factory.mktemp(f"crashed2-{launcher}")
        run(out, 2, "--accumulate", "3", "--crash-at", "3", "--slow-rank", "1", launcher=launcher)
        runs[launcher] = out
    return runs


MISSING = ["loader_resume_0.pt", "trainer_state.json", "rng_state.pth"]


@pytest.fixture(scope="module")
def resumed(crashes: dict[str, Path], crashed_on_two: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Done]]:
    """Every one-process resume and refusal of the tests below, in one fresh process
    (tests/support/batch.py), each in a copy of the crashed run it continues, changed as its test
    says."""
    root = tmp_path_factory.mktemp("resumed")

    def copy(name: str, crash: Path) -> str:
        shutil.copytree(crash, root / name)
        return str(root / name)

    runs = [
        [
            copy(f"{a}-{w}-{c}", crashes[f"{a}-{w}-{c}"]),
            "--accumulate",
            str(a),
            "--workers",
            str(w),
            "--resume",
            "true",
        ]
        for a, w, c in ONE_PROCESS_CASES
    ]
    runs.append([copy("stream", crashes["stream"]), "--stream", "--resume", "true"])
    runs.append([copy("stock", crashes["stock"]), "--stock", "--resume", "true"])
    # killed between our file and trainer_state.json
    incomplete = Path(copy("incomplete", crashes["1-0-10"]))
    (incomplete / "run" / "checkpoint-10" / "trainer_state.json").unlink()
    log = incomplete / "log-0.jsonl"
    # step 10 is done again
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:9]))
    runs.append([str(incomplete), "--resume", "true"])
    for file in MISSING:
        checkpoint = Path(copy(f"missing-{file}", crashes["1-0-10"])) / "run" / "checkpoint-10"
        (checkpoint / file).unlink()
        runs.append([str(checkpoint.parent.parent), "--resume", str(checkpoint)])
    runs.append(
        [copy("ignore-data-skip", crashes["1-0-10"]), "--ignore-data-skip", "--resume", "true"]
    )
    runs.append([str(root / "jit"), "--jit"])
    runs.append(
        [copy("two-on-one", crashed_on_two["torchrun"]), "--accumulate", "3", "--resume", "true"]
    )
    done = run_batch(
        CHILD, [[out, "--processes", "1", *args] for out, *args in runs], root / "batch"
    )
    return {Path(out).name: (Path(out), each) for (out, *_), each in zip(runs, done, strict=True)}


def finished(resumed: dict[str, tuple[Path, Done]], name: str) -> tuple[Path, str]:
    out, done = resumed[name]
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stderr[-6000:]}"
    return out, done.stderr


def refused(resumed: dict[str, tuple[Path, Done]], name: str) -> tuple[Path, str]:
    """A run that must end with exit 1 (an exception): its directory and stderr."""
    out, done = resumed[name]
    assert done.returncode == 1, f"{name}: exit {done.returncode}\n{done.stderr[-6000:]}"
    return out, done.stderr


@pytest.mark.parametrize(("accumulate", "workers", "crash"), ONE_PROCESS_CASES)
def test_one_process_resumes_with_the_uninterrupted_runs_batches(
    full: dict[str, Path],
    crashes: dict[str, Path],
    resumed: dict[str, tuple[Path, Done]],
    accumulate: int,
    workers: int,
    crash: int,
) -> None:
    """8 batches an epoch; with accumulation 3 an epoch is 3 optimizer steps (3 + 3 + 2
    micro-batches) and step 4 is in the second epoch. Steps 8 and 6 end an epoch (Trainer resumes
    them with the next epoch's first batch). Batches do not depend on num_workers: both compare with
    one run."""
    name = f"{accumulate}-{workers}-{crash}"
    cut = len(logs(crashes[name])[0])
    out, _ = finished(resumed, name)
    reference = full["1" if accumulate == 1 else "1-acc3"]
    assert logs(out) == logs(reference) and weights(out) == weights(reference)
    read_after = sum(len(row["ids"]) for row in logs(out)[0][cut:])
    assert reads(out) == [read_after]  # no batch read to be skipped


def test_a_stream_resumes_with_the_uninterrupted_runs_batches_reading_none_to_skip(
    full: dict[str, Path], crashes: dict[str, Path], resumed: dict[str, tuple[Path, Done]]
) -> None:
    """An iterable dataset (max_steps=20; 8 batches a pass): crashed after step 10, mid second pass.
    Trainer's own skipping would read the 10 batches again (an iterable dataset cannot skip without
    reading); here the resumed run reads what it trains, plus the one batch Trainer's loop reads
    past its last step (as the uninterrupted run does)."""
    cut = len(logs(crashes["stream"])[0])
    out, _ = finished(resumed, "stream")
    assert logs(out) == logs(full["1-stream"]) and weights(out) == weights(full["1-stream"])
    past_the_end = reads(full["1-stream"])[0] - sum(
        len(row["ids"]) for row in logs(full["1-stream"])[0]
    )
    assert past_the_end == 4  # one batch
    assert reads(out) == [sum(len(row["ids"]) for row in logs(out)[0][cut:]) + past_the_end]


def test_every_ranks_files_are_written_before_trainers_state_marks_a_checkpoint_complete(
        crashed_on_two: dict[str, Path]) -> None:
    """trainer_state.json (rank 0's last write, after which Trainer deletes older checkpoints) comes
    after every rank's loader state and Trainer's RNG state, rank 1's written 0.5 s late
    included."""
    for checkpoint in sorted((crashed_on_two["torchrun"] / "run").glob("checkpoint-*")):
        per_rank = [checkpoint / f"{name}_{rank}.{ext}" for rank in range(2)
                    for name, ext in (("loader_resume", "pt"), ("rng_state", "pth"))]
        complete = (checkpoint / "trainer_state.json").stat().st_mtime_ns
        assert max(path.stat().st_mtime_ns for path in per_rank) <= complete, checkpoint


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_processes_resume_with_the_uninterrupted_runs_batches(
    full: dict[str, Path], crashed_on_two: dict[str, Path], tmp_path: Path, launcher: str
) -> None:
    """4 batches a rank and epoch, accumulation 3 (3 + 1 micro-batches a step); step 3 is in the
    second epoch."""
    shutil.copytree(crashed_on_two[launcher], tmp_path, dirs_exist_ok=True)
    run(tmp_path, 2, "--accumulate", "3", "--resume", "true", launcher=launcher)
    assert logs(tmp_path) == logs(full["2-acc3"]) and weights(tmp_path) == weights(full["2-acc3"])
    last = tmp_path / "run" / "checkpoint-6"  # 3 epochs of 2 steps
    assert sorted(last.glob("loader_resume_*.pt")) == [
        last / f"loader_resume_{r}.pt" for r in range(2)
    ]


def test_sigusr1_on_one_rank_checkpoints_at_the_step_both_agree_and_the_same_command_continues(
        full: dict[str, Path], tmp_path: Path) -> None:
    """Rank 0 alone gets SIGUSR1 (as a scheduler signals one task) at the end of step 3, no
    checkpoint being due (save_steps=100); both ranks agree there, Trainer writes checkpoint-3 with
    both ranks' loader states, both exit 143; the same command again (resume_from_checkpoint=True)
    continues exactly."""
    same = [
        "--accumulate",
        "3",
        "--save-steps",
        "100",
        "--signal-name",
        "SIGUSR1",
        "--signal-at",
        "3",
        "--resume",
        "true",
    ]
    stderr = run(tmp_path, 2, *same, expect=143)
    # NOTE: both ranks say so; torchrun reports the first to exit (it then stops the other)
    assert (
        stderr.count(
            f"checkpoint written at step 3 ({tmp_path / 'run' / 'checkpoint-3'}); exiting with 143"
        )
        == 2
    )
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-3"]
    # the first run of the command started from the beginning
    assert "no complete checkpoint in" in stderr
    run(tmp_path, 2, *same)
    assert logs(tmp_path) == logs(full["2-acc3"]) and weights(tmp_path) == weights(full["2-acc3"])


def test_sigterm_on_one_process_checkpoints_at_the_next_step_and_the_same_command_continues(
        full: dict[str, Path], tmp_path: Path) -> None:
    """One process (where the support matrix's oldest transformers, 4.57 to 5.17, can resume on the
    CPU: with several CPU processes those load the optimizer onto ``cpu:0``): SIGTERM at the end of
    step 4, in the second epoch, no checkpoint being due; checkpoint-4 is written, exit 143; the
    same command again continues exactly, and the job's own audit (``LOADER_RESUME_AUDIT``)
    agrees."""
    env = {"LOADER_RESUME_AUDIT": str(tmp_path / "audit")}
    same = ["--save-steps", "100", "--signal-at", "4", "--resume", "true"]
    said = run(tmp_path, 1, *same, expect=143, env=env)
    assert "checkpoint written at step 4" in said and "was built without audit=" not in said
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-4"]
    run(tmp_path, 1, *same, env=env)
    assert logs(tmp_path) == logs(full["1"]) and weights(tmp_path) == weights(full["1"])
    audited(tmp_path / "audit", [1, 1])


def test_sigterm_with_a_remote_copy_uploads_and_a_rerun_on_a_new_disk_continues_exactly(
    full: dict[str, Path], tmp_path: Path
) -> None:
    """``ResumableTrainer(remote="s3://...")`` against a real S3 API server on loopback: SIGTERM at
    the end of step 4 writes checkpoint-4 locally, then uploads it, its manifest last (and no lease
    is left behind); with the local output directory gone (a new machine), the same command
    downloads it and continues exactly. A bucket that does not exist stops ``train`` before its
    first step, naming the URL."""
    same = [
        "--save-steps",
        "100",
        "--signal-at",
        "4",
        "--resume",
        "true",
        "--remote",
        "s3://copy-t/job",
    ]
    with s3_server() as env:
        bucket("copy-t")
        assert "checkpoint written at step 4" in run(tmp_path, 1, *same, expect=143, env=env)
        stored = objects("s3://copy-t/job")
        assert f"s3://copy-t/job/checkpoint-4/{MANIFEST}" in stored, stored
        assert "s3://copy-t/job/checkpoint-4/trainer_state.json" in stored
        assert not [url for url in stored if "lease" in url], stored
        shutil.rmtree(tmp_path / "run")
        run(tmp_path, 1, *same, env=env)
        refused = run(
            tmp_path / "other", 1, "--remote", "s3://no-such-bucket-t/job", expect=1, env=env
        )
    # no step
    assert (
        "s3://no-such-bucket-t/job" in refused
        and (tmp_path / "other" / "log-0.jsonl").read_text() == ""
    )
    assert logs(tmp_path) == logs(full["1"]) and weights(tmp_path) == weights(full["1"])


def test_sigterm_to_the_whole_launch_mid_epoch_checkpoints_and_the_same_command_continues(
        full: dict[str, Path], tmp_path: Path) -> None:
    """SIGTERM to ``accelerate launch``'s process group in the second epoch: its agent passes it on
    to each rank's own process group (the rank and its DataLoader workers, which ignore it); the
    ranks agree at the next step, write one checkpoint and exit 143 within the agent's grace period;
    the same command again continues exactly."""
    same = [
        "--accumulate",
        "3",
        "--workers",
        "2",
        "--save-steps",
        "100",
        "--sleep",
        "0.1",
        "--resume",
        "true",
    ]
    first = forked.popen(
        command(tmp_path, 2, *same, launcher="accelerate"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=ENV,
    )
    deadline = time.monotonic() + 120
    while len(logs(tmp_path)[0] if (tmp_path / "log-0.jsonl").exists() else []) < 5:  # in epoch 1
        assert time.monotonic() < deadline and first.poll() is None, (
            "training never reached micro-batch 5"
        )
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert stderr.count("; exiting with 143") == 2, stderr[-6000:]
    checkpoints = [p.name for p in (tmp_path / "run").iterdir()]
    assert len(checkpoints) == 1 and 2 <= int(checkpoints[0].split("-")[1]) < 6, checkpoints
    run(tmp_path, 2, *same, launcher="accelerate")
    assert logs(tmp_path) == logs(full["2-acc3"]) and weights(tmp_path) == weights(full["2-acc3"])


def test_transformers_own_jit_checkpoint_is_refused_naming_ours(
    resumed: dict[str, tuple[Path, Done]],
) -> None:
    _, stderr = refused(resumed, "jit")
    assert "enable_jit_checkpoint=True) with ResumableTrainer: expected it off" in stderr


def test_a_checkpoint_without_trainers_state_is_skipped_for_the_one_before(
        full: dict[str, Path], resumed: dict[str, tuple[Path, Done]]) -> None:
    """Killed between our file and Trainer's trainer_state.json: checkpoint-10 is incomplete.
    Resuming with True warns naming the file and resumes from checkpoint-9, exactly."""
    out, stderr = finished(resumed, "incomplete")
    assert "checkpoint-10: trainer_state.json is missing" in stderr
    assert logs(out) == logs(full["1"]) and weights(out) == weights(full["1"])


@pytest.mark.parametrize("file", MISSING)
def test_an_explicit_checkpoint_missing_a_file_is_refused_naming_it(
    resumed: dict[str, tuple[Path, Done]], file: str
) -> None:
    out, stderr = refused(resumed, f"missing-{file}")
    assert (
        f"{out / 'run' / 'checkpoint-10' / file}: missing; expected a complete checkpoint" in stderr
    )


def test_a_two_rank_checkpoint_lacking_a_file_of_rank_1_is_incomplete(
    crashed_on_two: dict[str, Path], tmp_path: Path
) -> None:
    """Killed after rank 0's files, before rank 1's: the checkpoint names rank 1's missing file."""
    from transformers_resume.checkpoint_files import missing_file

    for file in ("loader_resume_1.pt", "rng_state_1.pth"):
        checkpoint = tmp_path / file
        shutil.copytree(crashed_on_two["torchrun"] / "run" / "checkpoint-3", checkpoint)
        assert missing_file(checkpoint) is None
        (checkpoint / file).unlink()
        assert missing_file(checkpoint) == checkpoint / file


def test_ignore_data_skip_is_refused_on_a_resume(resumed: dict[str, tuple[Path, Done]]) -> None:
    _, stderr = refused(resumed, "ignore-data-skip")
    assert (
        "TrainingArguments(ignore_data_skip=True) with ResumableTrainer: expected it off" in stderr
    )


def learning_rates(out: Path) -> dict[int, float]:
    return {
        row["step"]: row["lr"]
        for row in map(json.loads, (out / "lr-0.jsonl").read_text().splitlines())
    }


def test_two_processes_resume_on_one_with_the_rest_of_the_epoch_exactly_once(
    full: dict[str, Path], crashed_on_two: dict[str, Path], resumed: dict[str, tuple[Path, Done]]
) -> None:
    """Crashed after step 3 on 2 processes (accumulation 3): epoch 1 has delivered 3 batches a rank,
    samples 0-23 of its order. On one process that is step 5 (8 batches an epoch: steps of 3 + 3 +
    2; 6 batches in): the resumed run trains the 6 samples left of epoch 1, then epoch 2, exactly as
    the uninterrupted one-process run does from its step 5 (same batches and values, same learning
    rates, same last step)."""
    before = [logs(crashed_on_two["torchrun"])[rank] for rank in range(2)]
    tmp_path, stderr = finished(resumed, "two-on-one")
    assert "written by 2 process(es), resumed on 1: step 3 is step 5 here" in stderr
    after = logs(tmp_path)[0][len(before[0]):]
    one = logs(full["1-acc3"])[0]
    assert len(after) == 2 + 8 and after == one[-len(after):]
    # 4 batches a rank in epoch 0
    epoch_one = [i for rank in range(2) for row in before[rank][4:] for i in row["ids"]]
    epoch_one += [i for row in after[:2] for i in row["ids"]]
    assert sorted(epoch_one) == list(range(ITEMS))
    resumed, uninterrupted = learning_rates(tmp_path), learning_rates(full["1-acc3"])
    assert {step: resumed[step] for step in range(6, 10)} == {
        step: uninterrupted[step] for step in range(6, 10)
    }
    assert max(resumed) == max(uninterrupted) == 9
    assert sorted(p.name for p in (tmp_path / "run").iterdir())[-1] == "checkpoint-9"


def test_a_position_between_steps_at_the_new_world_size_is_refused() -> None:
    """One process crashed after step 9 (GA 1, batch 4): epoch 1 at sample 4, half a step of two
    processes."""
    from loader_resume.job.checkpoint import CheckpointError
    from transformers_resume.checkpoint_files import step_at

    state = {"epoch": 1, "position": 4}
    assert (
        step_at(
            state,
            world_size=1,
            batch_size=4,
            accumulation=1,
            steps_per_epoch=8,
            checkpoint=Path("c"),
        )
        == 9
    )
    with pytest.raises(
        CheckpointError,
        match=r"c: sample 4 of epoch 1 is not an optimizer-step boundary on 2 "
        r"process\(es\) \(steps of 2 \* batch 4 \* accumulation 1 = 8 ",
    ):
        step_at(
            state,
            world_size=2,
            batch_size=4,
            accumulation=1,
            steps_per_epoch=4,
            checkpoint=Path("c"),
        )


def test_stock_trainer_continues_differently(full: dict[str, Path], crashes: dict[str, Path],
                                             resumed: dict[str, tuple[Path, Done]]) -> None:
    """What ResumableTrainer fixes, measured on the same job with a stock Trainer: its batches after
    the resume are not its uninterrupted run's (its sampler skips the index lists without reading
    them, on a map-style dataset, but the order and the augmentation values drawn after the resume
    differ)."""
    cut = len(logs(crashes["stock"])[0])
    out, _ = finished(resumed, "stock")
    uninterrupted, resumed_log = logs(full["stock"])[0], logs(out)[0]
    assert resumed_log[:cut] == uninterrupted[:cut] and len(resumed_log) == len(uninterrupted)
    assert resumed_log[cut:] != uninterrupted[cut:]


def test_the_checkpoint_file_holds_this_ranks_state(crashed: Path) -> None:
    import torch

    saved = torch.load(crashed / "run" / "checkpoint-10" / "loader_resume_0.pt", weights_only=True)
    assert (saved["world_size"], saved["rank"], saved["global_step"]) == (1, 0, 10)
    assert (
        json.loads((crashed / "run" / "checkpoint-10" / "trainer_state.json").read_text())[
            "global_step"
        ]
        == 10
    )


def _choose(rank: int, store: str, found: str | None, out: str) -> None:
    import torch.distributed as dist

    from transformers_resume.checkpoint_files import agreed_checkpoint

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        Path(out, f"chose-{rank}").write_text(str(agreed_checkpoint(found)))
    except Exception as error:  # the test reads the message
        Path(out, f"chose-{rank}").write_text(f"{type(error).__name__}: {error}")
    finally:
        dist.destroy_process_group()


def test_ranks_that_find_different_checkpoints_are_refused_not_resumed_apart(
    tmp_path: Path,
) -> None:
    """resume_from_checkpoint=True: every rank looks in output_dir itself; ranks that do not see the
    same newest complete checkpoint (no shared directory, a lagging network file system) would
    resume different steps, or one from the beginning. Refused on every rank, naming what each
    found; the same one goes through."""
    import multiprocessing

    # imported once, before the ranks are forked
    import transformers_resume.checkpoint_files  # noqa: F401

    context = multiprocessing.get_context("fork")
    for case, found in (("differ", ["out/checkpoint-9", None]), ("same", ["out/checkpoint-9"] * 2)):
        (tmp_path / case).mkdir()
        ranks = [
            context.Process(
                target=_choose,
                args=(rank, str(tmp_path / case / "store"), found[rank], str(tmp_path / case)),
            )
            for rank in range(2)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=120)
        chose = [(tmp_path / case / f"chose-{rank}").read_text() for rank in range(2)]
        if case == "same":
            assert chose == ["out/checkpoint-9"] * 2
        else:
            expected = "rank 0: checkpoint-9, rank 1: none"
            assert all(text.startswith("CheckpointError") and expected in text for text in chose), (
                chose
            )
