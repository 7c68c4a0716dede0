"""``FabricResume`` with Fabric's sharding strategies on two CPU processes (gloo; Fabric launches
rank 1): ``FSDPStrategy`` with sharded checkpoints (torch's first FSDP, placed on the CPU by the
child's ``CPUFSDPStrategy``: Fabric passes it no device there, which torch refuses) and
``ModelParallelStrategy`` (FSDP2 ``fully_shard``). Rank 0 sends itself SIGTERM after micro-batch 6
(mid second epoch): the agreed checkpoint is a sharded one, every rank exits 143, and the same
command continues with the uninterrupted run's batches (ids and values, learning rates) and final
weights on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import forked
from support.launch import CHILDREN, logs, weights

CHILD = CHILDREN / "fabric_child.py"


def run(out: Path, strategy: str, *args: str, expect: int = 0) -> None:
    done = forked.run(
        [sys.executable, str(CHILD), str(out), "--devices", "2", "--strategy", strategy, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == expect, f"{strategy}: exit {done.returncode}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("strategy", ["fsdp-sharded", "model-parallel"])
def test_sigterm_mid_epoch_and_the_same_command_continue_exactly(
    tmp_path: Path, strategy: str
) -> None:
    run(tmp_path / "full", strategy)
    run(tmp_path / "cut", strategy, "--signal-at", "6", expect=143)
    checkpoint = sorted((tmp_path / "cut" / "resume_checkpoints").glob("step_*"))
    assert [path.name for path in checkpoint] == ["step_000000006"]
    run(tmp_path / "cut", strategy)
    assert logs(tmp_path / "cut") == logs(tmp_path / "full")
    assert (
        weights(tmp_path / "cut") == weights(tmp_path / "full")
        and len(weights(tmp_path / "full")) == 2
    )
