"""``RayResume`` when nodes go: real Ray Train jobs on a ``ray.cluster_utils.Cluster`` (a head
without CPUs) and worker nodes started by the tests, each a real raylet process.

- A node drained with Ray's preemption reason and a deadline (``ray drain-node``, what a cloud's
  reclaim comes as), removed at the deadline; and
- SIGTERM to a node's process (``ray start --block``, as Kubernetes sends when it deletes the pod):
  Ray drains the node with its preemption reason and a deadline; at the next step boundary every
  worker reports a checkpoint and takes no further step; at the deadline the node goes, Ray restarts
  the run on another node, and it continues with the very next batch: each step taken once, the
  uninterrupted run's batches and weights.
- A node lost under ``ScalingConfig(num_workers=(1, 2))``: Ray restarts on the node left, with 1
  worker, from the last registered checkpoint; every sample of each epoch is delivered exactly once.
"""

from __future__ import annotations

import os
import signal
import socket
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
    # Ray's controller asks the GCS for drains (5 s)
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.2"
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
    """Adds worker nodes (from the main thread: a node's start installs a signal handler); removes
    what is left."""
    added: list[Any] = []

    def add(count: int, cpus: int) -> list[Any]:
        new = [cluster.add_node(num_cpus=cpus) for _ in range(count)]
        cluster.wait_for_nodes()
        added.extend(new)
        for _ in range(600):  # Ray's elastic scaling starts with the workers it can place at once
            if ray.available_resources().get("CPU", 0) >= count * cpus:
                return new
            time.sleep(0.1)
        raise AssertionError(
            f"the cluster never showed {count * cpus} CPUs: {ray.available_resources()}"
        )

    yield add  # type: ignore[misc]
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted run's logs (on a node of its own, removed after)."""
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    runs = tmp_path_factory.mktemp("reference")
    assert fit(runs / "logs", runs / "storage", epochs=EPOCHS, every=0) is None
    cluster.remove_node(node)
    yield runs / "logs"


def assert_the_notice_stopped_every_worker_and_the_restart_took_the_next_batch(
    logs: Path, storage: Path, reference: Path, preempted: list[str]
) -> None:
    """At the notice (step 4) every worker reported the only checkpoint and took no further step;
    the restart, on another node, began with step 5: each step once, the uninterrupted run's batches
    and weights."""
    for rank in range(2):
        first, restarted = rows(logs, rank)
        assert first[-1]["step"] == 4 and restarted[0]["step"] == 5, (
            "the notice's step, then the very next"
        )
        assert [row["step"] for row in first + restarted] == list(range(1, 5 * EPOCHS + 1)), (
            "each step once"
        )
        assert {row["node"] for row in first} == set(preempted) and restarted[0][
            "node"
        ] not in preempted
        assert steps(logs, rank) == steps(reference, rank)
    assert [path.name for path in (storage / "run").glob("step_*")] == ["step_000000004"]
    assert (logs / "weights.txt").read_text() == (reference / "weights.txt").read_text()


def test_a_node_drained_for_preemption_checkpoints_all_workers_at_one_step_and_restarts_at_the_next(
    cluster: Cluster, nodes: Callable[..., list[Any]], reference: Path, tmp_path: Path
) -> None:
    """Two nodes of 2 CPUs; both workers on one. After step 3 that node is drained with Ray's
    preemption reason and a 12 s deadline (``ray drain-node``, what a cloud's reclaim comes as); at
    the deadline it is removed. The workers wait after step 3 for the notice, so that it comes at
    step 4 however slowly Ray passes it on."""
    nodes(2, 2)
    logs, drained = tmp_path / "logs", []

    def preempt(node: str) -> None:
        subprocess.run(
            [
                str(Path(sys.executable).with_name("ray")),
                "drain-node",
                "--address",
                cluster.address,
                "--node-id",
                node,
                "--reason",
                "DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message",
                "spot reclaim",
                "--deadline-remaining-seconds",
                "12",
            ],
            check=True,
        )
        drained.append(node)
        time.sleep(12)
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node))

    watcher = when(logs, 0, 3, preempt)
    assert (
        fit(logs, tmp_path / "storage", epochs=EPOCHS, every=0, check_every=1, notice_at=3) is None
    )
    watcher.join(timeout=60)
    assert not watcher.is_alive(), "the watched step never came"
    assert_the_notice_stopped_every_worker_and_the_restart_took_the_next_batch(
        logs, tmp_path / "storage", reference, drained)


def start_node(cluster: Cluster, cpus: int) -> tuple[subprocess.Popen[bytes], str]:
    """A worker node as users start one (``ray start --block``, the process Kubernetes signals when
    it deletes the pod), with a 12 s drain on SIGTERM (Ray's default: 30 s); the node's process and
    its node id."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    process = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--address",
            cluster.address,
            "--num-cpus",
            str(cpus),
            "--node-manager-port",
            str(port),
            "--block",
            "--disable-usage-stats",
        ],
        env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "12"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(600):
        found = [
            node["NodeID"]
            for node in ray.nodes()
            if node["Alive"] and node["NodeManagerPort"] == port
        ]
        if found:
            return process, found[0]
        assert process.poll() is None, f"ray start exited with {process.returncode}"
        time.sleep(0.1)
    raise AssertionError("the node started with ray start never joined the cluster")


def test_sigterm_to_a_node_checkpoints_every_worker_at_one_step_and_restarts_at_the_next_batch(
    cluster: Cluster, reference: Path, tmp_path: Path
) -> None:
    """Two nodes of 2 CPUs started with ``ray start --block``; both workers on one. After step 3
    that node's process gets SIGTERM: Ray drains the node itself (the preemption reason, a 12 s
    deadline), then stops it. Ray 2.60 counts that stop as a failure (``max_failures``), not a
    preemption."""
    nodes = dict(start_node(cluster, 2)[::-1] for _ in range(2))
    try:
        logs, signalled = tmp_path / "logs", []

        def preempt(node: str) -> None:
            nodes[node].send_signal(signal.SIGTERM)
            signalled.append(node)

        watcher = when(logs, 0, 3, preempt)
        assert fit(logs, tmp_path / "storage", epochs=EPOCHS, every=0, check_every=1, notice_at=3,
                   max_failures=1) is None
        watcher.join(timeout=60)
        assert not watcher.is_alive(), "the watched step never came"
        assert_the_notice_stopped_every_worker_and_the_restart_took_the_next_batch(
            logs, tmp_path / "storage", reference, signalled)
        # the signalled node's process ends once it has drained
        nodes[signalled[0]].wait(timeout=60)
    finally:
        for process in nodes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in nodes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def test_a_node_lost_under_elastic_scaling_restarts_on_one_worker_and_delivers_each_sample_once(
    cluster: Cluster, nodes: Callable[..., list[Any]], tmp_path: Path
) -> None:
    """Two nodes of 1 CPU, a worker on each (``num_workers=(1, 2)``). Rank 1's node is removed after
    its step 7 (of 10); Ray restarts on the node left with 1 worker, from the last registered
    checkpoint (every 2 steps)."""
    nodes(2, 1)
    logs, lost = tmp_path / "logs", []

    def lose(node: str) -> None:
        lost.append(node)
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node))

    watcher = when(logs, 1, 7, lose)
    assert (
        fit(logs, tmp_path / "storage", num_workers=(1, 2), every=2, max_failures=1, sleep=0.4)
        is None
    )
    watcher.join(timeout=60)
    assert not watcher.is_alive(), "the watched step never came"
    (first0, restarted), (first1,) = rows(logs, 0), rows(logs, 1)
    assert {row["node"] for row in first1} == set(lost) and restarted[0]["node"] not in lost
    saved = restarted[0]["step"] - 1  # the checkpoint Ray restarted from
    assert saved in (2, 4, 6)
    for epoch in (0, 1):
        before = [
            i
            for row in first0 + first1
            if row["step"] <= saved and row["epoch"] == epoch
            for i in row["ids"]
        ]
        after = [i for row in restarted if row["epoch"] == epoch for i in row["ids"]]
        assert sorted(before + after) == list(range(ITEMS)), epoch
