"""``RayResume`` when nodes go: real Ray Train jobs on a ``ray.cluster_utils.Cluster`` (a head without CPUs and
worker nodes started and removed by the tests, each a real raylet process).

- Ray's preemption notice (the node hosting the workers drained with Ray's preemption reason and a deadline, as a
  cloud's spot reclaim does; ``ray drain-node``): every worker reports a checkpoint at the same step boundary and
  takes no further step; at the deadline the node is removed, Ray restarts the run on another node, and it
  continues with the very next batch — each step taken once, the uninterrupted run's batches and weights.
- A node lost under ``ScalingConfig(num_workers=(1, 2))``: Ray restarts on the node left, with 1 worker, from the
  last registered checkpoint; every sample of each epoch is delivered exactly once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from train_loop import ITEMS, fit, rows, steps, when

pytestmark = pytest.mark.timeout(900)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EPOCHS = 3  # 5 steps an epoch on 2 workers


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    saved = os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S")
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.2"  # Ray's controller asks the GCS for drains (5 s)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT / 'core'}:{ROOT}:{HERE}"}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if saved is None:
        del os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"]
    else:
        os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = saved


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[Callable[[int], list[Any]]]:
    """Adds worker nodes (from the main thread: a node's start installs a signal handler); removes what is left."""
    added: list[Any] = []

    def add(count: int, cpus: int) -> list[Any]:
        new = [cluster.add_node(num_cpus=cpus) for _ in range(count)]
        cluster.wait_for_nodes()
        added.extend(new)
        return new

    yield add  # type: ignore[misc]
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)


def test_a_preemption_notice_checkpoints_every_worker_at_one_step_and_the_restart_takes_the_next_batch(
    cluster: Cluster, nodes: Callable[..., list[Any]], tmp_path: Path
) -> None:
    """Two nodes of 2 CPUs; both workers on one. After step 3 that node is drained (preemption, deadline in 12 s):
    at the next step boundary both workers report a checkpoint and stop. At the deadline the node is removed; Ray
    restarts the run on the other node from that checkpoint (the only one: no periodic checkpoints)."""
    nodes(2, 2)
    reference = tmp_path / "reference"
    assert fit(reference / "logs", reference / "storage", epochs=EPOCHS, every=0) is None
    logs, drained = tmp_path / "logs", []

    def preempt(node: str) -> None:
        subprocess.run([str(Path(sys.executable).with_name("ray")), "drain-node", "--address", cluster.address,
                        "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                        "spot reclaim", "--deadline-remaining-seconds", "12"], check=True)
        drained.append(node)
        time.sleep(12)
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node))

    watcher = when(logs, 0, 3, preempt)
    assert fit(logs, tmp_path / "storage", epochs=EPOCHS, every=0, check_every=1, sleep=0.4) is None
    watcher.join(timeout=60)
    assert not watcher.is_alive(), "the watched step never came"
    for rank in range(2):
        first, restarted = rows(logs, rank)
        stopped_at = first[-1]["step"]
        assert 3 < stopped_at < 5 * EPOCHS, "the notice came mid-run, after the drain"
        assert [row["step"] for row in first + restarted] == list(range(1, 5 * EPOCHS + 1)), "each step once"
        assert {row["node"] for row in first} == set(drained) and restarted[0]["node"] not in drained
        assert steps(logs, rank) == steps(reference / "logs", rank)
    assert [path.name for path in (tmp_path / "storage" / "run").glob("step_*")] == [f"step_{stopped_at:09d}"]
    assert (logs / "weights.txt").read_text() == (reference / "logs" / "weights.txt").read_text()


def test_a_node_lost_under_elastic_scaling_restarts_on_one_worker_and_delivers_each_sample_once(
    cluster: Cluster, nodes: Callable[..., list[Any]], tmp_path: Path
) -> None:
    """Two nodes of 1 CPU, a worker on each (``num_workers=(1, 2)``). Rank 1's node is removed after its step 7
    (of 10); Ray restarts on the node left with 1 worker, from the last registered checkpoint (every 2 steps)."""
    nodes(2, 1)
    logs, lost = tmp_path / "logs", []

    def lose(node: str) -> None:
        lost.append(node)
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node))

    watcher = when(logs, 1, 7, lose)
    assert fit(logs, tmp_path / "storage", num_workers=(1, 2), every=2, max_failures=1, sleep=0.4) is None
    watcher.join(timeout=60)
    assert not watcher.is_alive(), "the watched step never came"
    (first0, restarted), (first1,) = rows(logs, 0), rows(logs, 1)
    assert {row["node"] for row in first1} == set(lost) and restarted[0]["node"] not in lost
    saved = restarted[0]["step"] - 1  # the checkpoint Ray restarted from
    assert saved in (2, 4, 6)
    for epoch in (0, 1):
        before = [i for row in first0 + first1 if row["step"] <= saved and row["epoch"] == epoch for i in row["ids"]]
        after = [i for row in restarted if row["epoch"] == epoch for i in row["ids"]]
        assert sorted(before + after) == list(range(ITEMS)), epoch
