"""Lightning's parallel strategies with ``ResumeCallback`` (``tests/children/lightning_child.py
--strategy``): DDP, FSDP with full and sharded state dicts, and ``ModelParallelStrategy`` (FSDP2
``fully_shard`` + distributed checkpoint directories), on one CPU process and on two (gloo).

FSDP (torch's first, which Lightning's ``FSDPStrategy`` wraps) refuses the CPU unless told its
device: the child's ``CPUFSDPStrategy`` is Lightning's strategy with that one argument given; saving
and loading are Lightning's. A parallel strategy puts a ``DistributedSampler`` on any training
loader without one — on one process too — by rebuilding the loader: the callback must shard the way
Lightning does, or the fit iterates a copy whose state is never saved (a resume then starts the
epoch over: other batches, other weights, no error).

Each case: an uninterrupted fit; the same fit SIGTERMed after step 7 (mid-epoch; it exits 143 with
``preempted.ckpt``) and run again (the automatic resume). The rerun's batches (ids and values, one
log line per step as it happens) and final weights equal the uninterrupted fit's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from support import forked
from support.launch import CHILDREN

CHILD = CHILDREN / "lightning_child.py"
CASES = [
    ("ddp", 1),
    ("fsdp-full", 1),
    ("fsdp-sharded", 1),
    ("model-parallel", 1),
    ("model-parallel", 2),
]


def fit(out: Path, strategy: str, devices: int, *args: str, expect: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    done = forked.run(
        [
            sys.executable,
            str(CHILD),
            str(out),
            "--strategy",
            strategy,
            "--devices",
            str(devices),
            "--batch-log",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == expect, (
        f"{strategy} on {devices}: exit {done.returncode}\n{done.stderr[-4000:]}"
    )


def batches(out: Path) -> list[list[dict[str, Any]]]:
    return [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob("log-*.jsonl"))
    ]


def weights(out: Path) -> list[str]:
    return [path.read_text() for path in sorted(out.glob("weights-*.txt"))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    runs = {}
    for strategy, devices in CASES:
        runs[strategy, devices] = tmp_path_factory.mktemp(f"{strategy}-{devices}")
        fit(runs[strategy, devices], strategy, devices)
    return runs


@pytest.mark.parametrize(("strategy", "devices"), CASES)
def test_sigterm_mid_epoch_and_the_same_command_continue_with_the_uninterrupted_fits_batches(
    uninterrupted: dict[tuple[str, int], Path], tmp_path: Path, strategy: str, devices: int
) -> None:
    reference = uninterrupted[strategy, devices]
    fit(tmp_path, strategy, devices, "--signal-at", "7", expect=143)
    assert [len(rows) for rows in batches(tmp_path)] == [7] * devices
    fit(tmp_path, strategy, devices)
    assert batches(tmp_path) == batches(reference)
    assert weights(tmp_path) == weights(reference) and len(weights(reference)) == devices


@pytest.mark.parametrize(("strategy", "devices"), [("fsdp-sharded", 1), ("model-parallel", 2)])
def test_fit_from_a_sharded_checkpoint_directory_continues_exactly(
    uninterrupted: dict[tuple[str, int], Path], tmp_path: Path, strategy: str, devices: int
) -> None:
    """``fit(ckpt_path=<ModelCheckpoint's step=9.ckpt>)``, a directory of shards (step 9: one step
    into epoch 2)."""
    reference = uninterrupted[strategy, devices]
    checkpoint = reference / "ckpt" / "step=9.ckpt"
    assert checkpoint.is_dir()
    fit(tmp_path, strategy, devices, "--resume", str(checkpoint))
    assert batches(tmp_path) == [
        [row for row in rows if row["step"] > 9] for rows in batches(reference)
    ]
    assert weights(tmp_path) == weights(reference)


def test_tensor_parallel_ranks_sharing_one_data_shard_are_refused_not_fed_apart(
    tmp_path: Path,
) -> None:
    """``ModelParallelStrategy()`` on 2 devices of one node is tensor parallel (one data-parallel
    rank): both processes must see the same batches, which per-process sharding would not give.
    Refused at setup, named."""
    out = tmp_path / "tp"
    out.mkdir()
    done = forked.run(
        [
            sys.executable,
            str(CHILD),
            str(out),
            "--strategy",
            "model-parallel-auto",
            "--devices",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert (
        "ResumeCallback under ModelParallelStrategy: the data is sharded over 1 data-parallel "
        "ranks of 2 processes"
    ) in done.stderr, done.stderr[-3000:]
    assert not list(out.glob("log-*.json"))
