"""The GPU tier (``pytest -m gpu``; the default run deselects it): every front door on a CUDA
device.

Why a GPU: on one, dropout draws from the CUDA generators (a resume that restores only the CPU
generator continues another sequence), batches are copied from pinned memory, the forward runs under
bf16 autocast, and torch's first FSDP (which Lightning's, Fabric's and Accelerate's FSDP wrap) runs
at all — it refuses the CPU. Each case: an uninterrupted run, the same run interrupted mid-epoch by
a signal (exit 143 with the agreed checkpoint, never a hang), then the same command again: its
batches (ids and augmentation values) and final weights equal the uninterrupted run's, bit for bit.

``GPU_TIER_DEVICE=cpu`` runs the same cases on the CPU (bf16 autocast and ``pin_memory`` there too;
FSDP through the children's CPU placement), to check the tier itself on a machine without a GPU;
Fabric's FSDP with full state dicts crashes on the CPU and Accelerate ignores FSDP there, so those
cases need CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from support.launch import CHILDREN, ROOT, TORCHRUN, free_port, logs, weights

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("GPU_TIER_DEVICE", "cuda")
ON_GPU = ["--device", DEVICE, "--bf16", "--pin-memory"]


@pytest.fixture(autouse=True)
def a_gpu() -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail(
            "the GPU tier (-m gpu) needs a CUDA device; GPU_TIER_DEVICE=cpu checks it on the CPU"
        )


def needs_cuda(reason: str) -> Any:
    return pytest.mark.skipif(DEVICE != "cuda", reason=reason)


def child(
    out: Path, script: str, *args: str, expect: int = 0, launcher: list[str] | None = None
) -> None:
    """``script OUT *args`` (the Lightning child's per-step log: into OUT as well)."""
    out.mkdir(parents=True, exist_ok=True)
    logged = ["--batch-log", str(out)] if script == "lightning_child.py" else []
    done = subprocess.run(
        [*(launcher or [sys.executable]), str(CHILDREN / script), str(out), *logged, *args],
        capture_output=True,
        text=True,
        timeout=420,
    )
    report = f"{script} {args}: exit {done.returncode}\n{done.stderr[-6000:]}"
    if launcher and expect:  # torchrun exits 1 and names the rank's exit code
        assert done.returncode != 0 and f"exitcode  : {expect}" in done.stderr, report
    else:
        assert done.returncode == expect, report


def interrupted_then_resumed(tmp_path: Path, script: str, args: list[str], signal_args: list[str],
                             launcher: list[str] | None = None) -> None:
    """Uninterrupted; signalled (exit 143); the same command: the same batches and weights."""
    child(tmp_path / "full", script, *args, launcher=launcher)
    child(tmp_path / "cut", script, *args, *signal_args, expect=143, launcher=launcher)
    child(tmp_path / "cut", script, *args, launcher=launcher)
    assert logs(tmp_path / "cut") == logs(tmp_path / "full") and logs(tmp_path / "full")[0]
    assert (
        weights(tmp_path / "cut") == weights(tmp_path / "full")
        and len(weights(tmp_path / "full")) == 1
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_resumes_exactly_with_cuda_dropout_bf16_and_pinned_batches(
    tmp_path: Path, workers: int
) -> None:
    """Lightning's ``Trainer(deterministic=True)``: ``torch.use_deterministic_algorithms(True)`` on
    the GPU."""
    interrupted_then_resumed(
        tmp_path, "lightning_child.py", [*ON_GPU, "--workers", str(workers)], ["--signal-at", "7"]
    )


@pytest.mark.parametrize("strategy", ["fsdp-full", "fsdp-sharded", "model-parallel"])
def test_lightning_fsdp_strategies_on_one_gpu_resume_exactly(tmp_path: Path, strategy: str) -> None:
    """Lightning's own ``FSDPStrategy`` (torch's first FSDP: a GPU only) and
    ``ModelParallelStrategy`` on one device; the first was silently wrong before the callback
    sharded as Lightning does."""
    args = [*ON_GPU, "--strategy", strategy, "--workers", "2"]
    interrupted_then_resumed(tmp_path, "lightning_child.py", args, ["--signal-at", "7"])


def test_lightning_fit_from_a_sharded_fsdp_checkpoint_continues_exactly(tmp_path: Path) -> None:
    """``fit(ckpt_path=<FSDPStrategy's sharded directory>)``: restored after setup, on the GPU."""
    args = [*ON_GPU, "--strategy", "fsdp-sharded"]
    child(tmp_path / "full", "lightning_child.py", *args)
    checkpoint = tmp_path / "full" / "ckpt" / "step=9.ckpt"
    assert checkpoint.is_dir()
    child(tmp_path / "from9", "lightning_child.py", *args, "--resume", str(checkpoint))
    rows = [row for row in logs(tmp_path / "full")[0] if row["step"] > 9]
    assert logs(tmp_path / "from9") == [rows] and weights(tmp_path / "from9") == weights(
        tmp_path / "full"
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_fabric_resumes_exactly_with_cuda_dropout_bf16_and_pinned_batches(
    tmp_path: Path, workers: int
) -> None:
    """``FabricResume`` on ``Fabric(accelerator="cuda", precision="bf16-mixed")``."""
    interrupted_then_resumed(
        tmp_path, "fabric_child.py", [*ON_GPU, "--workers", str(workers)], ["--signal-at", "6"]
    )


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(
            "fsdp-full",
            marks=needs_cuda("torch's first FSDP with full state dicts crashes on the CPU"),
        ),
        "fsdp-sharded",
    ],
)
def test_fabric_fsdp_on_one_gpu_resumes_exactly(tmp_path: Path, strategy: str) -> None:
    """Fabric's own ``FSDPStrategy`` (a GPU only), full and sharded checkpoints: learning rates
    too."""
    interrupted_then_resumed(
        tmp_path, "fabric_child.py", [*ON_GPU, "--strategy", strategy], ["--signal-at", "6"]
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_resumes_exactly_with_cuda_dropout_bf16_and_pinned_batches(
    tmp_path: Path, workers: int
) -> None:
    """``enable_resume`` on ``Accelerator(mixed_precision="bf16")`` on the GPU."""
    interrupted_then_resumed(tmp_path, "accelerate_child.py", [*ON_GPU, "--workers", str(workers)],
                             ["--signal-at", "7"])


@needs_cuda("Accelerate ignores its FSDP plugin on the CPU (the child asserts FSDP is on)")
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_accelerate_fsdp_on_one_gpu_ends_with_143_not_a_hang_and_resumes_exactly(
    tmp_path: Path, kind: str
) -> None:
    """``FullyShardedDataParallelPlugin(state_dict_type=FULL_STATE_DICT / SHARDED_STATE_DICT)``
    under torchrun (Accelerate uses FSDP in a distributed run only): SIGTERM ends with the agreed
    checkpoint and 143. SGD with momentum: the optimizer's state is restored too (sharded,
    Accelerate alone loaded none of it)."""
    launcher = [TORCHRUN, "--nproc_per_node", "1", "--master_port", str(free_port())]
    args = [*ON_GPU, "--fsdp", kind, "--momentum", "0.9"]
    interrupted_then_resumed(tmp_path, "accelerate_child.py", args, ["--signal-at", "7"],
                             launcher=launcher)


@needs_cuda("Accelerate ignores its FSDP plugin on the CPU")
def test_the_accelerate_fsdp_journey_stopped_by_sigterm_and_rerun_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    """The Journeys page's Accelerate with FSDP as written: ``accelerate launch --config_file
    configs/accelerate_fsdp.yaml`` (one process on the one GPU) of the unchanged
    ``examples/accelerate_digits.py``. SIGTERM to the job's whole process group, launcher and worker
    alike (as a scheduler sends it), at step 20 of epoch 0: a sealed checkpoint holding FSDP's
    sharded model, and no end; the same command again continues and ends with the uninterrupted
    run's weights (the digest it prints)."""
    def command(project: Path) -> list[str]:
        return [
            str(Path(sys.executable).with_name("accelerate")),
            "launch",
            "--config_file",
            str(ROOT / "configs" / "accelerate_fsdp.yaml"),
            "--num_processes",
            "1",
            "--main_process_port",
            str(free_port()),
            str(ROOT / "examples" / "accelerate_digits.py"),
            f"project_dir={project}",
        ]

    def digest(output: str) -> str:
        (line,) = [
            line for line in output.splitlines() if line.startswith("final weights digest: ")
        ]
        return line

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = subprocess.run(
        command(tmp_path / "full"), capture_output=True, text=True, timeout=420, env=env
    )
    assert full.returncode == 0, full.stderr[-4000:]
    with (tmp_path / "stderr").open("w") as stderr:
        first = subprocess.Popen(
            command(tmp_path / "cut"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert first.stdout is not None
        for line in first.stdout:  # training is under way, mid-epoch 0 of 3
            if line.startswith("epoch 0 step 20 "):
                os.killpg(first.pid, signal.SIGTERM)
                break
        rest = first.communicate(timeout=300)[0]
    assert first.returncode != 0 and "final weights digest" not in rest, (
        tmp_path / "stderr"
    ).read_text()[-4000:]
    sealed = [path.parent for path in (tmp_path / "cut").rglob("loader_resume_manifest.json")]
    # FSDP's sharded state
    assert len(sealed) == 1 and (sealed[0] / "pytorch_model_fsdp_0").is_dir(), sealed
    again = subprocess.run(
        command(tmp_path / "cut"), capture_output=True, text=True, timeout=420, env=env
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stdout and "epoch 0 step 20 " not in again.stdout  # it continued
    assert digest(again.stdout) == digest(full.stdout)


@pytest.mark.parametrize("workers", [0, 2])
def test_transformers_trainer_resumes_exactly_with_cuda_dropout_and_bf16(
    tmp_path: Path, workers: int
) -> None:
    """``ResumableTrainer`` with ``bf16=True`` on the GPU (Trainer pins its loaders' memory by
    default)."""
    args = [
        "--device",
        DEVICE,
        "--bf16",
        "--workers",
        str(workers),
        "--save-steps",
        "100",
        "--resume",
        "true",
    ]
    interrupted_then_resumed(tmp_path, "transformers_child.py", args, ["--signal-at", "5"])


def test_a_plain_loop_with_the_public_generators_resumes_exactly_under_deterministic_algorithms(
    tmp_path: Path
) -> None:
    """``examples/plain_digits.py`` (``global_rng_state`` per rank in its checkpoints) with CUDA
    dropout, bf16 autocast, pinned batches, two workers and
    ``torch.use_deterministic_algorithms(True)``: SIGTERM mid-epoch, the same command, the same
    batches and final weights (the digest it prints)."""
    def command(out: Path) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "examples" / "plain_digits.py"),
            "--out",
            str(out),
            "--batch-log",
            str(out),
            "--device",
            DEVICE,
            "--bf16",
            "--deterministic",
            "--workers",
            "2",
            "--epochs",
            "2",
            "--sleep",
            "0.05",
        ]

    def rows(out: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (out / "log-0.jsonl").read_text().splitlines()]

    (tmp_path / "full").mkdir()
    full = subprocess.run(command(tmp_path / "full"), capture_output=True, text=True, timeout=420)
    assert full.returncode == 0, full.stderr[-4000:]
    (tmp_path / "cut").mkdir()
    first = subprocess.Popen(
        command(tmp_path / "cut"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    log = tmp_path / "cut" / "log-0.jsonl"
    while not log.exists() or log.read_text().count("\n") < 20:
        assert time.monotonic() < deadline and first.poll() is None, (
            "training never reached step 20"
        )
        time.sleep(0.01)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 143, stderr[-4000:]
    again = subprocess.run(command(tmp_path / "cut"), capture_output=True, text=True, timeout=420)
    assert again.returncode == 0, again.stderr[-4000:]
    keys = ("step", "epoch", "ids", "batch")
    # the last write wins
    resumed = {row["step"]: [row[key] for key in keys] for row in rows(tmp_path / "cut")}
    assert resumed == {row["step"]: [row[key] for key in keys] for row in rows(tmp_path / "full")}
    assert again.stdout.splitlines()[-1] == full.stdout.splitlines()[-1]
    assert full.stdout.splitlines()[-1].startswith("final weights digest: ")
