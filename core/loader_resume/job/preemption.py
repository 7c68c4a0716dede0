"""Preemption: a signal only sets a flag; all ranks agree at a step boundary; the save happens
there.

Never save inside a signal handler: it runs at an arbitrary point of a step (mid-backward,
mid-collective) and, under DDP, a collective started there can deadlock against the other ranks
(Lightning's SIGTERM + OnExceptionCheckpoint hung 4 of 4 tries here). ``Preemption`` keeps the
handler to one assignment; the training loop calls ``Preemption.agreed`` at step boundaries, which
is one ``all_reduce`` so that every rank stops at the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import context as mp_context
from types import FrameType
from typing import Any

import torch.multiprocessing

from loader_resume.distributed import any_rank
from loader_resume.job.launcher import follow_launcher

__all__ = [
    "IgnoreSignalsInWorker",
    "Preemption",
    "held_while_forking",
    "signal_numbers",
    "workers_ignore_signals",
]

logger = logging.getLogger(__name__)


def signal_numbers(names: Sequence[str | int]) -> tuple[int, ...]:
    """``("SIGTERM", "SIGUSR1")`` -> their numbers; raises ValueError naming an unknown signal."""
    numbers = []
    for name in names:
        number = name if isinstance(name, int) else getattr(signal, str(name), None)
        if not isinstance(number, int) or isinstance(number, bool):
            valid = sorted(s.name for s in signal.Signals)
            raise ValueError(
                f"signals: unknown signal {name!r}; expected names such as 'SIGTERM', one of "
                f"{valid}"
            )
        numbers.append(int(number))
    return tuple(numbers)


class Preemption:
    """Catch ``signals``; report, at a step boundary and agreed by all ranks, whether one
    arrived."""

    def __init__(self, signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1")) -> None:
        self.signals = signal_numbers(signals)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        # the kernel sends signals[0] here when a launcher that passes none on dies
        self._following = False

    def install(self) -> None:
        """Install the handlers (main thread only; idempotent)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._on_signal)
        # NOTE: launcher.py
        self._following = bool(self.signals) and follow_launcher(self.signals[0])

    def uninstall(self) -> None:
        """Put back the handlers ours replaced, where ours is still the one installed (a framework
        that put its own predecessor back in the meantime, as Lightning at the end of ``fit``, keeps
        what it restored)."""
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self._on_signal:
                signal.signal(number, previous)
        self._previous = {}
        if self._following:
            self._following = follow_launcher(None)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # NOTE: only a flag. No I/O, no logging, no collective: see the module docstring.
        self.received = signum

    def agreed(self) -> bool:
        """Whether any rank received a signal; a collective under ``torch.distributed`` (call on all
        ranks)."""
        return any_rank(self.received is not None)


class IgnoreSignalsInWorker:
    """A ``worker_init_fn`` wrapper: DataLoader workers ignore the preemption signals.

    A signal sent to the whole process group (``kill -TERM -PGID``, some schedulers) also reaches
    the workers; a worker that dies of it takes the main process's next batch down with it. The main
    process alone decides when to stop.
    """

    def __init__(self, signals: Sequence[int], user_fn: Callable[[int], None] | None) -> None:
        self.signals, self.user_fn = tuple(signals), user_fn

    def __call__(self, worker_id: int) -> None:
        for number in self.signals:
            # NOTE: discards one held pending since the fork (see below)
            signal.signal(number, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        if self.user_fn is not None:
            self.user_fn(worker_id)


@contextmanager
def held_while_forking(worker_init_fn: Any) -> Iterator[None]:
    """While DataLoader starts its workers (in the main thread): the signals an
    ``IgnoreSignalsInWorker`` ignores are blocked, so a worker forked meanwhile holds them pending
    until its init ignores them. This process gets any that arrived as soon as the block ends.

    NOTE: torch's worker installs a SIGTERM handler of its own (in C) before the init runs, which
    kills the worker on a SIGTERM not sent by its parent: a signal to the whole process group in
    between took the worker, and then the main process, down."""
    signals = worker_init_fn.signals if isinstance(worker_init_fn, IgnoreSignalsInWorker) else ()
    blocking = bool(signals) and threading.current_thread() is threading.main_thread()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if blocking else None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def workers_ignore_signals(loader: Any, signals: Sequence[int]) -> Any:
    """``loader`` (a ``DataLoader`` of any class: an evaluation loader a framework built) with
    workers that ignore ``signals`` as a ``ResumableDataLoader``'s do: its ``worker_init_fn``
    wrapped in ``IgnoreSignalsInWorker``, and its ``multiprocessing_context`` one whose processes
    start with the signals held (as ``held_while_forking``). A signal to the whole process group
    during an evaluation then leaves the evaluation whole, and the job checkpoints at the next step
    boundary. Accelerate's ``DataLoaderShard``: its ``base_dataloader``. Without workers, or done
    already, it is returned as it is."""
    # NOTE: Accelerate's adapter iterates the loader it wraps
    inner = getattr(loader, "base_dataloader", loader)
    if (
        not signals
        or not getattr(inner, "num_workers", 0)
        or isinstance(inner.worker_init_fn, IgnoreSignalsInWorker)
    ):
        return loader
    inner.worker_init_fn = IgnoreSignalsInWorker(signals, inner.worker_init_fn)
    inner.multiprocessing_context = _holding_context(inner.multiprocessing_context, tuple(signals))
    return loader


def _holding_context(context: Any, signals: tuple[int, ...]) -> Any:
    """A multiprocessing context like ``context`` (DataLoader's: ``None`` is torch's default, a
    name, or a context), whose processes start with ``signals`` held in the starting thread;
    ``context`` itself where it is of no standard kind."""
    base = (
        torch.multiprocessing.get_context(context)
        if context is None or isinstance(context, str)
        else context
    )
    holding = _HOLDING_CONTEXTS.get(type(base))
    return base if holding is None else holding(signals)


class _HoldingStart:
    """A process whose ``start()`` holds ``held`` (module level: spawn and forkserver pickle the
    process)."""

    held: tuple[int, ...] = ()

    def start(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        previous = (
            signal.pthread_sigmask(signal.SIG_BLOCK, self.held) if main and self.held else None
        )
        try:
            super().start()  # type: ignore[misc]
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _HoldingContext:
    """A context whose ``Process(...)`` is ``process_class`` with ``held`` set."""

    process_class: type[Any]

    def __init__(self, held: tuple[int, ...]) -> None:
        super().__init__()
        self.held = held

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # NOTE: multiprocessing's name
        process = self.process_class(*args, **kwargs)
        process.held = self.held
        return process


class _HoldingForkProcess(_HoldingStart, mp_context.ForkProcess):
    pass


class _HoldingSpawnProcess(_HoldingStart, mp_context.SpawnProcess):
    pass


class _HoldingForkServerProcess(_HoldingStart, mp_context.ForkServerProcess):
    pass


class _HoldingForkContext(_HoldingContext, mp_context.ForkContext):  # type: ignore[misc]
    process_class = _HoldingForkProcess


class _HoldingSpawnContext(_HoldingContext, mp_context.SpawnContext):  # type: ignore[misc]
    process_class = _HoldingSpawnProcess


class _HoldingForkServerContext(  # type: ignore[misc]
    _HoldingContext, mp_context.ForkServerContext
):
    process_class = _HoldingForkServerProcess


_HOLDING_CONTEXTS: dict[type, type] = {mp_context.ForkContext: _HoldingForkContext,
                                       mp_context.SpawnContext: _HoldingSpawnContext,
                                       mp_context.ForkServerContext: _HoldingForkServerContext}
"""POSIX's three start methods (signals, like DataLoader workers that ignore them, are POSIX's)."""
