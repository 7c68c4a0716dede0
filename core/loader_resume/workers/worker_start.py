"""Workers that never start are reported, not waited for forever.

A forked process inherits only the thread that forked, and every lock as it was at that instant. In
CPython (seen with 3.11), a thread of the parent that was exiting at the instant of the fork (a
``multiprocessing`` queue's feeder thread, closed when a DataLoader's previous worker pool shut
down) can hold the interpreter's thread-list lock, and the child then waits for it forever inside
its after-fork re-initialisation, before any Python code of its own runs. torch's DataLoader waits
for such a worker's batches forever too (it checks only whether its workers are alive), and so does
the whole job. A plain ``DataLoader`` forks the same way and shares the hazard.

A ``ResumableDataLoader`` that starts workers by ``fork`` (the
default on Linux; ``spawn`` and ``forkserver`` start from a process without those threads):

- makes every fork of the process from then on first wait (at most 10 seconds) for the feeder
  threads that are stopping right now (``join_exiting_feeders``, an ``os.register_at_fork`` hook):
  no fork happens while one of them stops — a plain ``DataLoader``'s pools in the same process
  included. The garbage collector is paused from that wait to the fork (it could shut an earlier
  pool down in between, so that one of its feeder threads starts stopping at the instant of the
  fork);
- then waits until every new worker has started (a byte in shared memory that the worker sets first
  thing in its ``worker_init_fn``; a forked worker starts within milliseconds). A worker that has
  not started after ``worker_start_timeout`` seconds is named in an error (its pid, how long, what
  to change), killed, and the ``iter()`` raises ``WorkerStartError`` instead of hanging.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

from loader_resume.errors import WorkerStartError
from loader_resume.workers.torch_internals import (
    closing_feeder_threads,
    forget_persistent_iterator,
    forks_workers,
    kill_workers,
    starts_workers,
    worker_processes,
)

__all__ = ["StartMark", "WorkerStart", "WorkerStartError", "join_exiting_feeders", "wait_started"]

logger = logging.getLogger(__name__)

_POLL = 0.002



class StartMark:
    """A worker's ``worker_init_fn``: mark this worker started (first thing), then the one it
    had."""

    def __init__(self, inner: Callable[[int], None] | None, workers: int, context: Any) -> None:
        self.inner = inner
        # NOTE: shared with forked and spawned
        self.marks = (context or multiprocessing).RawArray("b", workers)

    def __call__(self, worker_id: int) -> None:
        self.marks[worker_id] = 1
        if self.inner is not None:
            self.inner(worker_id)


class WorkerStart:
    """One ``iter()`` of a loader: if it starts workers, their ``worker_init_fn`` (in
    ``attributes``, the loader's attributes torch's iterator is built with) marks them started;
    ``wait`` waits for the marks."""

    def __init__(self, loader: Any, attributes: dict[str, Any]) -> None:
        self.loader = loader
        self.mark: StartMark | None = None
        self.timeout: float | None = loader.worker_start_timeout
        # NOTE: spawn and forkserver fork no threads
        if starts_workers(loader) and forks_workers(loader):
            _guard_forks()
            inner = attributes.get("worker_init_fn", loader.worker_init_fn)
            self.mark = StartMark(inner, loader.num_workers, loader.multiprocessing_context)
            attributes["worker_init_fn"] = self.mark

    def wait(self, iterator: Any) -> None:
        """Return once ``iterator``'s workers started (``wait_started``)."""
        if self.mark is not None:
            try:
                wait_started(iterator, self.mark, self.timeout)
            except WorkerStartError:
                forget_persistent_iterator(self.loader)
                raise


_GUARDED: list[bool] = []


def _guard_forks() -> None:
    """From now on every fork of this process first waits for the feeder threads that are stopping.
    NOTE: at the instant of the fork, not before: a previous pool may be shut down by the garbage
    collector at any moment."""
    if not _GUARDED:
        _GUARDED.append(True)
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
        )


# whether the garbage collector was enabled before the fork in progress
_COLLECTING: list[bool] = []


def _before_fork() -> None:
    """Pause the garbage collector until the fork is done, then wait for the feeder threads that are
    stopping. NOTE: paused first: a collection after the wait (during the other fork hooks) could
    shut a pool down whose feeder thread would then stop at the instant of the fork (seen, 1 fork in
    100, on 2 busy cores)."""
    _COLLECTING.append(gc.isenabled())
    gc.disable()
    join_exiting_feeders()


def _after_fork() -> None:
    if _COLLECTING and _COLLECTING.pop():
        gc.enable()


def join_exiting_feeders(timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` seconds in all) until no queue feeder thread that was told to stop
    is still alive. NOTE: one stops in milliseconds, but on a loaded machine its thread may not run
    for over a second (1 s was seen to be too short on 2 busy cores); only a thread that never stops
    makes a fork wait the whole timeout."""
    deadline = time.monotonic() + timeout
    while (threads := closing_feeder_threads()) and time.monotonic() < deadline:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def wait_started(iterator: Any, mark: StartMark, timeout: float | None) -> None:
    """Return once every worker of ``iterator`` (just built, its workers just started) has run
    ``mark``, or one has died (torch reports that at the first batch). After ``timeout`` seconds,
    the workers that have not started are killed and ``WorkerStartError`` names them."""
    workers = worker_processes(iterator)
    start = time.monotonic()
    while not all(mark.marks[i] for i in range(len(workers))):
        if any(not worker.is_alive() for worker in workers):
            return
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            stuck = [(i, worker.pid) for i, worker in enumerate(workers) if not mark.marks[i]]
            message = (
                f"DataLoader worker(s) {', '.join(f'{i} (pid {pid})' for i, pid in stuck)} never "
                f"started: {waited:.0f} s after they were forked (a fork while another thread of "
                f"this process held an interpreter lock; loader.worker_start_timeout={timeout}). "
                "Killed them instead of waiting forever; the job can be rerun (it resumes from "
                "its last checkpoint). To avoid the hazard, build the loader with "
                "multiprocessing_context='forkserver' (or 'spawn')"
            )
            logger.error("%s", message)
            kill_workers(iterator, [pid for _, pid in stuck if pid is not None])
            raise WorkerStartError(message)
        time.sleep(_POLL)
