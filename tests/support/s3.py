"""A real S3 API server on loopback for the tests: moto's, started as its own process (``python -m
moto.server``), and the environment that points boto3/s3fs (and every child process) at it."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .launch import free_port


@contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """Start the server; yield the variables that send S3 clients to it (set in ``os.environ``
    meanwhile, so this process's clients and its children use it); stop it."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    before = {name: os.environ.get(name) for name in env}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto's S3 server did not start (exit {server.poll()})"
                    ) from None
                time.sleep(0.1)
        os.environ.update(env)
        # NOTE: fsspec keeps one S3FileSystem per process; one made earlier sends to another server
        _forget_clients()
        yield env
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.terminate()
        server.wait(timeout=30)
        _forget_clients()


def _forget_clients() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def bucket(name: str) -> None:
    """Create an empty bucket on the server the environment points at."""
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)


def objects(url: str) -> list[str]:
    """Every object under ``url`` (``s3://bucket/prefix``), as URLs, fresh from the server."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    return sorted(f"s3://{path}" for path in fs.find(url.removeprefix("s3://")))


ONE_ATTEMPT = {"AWS_MAX_ATTEMPTS": "1"}
"""For a process whose link is cut: botocore's own retries off (s3fs still tries each call 5 times,
backing off), so a cut link fails a save in seconds instead of minutes; what fails, and how, is the
same."""


class Cuttable:
    """A TCP relay on loopback in front of the server (``endpoint``), whose link can be cut: while
    cut, every connection is refused or reset, as a network that went away; restored, it relays
    again."""

    def __init__(self, endpoint: str) -> None:
        import socket

        self._socket, self._threading = socket, threading
        host, port = endpoint.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: list[Any] = []
        self._listener: Any = None
        self.stall: re.Pattern[bytes] | None = None
        """While set: a request whose first line matches it is never passed on (the link stops
        answering it)."""
        self.stalled = threading.Event()
        """Set once a request was held so."""
        self._released = threading.Event()
        self.restore()

    def restore(self) -> None:
        listener = self._socket.create_server(("127.0.0.1", self.port), reuse_port=True)
        self._listener = listener
        self._threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        with contextlib.suppress(OSError):
            # NOTE: wakes the accept() blocked in the relay's thread
            listener.shutdown(self._socket.SHUT_RDWR)
        listener.close()
        for connection in self._open:
            with contextlib.suppress(OSError):
                connection.close()
        self._open.clear()

    def _accept(self, listener: Any) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = self._socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._open += [client, upstream]
            for a, b, link in ((client, upstream, self), (upstream, client, None)):
                self._threading.Thread(target=_relay, args=(a, b, link), daemon=True).start()

    def close(self) -> None:
        """Cut the link and let every held request's thread end."""
        self._released.set()
        self.cut()


def _relay(source: Any, target: Any, link: Cuttable | None) -> None:
    try:
        while data := source.recv(1 << 16):
            if (
                link is not None
                and link.stall is not None
                and link.stall.search(data.split(b"\r\n", 1)[0])
            ):
                link.stalled.set()
                link._released.wait()
                return
            target.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            target.shutdown(2)
