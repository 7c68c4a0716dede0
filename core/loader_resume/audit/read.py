"""Reading ``audit=DIR`` logs back (``loader_resume.audit.log`` writes them): each process's
records, per loader, grouped into the job's attempts.

A file is one loader in one process (one rank of one attempt). Ranks of one attempt run side by
side; attempts follow one another. So the files of a loader, taken by start time, fall into
attempts: a file joins the attempt before it while that attempt lacks its rank, has its world size,
ran until shortly before, and took no state the file loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from loader_resume.audit.log import AUDIT_FORMAT
from loader_resume.errors import AuditFormatError
from loader_resume.job.storage import is_remote, local_path, remote_filesystem

__all__ = ["AuditFormatError", "Attempt", "RankLog", "first_load", "read_audit"]

SAME_ATTEMPT_SECONDS = 60.0
"""How long after an attempt's last record another rank's first may come and still be of the same
attempt."""
AT_ONCE_SECONDS = 0.5
"""How long two processes must both have been reading (clocks of two hosts may differ by a little)
to be told to have read at the same time."""
REQUIRED = {"b": ("e",), "pass": ("e",), "state": ("d",), "load": ("d",), "lost": ("records",),
            "c": ("ok",), "save": ("d", "step")}
"""The fields a record of each kind cannot lack (a batch: also ``s`` and ``end``, or a stream's
``w`` and ``b``)."""
_FILE = re.compile(r"^(rank\d+\.[^/]+?)(?:\.(\d{6}))?\.jsonl$")



@dataclass
class RankLog:
    """One file: a loader on one rank in one attempt."""

    path: str
    header: dict[str, Any]
    records: list[dict[str, Any]]
    torn: str | None = None
    """A last line cut short by a kill (ignored), else None."""

    @property
    def rank(self) -> int:
        return int(self.header["rank"])

    @property
    def world(self) -> int:
        return int(self.header["world"])

    @property
    def start(self) -> float:
        return float(self.header["time"])

    @property
    def end(self) -> float:
        times = [float(record["time"]) for record in self.records if "time" in record]
        return max([self.start, *times])

    @property
    def reading_until(self) -> float:
        """When it last handed over a batch, at the latest: the time of the write that carried its
        last batch."""
        until, pending = self.start, False
        for record in self.records:
            pending = pending or record["t"] == "b"
            if pending and "time" in record:
                until, pending = float(record["time"]), False
        return self.end if pending else until

    def took(self, digest: str, before: float) -> bool:
        """Whether it took the state ``digest`` and wrote it before ``before`` (a restart may load
        it then)."""
        taken = False
        for record in self.records:
            if "time" in record and float(record["time"]) > before:
                return False
            if taken and "time" in record:
                return True
            taken = taken or (record["t"] == "state" and record.get("d") == digest)
        return False

    @property
    def ended(self) -> bool:
        """Whether the process wrote its log to the end (at exit): a kill loses the records after
        its last write."""
        return any(record["t"] == "end" for record in self.records)

    @property
    def process(self) -> str:
        """Which process wrote it, in words: ``pid 123 on host``."""
        return f"pid {self.header.get('pid')} on {self.header.get('host')}"


@dataclass
class Attempt:
    """The files of one attempt of the job (one per rank), in rank order."""

    number: int
    logs: list[RankLog] = field(default_factory=list)
    alongside: list[tuple[RankLog, RankLog]] = field(default_factory=list)
    """Pairs (an earlier log, one of this attempt's) of processes that ran at the same time but
    cannot be ranks of one attempt: the same rank twice, or another world size."""

    @property
    def world(self) -> int:
        return self.logs[0].world

    @property
    def start(self) -> float:
        return min(log.start for log in self.logs)

    @property
    def end(self) -> float:
        return max(log.end for log in self.logs)


def read_audit(directory: str | os.PathLike[str]) -> dict[str, list[Attempt]]:
    """Every loader's attempts found under ``directory`` (a local path or an fsspec URL)."""
    where = local_path(os.fspath(directory))
    if is_remote(where):
        filesystem, root = remote_filesystem(where)
        found = filesystem.isdir(root)
    else:
        found = os.path.isdir(where)
    if not found:
        raise AuditFormatError(
            f"{os.fspath(directory)}: no such directory (expected the audit=DIR the job's loaders "
            "were given)"
        )
    texts = _texts(where)
    if not texts:
        raise AuditFormatError(
            f"{os.fspath(directory)}: no audit logs (expected <loader>/rank*.jsonl files written "
            "by a loader built with audit=DIR)"
        )
    by_loader: dict[str, list[RankLog]] = {}
    for path, text in sorted(texts.items()):
        log = _parse(path, text)
        by_loader.setdefault(str(log.header["loader"]), []).append(log)
    # NOTE: a job whose groups come and go while it runs (kind "quorum") has no attempts of fixed
    # ranks: its logs are read as one, and checked step by step (loader_resume.audit.quorum)
    return {name: [Attempt(1, sorted(logs, key=lambda log: log.start))]
            if all(log.header.get("kind") == "quorum" for log in logs) else _attempts(logs)
            for name, logs in sorted(by_loader.items())}


def _texts(directory: str) -> dict[str, str]:
    """Each file's text (object storage: a file's parts joined in order), by its name."""
    parts: dict[str, list[tuple[int, str]]] = {}
    filesystem: Any = None
    if is_remote(directory):
        filesystem, root = remote_filesystem(directory)
        names = [str(name) for name in filesystem.find(root) if str(name).endswith(".jsonl")]
    else:
        names = [
            os.path.join(folder, name)
            for folder, _, files in os.walk(directory)
            for name in files
            if name.endswith(".jsonl")
        ]
    for name in names:
        found = _FILE.match(os.path.basename(name))
        if found is None:
            continue
        key = os.path.join(os.path.dirname(name), found.group(1))
        parts.setdefault(key, []).append((int(found.group(2) or 0), name))
    # NOTE: a file is named as it is (a local log), or by its parts' pattern (object storage)
    return {
        files[0][1] if len(files) == 1 else f"{key}.*.jsonl": "".join(
            _read(filesystem, name) for _, name in sorted(files)
        )
        for key, files in parts.items()
    }


def _read(filesystem: Any, name: str) -> str:
    if filesystem is not None:
        data = bytes(filesystem.cat_file(name))
    else:
        with open(name, "rb") as file:
            data = file.read()
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise AuditFormatError(
            f"{name}: not an audit log (byte {error.start} is not UTF-8 text; the loaders write "
            "JSON lines)"
        ) from None


def _parse(path: str, text: str) -> RankLog:
    lines = text.split("\n")
    torn = None
    if lines and lines[-1] == "":
        lines.pop()
    # NOTE: the last write was cut short by a kill: that line alone is ignored (and named)
    elif lines:
        torn = lines.pop()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines) and torn is None:
                torn = line
                break
            raise AuditFormatError(
                f"{path}: line {number} is damaged ({error}); a record in the middle of a log is "
                "only ever written whole"
            ) from error
        _check_record(path, number, records[-1])
    if not records or records[0].get("t") != "begin":
        raise AuditFormatError(
            f"{path}: no header record (expected the first line to be a 'begin' record)"
        )
    header = records[0]
    if header.get("format") != AUDIT_FORMAT:
        raise AuditFormatError(
            f"{path}: audit format {header.get('format')!r}; expected {AUDIT_FORMAT} (written by "
            "another loader-resume release?)"
        )
    return RankLog(path, header, records[1:], torn)


def _check_record(path: str, number: int, record: Any) -> None:
    if not isinstance(record, dict) or not isinstance(record.get("t"), str):
        raise AuditFormatError(
            f"{path}: line {number} is not a record (expected a JSON object with a 't' field)"
        )
    need: tuple[str, ...] = REQUIRED.get(record["t"], ())
    if record["t"] == "b":
        need += ("w", "b") if "b" in record else ("s", "end")
        if "step" in record:  # NOTE: a quorum job's step: its participant rank and count too
            need += ("r", "w")
    missing = [key for key in need if key not in record]
    if missing:
        raise AuditFormatError(
            f"{path}: line {number}: a {record['t']!r} record without {', '.join(missing)}"
        )


def _attempts(logs: list[RankLog]) -> list[Attempt]:
    attempts: list[Attempt] = []
    running: list[RankLog] = []  # the logs before this one that were still written to when it began
    for log in sorted(logs, key=lambda log: (log.start, log.rank)):
        current = attempts[-1] if attempts else None
        if current is not None and _joins(log, current):
            current.logs.append(log)
        else:
            attempts.append(Attempt(len(attempts) + 1, [log]))
        running = [other for other in running if other.reading_until - AT_ONCE_SECONDS > log.start]
        load = first_load(log)
        attempts[-1].alongside.extend(
            (other, log)
            for other in running
            if (other.rank == log.rank or other.world != log.world)
            and not (load is not None and other.took(load["d"], log.start))
        )
        running.append(log)
    for attempt in attempts:
        attempt.logs.sort(key=lambda log: log.rank)
    return attempts


def _joins(log: RankLog, attempt: Attempt) -> bool:
    """Whether ``log`` is another rank of ``attempt``: one it lacks, of its world size, started
    while it ran (ranks that wait for no collective may start seconds apart:
    ``SAME_ATTEMPT_SECONDS``), resuming where it resumed (a map-style position is the same on every
    rank), or at least not from a state it took."""
    if log.world != attempt.world or log.rank in {other.rank for other in attempt.logs}:
        return False
    if log.start > attempt.end + SAME_ATTEMPT_SECONDS:
        return False
    mine = first_load(log)
    if mine is not None and log.start > attempt.end and not any(map(first_load, attempt.logs)):
        # NOTE: it resumed after every process of an attempt that started afresh was gone: a restart
        return False
    loads = [load for load in map(first_load, attempt.logs) if load is not None]
    if (
        mine is not None
        and "pos" in mine
        and any((load.get("e"), load.get("pos")) == (mine["e"], mine["pos"]) for load in loads)
    ):
        return True
    # NOTE: a state taken right after a load is the loaded one again (a front-end may take it at
    # once)
    taken = {
        record["d"] for other in attempt.logs for record in other.records if record["t"] == "state"
    }
    return mine is None or mine.get("d") not in taken - {load.get("d") for load in loads}


def first_load(log: RankLog) -> dict[str, Any] | None:
    """The state ``log``'s loader loaded before its first batch, if any."""
    for record in log.records:
        if record["t"] == "b":
            return None
        if record["t"] == "load":
            return record
    return None
