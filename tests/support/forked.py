"""Processes of the tests' own child scripts, forked from a process that has already imported the
frameworks.

A test that starts ``python CHILD ...`` pays for the interpreter's imports of torch, Lightning,
Accelerate and transformers (about 5 s of CPU on the CI machine) where the run itself takes a
second; the suite starts hundreds. Here one server process per test process (the *zygote*, started
on first use) imports them once, and every ``python CHILD ...`` a test starts through :func:`popen`
or :func:`run` is a ``fork()`` of it that then runs ``CHILD`` as ``__main__``, exactly as the
interpreter would: its own pid, process group or session, standard streams, working directory,
environment and arguments; it ends through the interpreter's own shutdown (atexit handlers, an
uncaught exception's traceback and exit status 1, a signal's death). A test sees it as it sees a
``subprocess.Popen``: ``pid``, ``poll()``, ``wait()``, ``send_signal()``, ``communicate()``,
``returncode`` (``-N`` for a death by signal N). Whatever a launcher starts from it (a DDP rank,
torchrun's workers, DataLoader workers) starts as it would anyway.

What differs from ``python CHILD`` is what no test here is about: the modules are imported before
the script starts, and every forked process shares the zygote's string hash seed. A command that is
not ``[sys.executable, script.py, ...]`` or whose environment changes what the interpreter reads at
its start (a ``PYTHON*`` variable other than ``PYTHONFAULTHANDLER``) runs as a plain subprocess.
``LOADER_RESUME_TEST_FORK=0`` turns the zygote off.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["Forked", "popen", "run"]

PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "lightning",
    "lightning.pytorch",
    "accelerate",
    "transformers",
    "transformers.trainer",
)
"""What the zygote imports: the frameworks the child scripts import (a fresh interpreter's cost of
each run)."""
STARTUP = frozenset({"PYTHONFAULTHANDLER"})
"""The interpreter's start-up variables a forked process applies itself
(``faulthandler.enable()``)."""


def _startup_variables(env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: value for key, value in env.items() if key.startswith("PYTHON") and key not in STARTUP
    }


class _Zygote:
    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="zygote-")
        self.path = os.path.join(self.directory, "socket")
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.path, *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            env=self.env,
        )
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the zygote did not start: {ready!r}, exit {self.process.wait()}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))
        os.rmdir(self.directory)


_ZYGOTE: _Zygote | None = None
_LOCK = threading.Lock()


def _zygote() -> _Zygote:
    global _ZYGOTE
    with _LOCK:
        if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
            _ZYGOTE = _Zygote()
            atexit.register(_ZYGOTE.close)
        return _ZYGOTE


def forkable(args: Sequence[str | os.PathLike[str]], env: Mapping[str, str] | None) -> bool:
    """Whether ``args`` runs one of the tests' scripts in this interpreter, with the zygote's
    start-up variables."""
    if os.environ.get("LOADER_RESUME_TEST_FORK", "1") == "0":
        return False
    if len(args) < 2 or str(args[0]) != sys.executable or not str(args[1]).endswith(".py"):
        return False
    return _startup_variables(os.environ if env is None else env) == _startup_variables(os.environ)


def _fd(stream: Any, default: int, mode: str) -> tuple[int, int | None]:
    """A file descriptor for the child's stream and, for ``PIPE``, the test's end of it."""
    if stream is None:
        return default, None
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if stream == subprocess.PIPE:
        read, write = os.pipe()
        return (read, write) if mode == "r" else (write, read)
    if stream == subprocess.STDOUT:
        return -1, None
    return (stream if isinstance(stream, int) else stream.fileno()), None


class Forked:
    """A forked run of ``python SCRIPT ARGS``, used as a ``subprocess.Popen``."""

    def __init__(
        self,
        args: Sequence[str | os.PathLike[str]],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        text: bool = False,
        start_new_session: bool = False,
    ) -> None:
        self.args = [str(arg) for arg in args]
        self.returncode: int | None = None
        ours: list[int] = []  # the child's ends, closed here once the zygote has them
        fds: list[int] = []
        pipes: list[int | None] = []
        for stream, default, mode in ((stdin, 0, "r"), (stdout, 1, "w"), (stderr, 2, "w")):
            fd, pipe = _fd(stream, default, mode)
            if fd == -1:  # stderr=STDOUT
                fd = fds[1]
            if pipe is not None or stream == subprocess.DEVNULL:
                ours.append(fd)
            fds.append(fd)
            pipes.append(pipe)
        self.stdin: IO[Any] | None = (
            None if pipes[0] is None else os.fdopen(pipes[0], "w" if text else "wb")
        )
        self.stdout: IO[Any] | None = (
            None if pipes[1] is None else os.fdopen(pipes[1], "r" if text else "rb")
        )
        self.stderr: IO[Any] | None = (
            None if pipes[2] is None else os.fdopen(pipes[2], "r" if text else "rb")
        )
        request = {"argv": self.args[1:], "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), "session": start_new_session}
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.connect(_zygote().path)
        payload = json.dumps(request).encode()
        socket.send_fds(self._socket, [len(payload).to_bytes(8, "big")], fds)
        self._socket.sendall(payload)
        for fd in ours:
            os.close(fd)
        self._received = b""
        pid = self._line(None)
        assert pid is not None
        self.pid = pid

    def _line(self, timeout: float | None) -> int | None:
        """The zygote's next number (the pid, then the exit status), or None if none came within
        ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._socket], [], [], left)
            if not ready:
                return None
            chunk = self._socket.recv(64)
            if not chunk:
                raise RuntimeError(f"the zygote ended before reporting on {self.args}")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return int(line)

    def _read_exit(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            code = self._line(timeout)
            if code is None:
                return None
            self.returncode = code
            # the zygote reaps the process now (until then its pid stays taken)
            self._socket.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read_exit(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return code

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        results: dict[str, Any] = {}

        def drain(name: str, stream: IO[Any]) -> None:
            results[name] = stream.read()
            stream.close()

        threads = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None
        ]
        for thread in threads:
            thread.start()
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        code = self._read_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        for thread in threads:
            thread.join()
        return results.get("out"), results.get("err")

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def popen(args: Sequence[str | os.PathLike[str]], **kwargs: Any) -> Forked | subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)``, forked from the zygote where :func:`forkable`."""
    if forkable(args, kwargs.get("env")) and set(kwargs) <= {
        "stdin",
        "stdout",
        "stderr",
        "env",
        "cwd",
        "text",
        "start_new_session",
    }:
        return Forked(args, **kwargs)
    return subprocess.Popen(args, **kwargs)


def run(
    args: Sequence[str | os.PathLike[str]],
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    input: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run``, forked from the zygote where :func:`forkable`."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    process = popen(args, **kwargs)
    try:
        out, err = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    code = process.wait()
    if check and code:
        raise subprocess.CalledProcessError(code, list(map(str, args)), out, err)
    return subprocess.CompletedProcess(list(map(str, args)), code, out, err)


# The zygote's side: ``python forked.py SOCKET MODULE...``.


def _serve(path: str, preload: Sequence[str]) -> tuple[dict[str, Any], list[int]]:
    """Import ``preload``, then fork a process for each request on ``path``; returns only in a
    forked process."""
    import gc
    import importlib

    for module in preload:
        # NOTE: a venv may lack a framework (or break it): a child that imports it meets the same
        # error itself
        try:
            importlib.import_module(module)
        except Exception:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    gc.collect()
    # the imported objects stay shared with the forked processes (no copy-on-write by the collector)
    gc.freeze()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    # pid -> the test's connection, until the process has exited
    running: dict[int, socket.socket] = {}
    # reported, not yet reaped: reaped when the test closes its connection
    exited: dict[socket.socket, int] = {}
    while True:
        waiting = [sys.stdin, listener, *exited]
        ready, _, _ = select.select(waiting, [], [], 0.02)
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            for pid in [*running, *exited.values()]:
                os.kill(pid, signal.SIGKILL)
            os._exit(0)  # the test process has gone
        for connection in [each for each in ready if each in exited]:
            os.waitpid(exited.pop(connection), 0)
            connection.close()
        if listener in ready:
            connection, _ = listener.accept()
            header, fds, _, _ = socket.recv_fds(connection, 8, 3)
            size = int.from_bytes(header, "big")
            payload = b""
            while len(payload) < size:
                payload += connection.recv(size - len(payload))
            request = json.loads(payload)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [*running.values(), *exited, connection]:
                    other.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            running[pid] = connection
        for pid, connection in list(running.items()):
            status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if status is None:
                continue
            code = status.si_status if status.si_code == os.CLD_EXITED else -status.si_status
            del running[pid]
            try:
                connection.sendall(f"{code}\n".encode())
                exited[connection] = pid
            except OSError:  # the test no longer waits for it
                os.waitpid(pid, 0)
                connection.close()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Turn the forked process into ``python SCRIPT ARGS`` as the interpreter would start it."""
    if request["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import numpy
    import torch

    numpy.random.seed()  # a fresh interpreter's NumPy draws its seed from the OS
    torch.seed()  # as a fresh interpreter's torch, a seed from the OS


if __name__ == "__main__":
    _request, _fds = _serve(sys.argv[1], sys.argv[2:])
    _become(_request, _fds)
    del _request, _fds
    import runpy

    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own ending: an exit status, or the death by SIGINT
    # printed as the interpreter prints it: from the script's frame on, then exit 1
    except BaseException as error:
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename != sys.argv[0]:
            trace = trace.tb_next
        # what a replaced excepthook reads too
        error = error.with_traceback(trace or error.__traceback__)
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)
