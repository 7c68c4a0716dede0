"""The delivery log of ``ResumableDataLoader(audit=DIR)``: what each rank handed its caller, in
every attempt.

Each loader appends compact JSON lines to its own file per process (one *attempt* of the job on one
rank), under ``DIR/<loader>/``: a header, each pass's start, each delivered batch (epoch, global
position, the sample ids — a digest instead of the ids above ``MAX_IDS`` — and the batch's random
key), each state taken and each state loaded (a digest of the whole state, so a later attempt's load
is matched to the state it came from). Nothing is ever rewritten: a restart opens a new file.
``loader-resume audit DIR`` (``loader_resume.tools.audit``) reads them all back and checks that
every sample was seen exactly once across the restarts.

Cost: one short line per batch into a buffer; the buffer is written (appended locally, a new part
object on object storage) every ``FLUSH_RECORDS`` records or ``FLUSH_SECONDS``, at every state taken
or loaded (so every batch a checkpoint covers is on disk before the checkpoint is), and when the
process exits. A kill loses at most the batches after the last of those, which a resume delivers
again anyway; a line torn by a kill is named and ignored by the reader.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loader_resume.job.storage import is_remote, join, local_path, remote_filesystem
from loader_resume.state import ENDING

__all__ = [
    "AUDIT_FORMAT",
    "AUDIT_VARIABLE",
    "AuditLog",
    "audit_from_environment",
    "audit_log",
    "quorum_log",
    "record_state",
    "state_digest",
    "warn_unaudited",
]

logger = logging.getLogger(__name__)

AUDIT_FORMAT = 1
"""The version of the log's records (the header's ``"format"``)."""
AUDIT_VARIABLE = "LOADER_RESUME_AUDIT"
"""The front-ends' default ``audit=`` (a directory or fsspec URL), read on every rank."""
MAX_IDS = 1024
"""Batches with more samples record a digest of their ids, not the ids."""
FLUSH_RECORDS = 512
FLUSH_SECONDS = 5.0
UNWRITTEN_LIMIT = 16 << 20
"""Characters of records kept after failed writes, beyond which they are dropped (and a ``lost``
record says so)."""

# flushed at exit (held: a loader collected early still has its records written)
_OPEN: list[AuditLog] = []
_LOGS_LOCK = threading.Lock()
# (directory, loader name): one log a process (a loader rebuilt shares it)
_LOGS: dict[tuple[str, str], AuditLog] = {}
_SAID_UNAUDITED = False  # the warning of warn_unaudited, once a process


def audit_from_environment(audit: str | os.PathLike[str] | None) -> str | None:
    """A front-end's ``audit=``: the value given, else ``$LOADER_RESUME_AUDIT`` (unset or empty: no
    audit)."""
    if audit is not None:
        return os.fspath(audit)
    return os.environ.get(AUDIT_VARIABLE) or None


def warn_unaudited(setup: Any) -> None:
    """Once a process: ``$LOADER_RESUME_AUDIT`` is set, but a loader built without ``audit=`` begins
    a pass (a loader your own code builds reads only ``audit=``; the front-ends give theirs the
    variable's value)."""
    global _SAID_UNAUDITED
    if _SAID_UNAUDITED or not os.environ.get(AUDIT_VARIABLE):
        return
    _SAID_UNAUDITED = True
    logger.warning(
        "%s=%s is set, but a ResumableDataLoader of %s was built without audit=: its batches are "
        "not "
        "recorded. A loader your own code builds reads only audit= (audit=os.environ.get(%r)); the "
        "Lightning, Fabric, Accelerate and transformers front-ends read the variable themselves",
        AUDIT_VARIABLE,
        os.environ[AUDIT_VARIABLE],
        type(setup.dataset).__name__,
        AUDIT_VARIABLE,
    )


def state_digest(state: Mapping[str, Any]) -> str:
    """A short digest of a loader state's content (what a later attempt's load is matched by); its
    ``"ending"`` mark, which front-ends add after the state is taken, is left out."""
    plain = {key: value for key, value in state.items() if key != ENDING}
    try:
        text = json.dumps(plain, sort_keys=True, default=repr, separators=(",", ":"))
    # NOTE: keys json cannot sort (a user's state with tuple or mixed keys)
    except (TypeError, ValueError):
        text = repr(sorted(plain.items(), key=repr))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def ids_field(ids: Sequence[Any]) -> dict[str, Any]:
    """A batch's sample ids as recorded: the ids themselves up to ``MAX_IDS``, else their count and
    digest."""
    plain = (
        [_plain(value) for value in ids] if any(type(value) is not int for value in ids) else ids
    )
    if len(plain) <= MAX_IDS:
        return {"ids": plain}
    text = json.dumps(plain, separators=(",", ":"), default=repr)
    return {
        "count": len(plain),
        "digest": hashlib.blake2b(text.encode(), digest_size=8).hexdigest(),
    }


def _plain(value: Any) -> Any:
    if type(value) in (int, str, float, bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    item = getattr(value, "item", None)  # numpy and torch scalars
    return item() if callable(item) else repr(value)


class AuditLog:
    """One loader's log in this process; opened at its first record (the rank is known by then)."""

    def __init__(self, directory: str | os.PathLike[str], header: dict[str, Any]) -> None:
        self.directory = local_path(os.fspath(directory))
        self._header = header
        self._buffer: list[str | tuple[Any, ...]] = []
        self._last_flush = time.monotonic()
        self._path: str | None = None
        self._part = 0
        self._unwritten = ""  # records a write failed to write, written first at the next flush
        self._lock = threading.Lock()
        self.rank, self.world = 0, 1

    # --- records -------------------------------------------------------------------------------
    def open(self, rank: int, world: int) -> None:
        """Name this attempt's file (rank, start time, host, pid) and write the header; once."""
        if self._path is not None:
            return
        self.rank, self.world = rank, world
        name = str(self._header["loader"])
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{now % 1:.6f}"[1:]
        host = socket.gethostname().replace("/", "_")
        folder = join(self.directory, name)
        self._path = join(folder, f"rank{rank:05d}.{stamp}Z.{host}.{os.getpid()}")
        if not is_remote(self.directory):
            try:
                os.makedirs(local_path(folder), exist_ok=True)
            # NOTE: said at the first write (flush), never raised into training
            except OSError as error:
                logger.debug("audit directory %s: %s", folder, error)
        header = dict(self._header, loader=name, format=AUDIT_FORMAT, rank=rank, world=world,
                      time=now, host=host, pid=os.getpid())
        self._buffer.append(
            json.dumps({"t": "begin", **header}, default=repr, separators=(",", ":"))
        )
        _OPEN.append(self)
        # NOTE: every process that opened a log has its file, even one killed before the next write
        self.flush()

    def record(self, fields: dict[str, Any], *, flush: bool = False) -> None:
        """Append one record; written now if ``flush`` or the buffer is due."""
        self._buffer.append(json.dumps(fields, default=repr, separators=(",", ":")))
        if (
            flush
            or len(self._buffer) >= FLUSH_RECORDS
            or time.monotonic() - self._last_flush > FLUSH_SECONDS
        ):
            self.flush(sync=flush)

    def delivered(self, fields: tuple[Any, ...]) -> None:
        """Append a delivered batch's record, kept as a tuple until it is written (``_line``): ~0.3
        µs a batch."""
        self._buffer.append(fields)
        if (
            len(self._buffer) >= FLUSH_RECORDS
            or time.monotonic() - self._last_flush > FLUSH_SECONDS
        ):
            self.flush()

    def flush(self, *, sync: bool = False) -> None:
        """Write what is buffered (with a time mark); ``sync``: to stable storage before returning.
        Records that could not be written (a full disk, a network error) are kept and written first
        at the next flush."""
        with self._lock:
            if not self._buffer or self._path is None:
                return
            self._buffer.append(json.dumps({"t": "at", "time": time.time()}))
            text = self._unwritten + "\n".join(map(_line, self._buffer)) + "\n"
            self._buffer = []
            self._last_flush = time.monotonic()
            try:
                self._write(text.encode(), sync)
            # NOTE: the audit never stops the training it watches: said, not raised
            except Exception as error:
                # NOTE: memory stays bounded; what is dropped is said in the log
                if len(text) > UNWRITTEN_LIMIT:
                    lines = text.splitlines(keepends=True)
                    # a log starts with its header
                    head = lines[0] if lines[0].startswith('{"t":"begin"') else ""
                    dropped = len(lines) - bool(head)
                    text = head + json.dumps({"t": "lost", "records": dropped}) + "\n"
                    logger.error(
                        "audit log %s: %d records dropped after failed writes (%s); loader-resume "
                        "audit will name the loss",
                        self._path,
                        dropped,
                        error,
                    )
                elif not self._unwritten:
                    logger.error(
                        "audit log %s: could not write %d records (%s); kept in memory and written "
                        "at the next flush that can",
                        self._path,
                        text.count("\n"),
                        error,
                    )
                self._unwritten = text
            else:
                if self._unwritten:
                    logger.warning(
                        "audit log %s: the records kept after a failed write are written now",
                        self._path,
                    )
                self._unwritten = ""

    def _write(self, data: bytes, sync: bool) -> None:
        assert self._path is not None
        # NOTE: no append on object storage: each flush is one part object
        if is_remote(self._path):
            filesystem, path = remote_filesystem(f"{self._path}.{self._part:06d}.jsonl")
            with filesystem.open(path, "wb") as part:
                part.write(data)
            self._part += 1
            return
        with open(f"{self._path}.jsonl", "ab", buffering=0) as file:
            size = file.tell()
            try:
                view = memoryview(data)
                while view:  # NOTE: an unbuffered write may write part of it
                    view = view[file.write(view):]
                if sync:
                    os.fsync(file.fileno())
            except OSError:
                # NOTE: a full disk leaves no part of a line (a torn line means a kill)
                file.truncate(size)
                raise

    def close(self) -> None:
        """Write the end record and what is left."""
        if self._path is not None:
            self._buffer.append(json.dumps({"t": "end", "time": time.time()}))
            self.flush(sync=True)
            if self._unwritten:
                logger.error(
                    "audit log %s: %d records were never written; loader-resume audit sees the log "
                    "end where the writes stopped, as if the job had stopped there",
                    self._path,
                    self._unwritten.count("\n"),
                )


def audit_log(
    directory: str | os.PathLike[str],
    setup: Any,
    length: int | None,
    order: str,
    shuffle: bool,
    num_workers: int,
) -> Any:
    """``setup`` (a loader's ``loader_resume.position.Setup``) with the ``AuditLog`` of
    ``audit=directory``, named by what identifies its data (``order``: its state's ``source``)."""
    if not setup.in_order and num_workers > 0:
        raise ValueError(
            "audit= with in_order=False: the audit records batches in the order of their global "
            "positions; build the loader with in_order=True to audit it"
        )
    if not isinstance(directory, str | os.PathLike) or not os.fspath(directory):
        raise ValueError(
            f"audit={directory!r}: expected a directory or an fsspec URL (s3://bucket/run/audit)"
        )
    kind = "iterable" if order == "iterable" else "map"
    name = _loader_name(setup.dataset, "stream" if kind == "iterable" else length, setup.seed,
                        order, shuffle)
    header = {
        "loader": name,
        "kind": kind,
        "n": length,
        "order": order,
        "seed": setup.seed,
        "keying": setup.keying,
        "batch_size": setup.batch_size,
        "drop_last": setup.shard().drop_last,
    }
    # NOTE: loaders of one identity in one process (a framework's rebuilt copies, a loader made anew
    # each epoch) share one log: they are the same data in the same order
    with _LOGS_LOCK:
        log = _LOGS.setdefault(
            (local_path(os.fspath(directory)), name), AuditLog(directory, header)
        )
    return dataclasses.replace(setup, audit=log)


def _loader_name(dataset: Any, size: int | str | None, seed: int, order: str,
                 shuffle: bool) -> str:
    """A loader's folder in the audit directory: what identifies its data and its order."""
    arranged = (
        "shuffled" if shuffle else "in-order" if order == "permutation" else order.partition(":")[0]
    )
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{type(dataset).__name__}-{size}-seed{seed}-{arranged}")


def quorum_log(directory: str | os.PathLike[str], dataset: Any, state: Mapping[str, Any],
               replica: str) -> AuditLog:
    """The log of one process of a job whose groups come and go while it runs (``kind:
    "quorum"``, TorchFT's replica groups), opened now: ``state`` is its loader's state (what
    identifies the data and the order); the caller records each step (``loader_resume.audit.quorum``
    reads them). The loaders it shards are recorded through it: the warning of loaders built
    without ``audit=`` is not given in this process."""
    global _SAID_UNAUDITED
    _SAID_UNAUDITED = True
    n = state["dataset_len"]
    header = {"loader": _loader_name(dataset, n, state["seed"], state["source"], state["shuffle"]),
              "kind": "quorum", "n": n, "order": state["source"], "seed": state["seed"],
              "keying": state["keying"], "batch_size": state["batch_size"],
              "drop_last": state["drop_last"], "replica": replica}
    log = AuditLog(directory, header)
    log.open(0, 1)
    return log


def record_state(setup: Any, kind: str, state: Mapping[str, Any], *, ended: bool = False) -> None:
    """Record a state taken (``"state"``) or loaded (``"load"``), if ``setup`` keeps an audit: where
    it stands, its digest, and whether the loop said it left the pass (``ended``:
    ``pass_ended=True``); written now."""
    if setup.audit is None:
        return
    audit = setup.audit_log()
    record: dict[str, Any] = {"t": kind, "e": state.get("epoch"), "d": state_digest(state)}
    if state.get("kind") == "map":
        record["pos"] = state.get("position")
    stream = state.get("stream")
    if isinstance(stream, Mapping):
        record["wb"] = [worker.get("batches") for worker in stream.get("workers", [])]
        record["wi"] = [worker.get("items") for worker in stream.get("workers", [])]
    if "resharded" in state:
        record["resharded"] = state["resharded"]
    if ended:
        record["x"] = 1
    audit.record(record, flush=True)


def map_pass(setup: Any, epoch: int, start: int, sampler: Any, length: int | None) -> bool:
    """Record a map-style pass's start and its epoch's units (``length``, or the user ``sampler``'s
    length: None if it has none); whether the loader keeps an audit."""
    if setup.audit is None:
        warn_unaudited(setup)
        return False
    units = length if sampler is None else (len(sampler) if hasattr(sampler, "__len__") else None)
    setup.audit_log().record({"t": "pass", "e": epoch, "s": start, "units": units})
    return True


def map_step(setup: Any, pass_: Any, start: int, end: int, last: bool) -> None:
    """Record a delivered map-style step of ``pass_``: its epoch, global start and end (this rank's
    units follow from them and the world size), and the ids of a user sampler's units (our
    permutation's are a function of the positions, recomputed by the audit). An epoch's ``last``
    step is written at once (a process may end without running its exit handlers: Ray's workers
    do)."""
    ids = pass_.audited.popleft() if pass_.audited is not None else None
    setup.audit.delivered(("b", pass_.epoch, start, end, ids, last))
    if last:
        setup.audit.flush()


def _line(item: str | tuple[Any, ...]) -> str:
    if isinstance(item, str):
        return item
    if item[0] == "w":
        # NOTE: %-formatting, twice as fast as format here
        return '{"t":"b","e":%d,"w":%d,"b":%d,"i":%d}' % item[1:]  # noqa: UP031
    _, epoch, start, end, ids, last = item
    line = '{"t":"b","e":%d,"s":%d,"end":%d' % (epoch, start, end)  # noqa: UP031
    if last:
        line += ',"l":1'
    if ids is None:
        return line + "}"
    return line + "," + json.dumps(ids_field(ids), separators=(",", ":"), default=repr)[1:]


@atexit.register
def _flush_all() -> None:
    for log in list(_OPEN):
        log.close()
