"""The transformers ``Trainer`` under ``ResumableTrainer``, with real processes: one process, ``torchrun
--nproc_per_node 2`` and ``accelerate launch --multi_gpu --num_processes 2`` (gloo, CPU), a crash right
after a checkpoint, then ``train(resume_from_checkpoint=True)``.

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

from support.launch import logs, weights
from support.trainer_launch import ENV, ITEMS, command, run


def reads(out: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(out.glob("reads-*.txt"))]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs: one process (accumulation 1 and 3; a stream), two processes (accumulation 3)."""
    runs = {}
    for name, processes, args in (("1", 1, ()), ("1-acc3", 1, ("--accumulate", "3")), ("1-stream", 1, ("--stream",)),
                                  ("2-acc3", 2, ("--accumulate", "3"))):
        out = tmp_path_factory.mktemp(f"full{name}")
        run(out, processes, *args)
        runs[name] = out
    return runs


@pytest.mark.parametrize(("accumulate", "workers", "crash"), [(1, 0, 10), (3, 2, 4), (1, 0, 8), (3, 2, 6)])
def test_one_process_resumes_with_the_uninterrupted_runs_batches(full: dict[str, Path], tmp_path: Path,
                                                                 accumulate: int, workers: int, crash: int) -> None:
    """8 batches an epoch; with accumulation 3 an epoch is 3 optimizer steps (3 + 3 + 2 micro-batches) and
    step 4 is in the second epoch. Steps 8 and 6 end an epoch (Trainer resumes them with the next epoch's
    first batch). Batches do not depend on num_workers: both compare with one run."""
    options = ["--accumulate", str(accumulate), "--workers", str(workers)]
    run(tmp_path, 1, *options, "--crash-at", str(crash))
    cut = len(logs(tmp_path)[0])
    run(tmp_path, 1, *options, "--resume", "true")
    reference = full["1" if accumulate == 1 else "1-acc3"]
    assert logs(tmp_path) == logs(reference) and weights(tmp_path) == weights(reference)
    read_after = sum(len(row["ids"]) for row in logs(tmp_path)[0][cut:])
    assert reads(tmp_path) == [read_after]  # no batch read to be skipped


def test_a_stream_resumes_with_the_uninterrupted_runs_batches_reading_none_to_skip(full: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    """An iterable dataset (max_steps=20; 8 batches a pass): crashed after step 10, mid second pass. Trainer's
    own skipping would read the 10 batches again (an iterable dataset cannot skip without reading); here the
    resumed run reads what it trains, plus the one batch Trainer's loop reads past its last step (as the
    uninterrupted run does)."""
    run(tmp_path, 1, "--stream", "--crash-at", "10")
    cut = len(logs(tmp_path)[0])
    run(tmp_path, 1, "--stream", "--resume", "true")
    assert logs(tmp_path) == logs(full["1-stream"]) and weights(tmp_path) == weights(full["1-stream"])
    past_the_end = reads(full["1-stream"])[0] - sum(len(row["ids"]) for row in logs(full["1-stream"])[0])
    assert past_the_end == 4  # one batch
    assert reads(tmp_path) == [sum(len(row["ids"]) for row in logs(tmp_path)[0][cut:]) + past_the_end]


@pytest.fixture(scope="module")
def crashed_on_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two processes, accumulation 3, crashed right after the checkpoint of step 3, by each launcher; rank 1
    writes its last file of each checkpoint late (a slow disk)."""
    runs = {}
    for launcher in ("torchrun", "accelerate"):
        out = tmp_path_factory.mktemp(f"crashed2-{launcher}")
        run(out, 2, "--accumulate", "3", "--crash-at", "3", "--slow-rank", "1", launcher=launcher)
        runs[launcher] = out
    return runs


def test_every_ranks_files_are_written_before_trainers_state_marks_a_checkpoint_complete(
        crashed_on_two: dict[str, Path]) -> None:
    """trainer_state.json (rank 0's last write, after which Trainer deletes older checkpoints) comes after every
    rank's loader state and Trainer's RNG state, rank 1's written 0.5 s late included."""
    for checkpoint in sorted((crashed_on_two["torchrun"] / "run").glob("checkpoint-*")):
        per_rank = [checkpoint / f"{name}_{rank}.{ext}" for rank in range(2)
                    for name, ext in (("loader_resume", "pt"), ("rng_state", "pth"))]
        complete = (checkpoint / "trainer_state.json").stat().st_mtime_ns
        assert max(path.stat().st_mtime_ns for path in per_rank) <= complete, checkpoint


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_processes_resume_with_the_uninterrupted_runs_batches(full: dict[str, Path],
                                                                  crashed_on_two: dict[str, Path], tmp_path: Path,
                                                                  launcher: str) -> None:
    """4 batches a rank and epoch, accumulation 3 (3 + 1 micro-batches a step); step 3 is in the second epoch."""
    shutil.copytree(crashed_on_two[launcher], tmp_path, dirs_exist_ok=True)
    run(tmp_path, 2, "--accumulate", "3", "--resume", "true", launcher=launcher)
    assert logs(tmp_path) == logs(full["2-acc3"]) and weights(tmp_path) == weights(full["2-acc3"])
    last = tmp_path / "run" / "checkpoint-6"  # 3 epochs of 2 steps
    assert sorted(last.glob("loader_resume_*.pt")) == [last / f"loader_resume_{r}.pt" for r in range(2)]


def test_sigusr1_on_one_rank_checkpoints_at_the_step_both_agree_and_the_same_command_continues(
        full: dict[str, Path], tmp_path: Path) -> None:
    """Rank 0 alone gets SIGUSR1 (as a scheduler signals one task) at the end of step 3, no checkpoint being due
    (save_steps=100); both ranks agree there, Trainer writes checkpoint-3 with both ranks' loader states, both
    exit 143; the same command again (resume_from_checkpoint=True) continues exactly."""
    same = ["--accumulate", "3", "--save-steps", "100", "--signal-name", "SIGUSR1", "--signal-at", "3",
            "--resume", "true"]
    stderr = run(tmp_path, 2, *same, expect=143)
    # NOTE: both ranks say so; torchrun reports the first to exit (it then stops the other)
    assert stderr.count(f"checkpoint written at step 3 ({tmp_path / 'run' / 'checkpoint-3'}); exiting with 143") == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-3"]
    assert "no complete checkpoint in" in stderr  # the first run of the command started from the beginning
    run(tmp_path, 2, *same)
    assert logs(tmp_path) == logs(full["2-acc3"]) and weights(tmp_path) == weights(full["2-acc3"])


def test_sigterm_on_one_process_checkpoints_at_the_next_step_and_the_same_command_continues(
        full: dict[str, Path], tmp_path: Path) -> None:
    """One process (where the support matrix's oldest transformers, 4.57 to 5.17, can resume on the CPU: with
    several CPU processes those load the optimizer onto ``cpu:0``): SIGTERM at the end of step 4, in the second epoch,
    no checkpoint being due; checkpoint-4 is written, exit 143; the same command again continues exactly."""
    same = ["--save-steps", "100", "--signal-at", "4", "--resume", "true"]
    assert "checkpoint written at step 4" in run(tmp_path, 1, *same, expect=143)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-4"]
    run(tmp_path, 1, *same)
    assert logs(tmp_path) == logs(full["1"]) and weights(tmp_path) == weights(full["1"])


def test_sigterm_to_the_whole_launch_mid_epoch_checkpoints_and_the_same_command_continues(
        full: dict[str, Path], tmp_path: Path) -> None:
    """SIGTERM to ``accelerate launch``'s process group in the second epoch: its agent passes it on to each rank's
    own process group (the rank and its DataLoader workers, which ignore it); the ranks agree at the next step,
    write one checkpoint and exit 143 within the agent's grace period; the same command again continues
    exactly."""
    same = ["--accumulate", "3", "--workers", "2", "--save-steps", "100", "--sleep", "0.1", "--resume", "true"]
    first = subprocess.Popen(command(tmp_path, 2, *same, launcher="accelerate"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, env=ENV)
    deadline = time.monotonic() + 120
    while len(logs(tmp_path)[0] if (tmp_path / "log-0.jsonl").exists() else []) < 5:  # in epoch 1
        assert time.monotonic() < deadline and first.poll() is None, "training never reached micro-batch 5"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert stderr.count("; exiting with 143") == 2, stderr[-6000:]
    checkpoints = [p.name for p in (tmp_path / "run").iterdir()]
    assert len(checkpoints) == 1 and 2 <= int(checkpoints[0].split("-")[1]) < 6, checkpoints
    run(tmp_path, 2, *same, launcher="accelerate")
    assert logs(tmp_path) == logs(full["2-acc3"]) and weights(tmp_path) == weights(full["2-acc3"])


def test_transformers_own_jit_checkpoint_is_refused_naming_ours(tmp_path: Path) -> None:
    stderr = run(tmp_path, 1, "--jit", expect=1)
    assert "enable_jit_checkpoint=True) with ResumableTrainer: expected it off" in stderr


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process crashed right after the checkpoint of step 10 (checkpoints 9 and 10 kept)."""
    out = tmp_path_factory.mktemp("crashed")
    run(out, 1, "--crash-at", "10")
    return out


def test_a_checkpoint_without_trainers_state_is_skipped_for_the_one_before(full: dict[str, Path], crashed: Path,
                                                                          tmp_path: Path) -> None:
    """Killed between our file and Trainer's trainer_state.json: checkpoint-10 is incomplete. Resuming with
    True warns naming the file and resumes from checkpoint-9, exactly."""
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    (tmp_path / "run" / "checkpoint-10" / "trainer_state.json").unlink()
    log = tmp_path / "log-0.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:9]))  # step 10 is done again
    stderr = run(tmp_path, 1, "--resume", "true")
    assert "checkpoint-10: trainer_state.json is missing" in stderr
    assert logs(tmp_path) == logs(full["1"]) and weights(tmp_path) == weights(full["1"])


@pytest.mark.parametrize("file", ["loader_resume_0.pt", "trainer_state.json", "rng_state.pth"])
def test_an_explicit_checkpoint_missing_a_file_is_refused_naming_it(crashed: Path, tmp_path: Path, file: str) -> None:
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    checkpoint = tmp_path / "run" / "checkpoint-10"
    (checkpoint / file).unlink()
    stderr = run(tmp_path, 1, "--resume", str(checkpoint), expect=1)
    assert f"{checkpoint / file}: missing; expected a complete checkpoint" in stderr


def test_a_two_rank_checkpoint_lacking_a_file_of_rank_1_is_incomplete(crashed_on_two: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """Killed after rank 0's files, before rank 1's: the checkpoint names rank 1's missing file."""
    from transformers_resume.checkpoint_files import missing_file

    for file in ("loader_resume_1.pt", "rng_state_1.pth"):
        checkpoint = tmp_path / file
        shutil.copytree(crashed_on_two["torchrun"] / "run" / "checkpoint-3", checkpoint)
        assert missing_file(checkpoint) is None
        (checkpoint / file).unlink()
        assert missing_file(checkpoint) == checkpoint / file


def test_ignore_data_skip_is_refused_on_a_resume(crashed: Path, tmp_path: Path) -> None:
    shutil.copytree(crashed, tmp_path, dirs_exist_ok=True)
    stderr = run(tmp_path, 1, "--ignore-data-skip", "--resume", "true", expect=1)
    assert "TrainingArguments(ignore_data_skip=True) with ResumableTrainer: expected it off" in stderr


def learning_rates(out: Path) -> dict[int, float]:
    return {row["step"]: row["lr"] for row in map(json.loads, (out / "lr-0.jsonl").read_text().splitlines())}


def test_two_processes_resume_on_one_with_the_rest_of_the_epoch_exactly_once(
        full: dict[str, Path], crashed_on_two: dict[str, Path], tmp_path: Path) -> None:
    """Crashed after step 3 on 2 processes (accumulation 3): epoch 1 has delivered 3 batches a rank, samples
    0-23 of its order. On one process that is step 5 (8 batches an epoch: steps of 3 + 3 + 2; 6 batches in):
    the resumed run trains the 6 samples left of epoch 1, then epoch 2, exactly as the uninterrupted
    one-process run does from its step 5 (same batches and values, same learning rates, same last step)."""
    shutil.copytree(crashed_on_two["torchrun"], tmp_path, dirs_exist_ok=True)
    before = [logs(tmp_path)[rank] for rank in range(2)]
    stderr = run(tmp_path, 1, "--accumulate", "3", "--resume", "true")
    assert "written by 2 process(es), resumed on 1: step 3 is step 5 here" in stderr
    after = logs(tmp_path)[0][len(before[0]):]
    one = logs(full["1-acc3"])[0]
    assert len(after) == 2 + 8 and after == one[-len(after):]
    epoch_one = [i for rank in range(2) for row in before[rank][4:] for i in row["ids"]]  # 4 batches a rank in epoch 0
    epoch_one += [i for row in after[:2] for i in row["ids"]]
    assert sorted(epoch_one) == list(range(ITEMS))
    resumed, uninterrupted = learning_rates(tmp_path), learning_rates(full["1-acc3"])
    assert {step: resumed[step] for step in range(6, 10)} == {step: uninterrupted[step] for step in range(6, 10)}
    assert max(resumed) == max(uninterrupted) == 9
    assert sorted(p.name for p in (tmp_path / "run").iterdir())[-1] == "checkpoint-9"


def test_a_position_between_steps_at_the_new_world_size_is_refused() -> None:
    """One process crashed after step 9 (GA 1, batch 4): epoch 1 at sample 4, half a step of two processes."""
    from loader_resume.checkpoint import CheckpointError
    from transformers_resume.checkpoint_files import step_at

    state = {"epoch": 1, "position": 4}
    assert step_at(state, world_size=1, batch_size=4, accumulation=1, steps_per_epoch=8, checkpoint=Path("c")) == 9
    with pytest.raises(CheckpointError, match=r"c: sample 4 of epoch 1 is not an optimizer-step boundary on 2 "
                                              r"process\(es\) \(steps of 2 \* batch 4 \* accumulation 1 = 8 "):
        step_at(state, world_size=2, batch_size=4, accumulation=1, steps_per_epoch=4, checkpoint=Path("c"))


def test_stock_trainer_continues_differently(tmp_path: Path) -> None:
    """What ResumableTrainer fixes, measured on the same job with a stock Trainer: its batches after the resume
    are not its uninterrupted run's (its sampler skips the index lists without reading them, on a map-style
    dataset, but the order and the augmentation values drawn after the resume differ)."""
    run(tmp_path / "full", 1, "--stock")
    run(tmp_path / "cut", 1, "--stock", "--crash-at", "10")
    cut = len(logs(tmp_path / "cut")[0])
    run(tmp_path / "cut", 1, "--stock", "--resume", "true")
    uninterrupted, resumed = logs(tmp_path / "full")[0], logs(tmp_path / "cut")[0]
    assert resumed[:cut] == uninterrupted[:cut] and len(resumed) == len(uninterrupted)
    assert resumed[cut:] != uninterrupted[cut:]


def test_the_checkpoint_file_holds_this_ranks_state(crashed: Path) -> None:
    import torch

    saved = torch.load(crashed / "run" / "checkpoint-10" / "loader_resume_0.pt", weights_only=True)
    assert (saved["world_size"], saved["rank"], saved["global_step"]) == (1, 0, 10)
    assert json.loads((crashed / "run" / "checkpoint-10" / "trainer_state.json").read_text())["global_step"] == 10


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


def test_ranks_that_find_different_checkpoints_are_refused_not_resumed_apart(tmp_path: Path) -> None:
    """resume_from_checkpoint=True: every rank looks in output_dir itself; ranks that do not see the same newest
    complete checkpoint (no shared directory, a lagging network file system) would resume different steps, or
    one from the beginning. Refused on every rank, naming what each found; the same one goes through."""
    import multiprocessing

    import transformers_resume.checkpoint_files  # noqa: F401 (imported once, before the ranks are forked)

    context = multiprocessing.get_context("fork")
    for case, found in (("differ", ["out/checkpoint-9", None]), ("same", ["out/checkpoint-9"] * 2)):
        (tmp_path / case).mkdir()
        ranks = [context.Process(target=_choose, args=(rank, str(tmp_path / case / "store"), found[rank],
                                                       str(tmp_path / case))) for rank in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=120)
        chose = [(tmp_path / case / f"chose-{rank}").read_text() for rank in range(2)]
        if case == "same":
            assert chose == ["out/checkpoint-9"] * 2
        else:
            expected = "rank 0: checkpoint-9, rank 1: none"
            assert all(text.startswith("CheckpointError") and expected in text for text in chose), chose
