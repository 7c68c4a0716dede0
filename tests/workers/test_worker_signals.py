"""DataLoader workers of a preemptible job ignore the preemption signals from the moment they are
forked.

A signal sent to a whole process group (``kill -TERM -PGID``, torchrun's agent stopping a rank)
reaches the DataLoader workers too. torch's worker installs its own SIGTERM handler (which kills the
worker on a SIGTERM not sent by its parent) before any ``worker_init_fn`` runs; a signal in between
killed the worker and, with it, the main process's next batch. The job here starts a new pool of
workers for each of many short epochs (a map-style dataset and a stream) while the test signals its
process group every 20 ms.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from support.launch import TESTS

JOB = """
import sys, time
from torch.utils.data import DataLoader
from loader_resume import ResumableDataLoader
from loader_resume.convert import sharded_resumable
from loader_resume.job.preemption import Preemption, workers_ignore_signals
from support.data import NoisyStream

class Evaluation(DataLoader):  # a framework's own DataLoader class (Accelerate's DataLoaderShard)
    pass

preemption = Preemption(("SIGTERM",))
preemption.install()
if sys.argv[2] == "ours":
    loaders = [sharded_resumable(DataLoader(data, batch_size=4, num_workers=2), rank=0,
                                 world_size=1, loader_class=ResumableDataLoader, seed=0,
                                 keying="batch", keyed_generators=("torch",),
                                 ignore_signals=preemption.signals)
               for data in (list(range(16)), NoisyStream(16, 0, 1))]
else:  # evaluation loaders a framework built: plain, or made safe
    loaders = [Evaluation(data, batch_size=4, num_workers=2)
               for data in (list(range(16)), NoisyStream(16, 0, 1))]
    if sys.argv[2] == "evaluation":
        loaders = [workers_ignore_signals(loader, preemption.signals) for loader in loaders]
        assert all(isinstance(loader, Evaluation) for loader in loaders)
print("started", flush=True)
epochs, end = 0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for loader in loaders:
        assert len(list(loader)) == 4
    epochs += 1
print(f"epochs {epochs} received {preemption.received}", flush=True)
"""


@pytest.mark.parametrize("loaders", ["ours", "evaluation"])
def test_a_signal_to_the_whole_process_group_never_kills_a_dataloader_worker(loaders: str) -> None:
    """``evaluation``: DataLoaders of another class made safe by ``workers_ignore_signals`` (what
    the front doors do to the evaluation loaders a framework builds)."""
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, "5", loaders],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert job.stdout is not None and job.stdout.readline() == "started\n"
    signals = 0
    while job.poll() is None and signals < 200:
        os.killpg(job.pid, signal.SIGTERM)
        signals += 1
        time.sleep(0.02)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0 and signals >= 100, err[-3000:]
    epochs = int(out.split()[1])
    # many pools forked; the main process heard it
    assert epochs >= 10 and out.split()[3] == str(int(signal.SIGTERM))


def test_without_it_a_signal_to_the_group_kills_a_plain_loaders_worker() -> None:
    """The control: the same job over plain evaluation loaders dies of the signal."""
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, "5", "plain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=TESTS,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    assert job.stdout is not None and job.stdout.readline() == "started\n"
    while job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
        time.sleep(0.02)
    _, err = job.communicate(timeout=60)
    # torch reports a killed worker in one of two ways: its watchdog's "killed by signal", or, when
    # the worker died while the main process fetched the shared memory of a batch it had sent, a
    # failure inside rebuild_storage_fd (the worker held the other end of the socket that passes the
    # file descriptor).
    assert job.returncode != 0 and ("killed by signal" in err or "in rebuild_storage_fd" in err), (
        err[-3000:]
    )


@pytest.mark.parametrize("context", ["spawn", "forkserver", None])
def test_evaluation_loaders_made_safe_start_their_workers_under_every_start_method(
    context: str | None,
) -> None:
    """Spawn and forkserver pickle the process: the process that holds the signals while it starts
    must pickle."""
    from torch.utils.data import DataLoader

    from loader_resume.job.preemption import IgnoreSignalsInWorker, workers_ignore_signals

    loader = DataLoader(
        list(range(8)), batch_size=2, num_workers=2, multiprocessing_context=context
    )
    assert workers_ignore_signals(loader, (signal.SIGTERM,)) is loader
    assert isinstance(loader.worker_init_fn, IgnoreSignalsInWorker)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
