"""Atomic, verified checkpoint directories (used by the Accelerate hook; usable by any training
loop).

A checkpoint directory is written under a temporary name of its writer (``.NAME.tmp-TOKEN``), sealed
with a manifest (every file's size and SHA-256) and renamed into place: a kill at any byte leaves
either the previous checkpoints untouched plus a ``.tmp`` leftover (ignored, with a warning), or a
complete checkpoint. Loading verifies the manifest first, so a truncated file, flipped bytes or an
edited state are refused with an error naming the file, never loaded as wrong data.

What goes into a checkpoint besides the loader state is here too: ``global_rng_state`` and
``set_global_rng_state`` (``loader_resume.job.generators``: the process's generators, as plain
tensors).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import torch.distributed as dist

from loader_resume.errors import CheckpointError
from loader_resume.job.generators import global_rng_state, set_global_rng_state

__all__ = [
    "CHECKPOINT_FORMAT",
    "MANIFEST",
    "CheckpointError",
    "complete_checkpoints",
    "describe_failure",
    "global_rng_state",
    "is_temporary",
    "prune",
    "seal",
    "set_global_rng_state",
    "storage_failure",
    "temporary_name",
    "verify",
    "writer_token",
    "write_manifest",
    "write_sealed",
]

logger = logging.getLogger(__name__)

MANIFEST = "loader_resume_manifest.json"
"""The file that seals a complete checkpoint directory."""
_MANIFEST_FORMAT = 1
CHECKPOINT_FORMAT: Final = 1
"""The format of what loader-resume adds to a training checkpoint (the Lightning entry, the
Accelerate file)."""
_CHUNK = 1 << 20



def temporary_name(final: Path, token: str = "") -> Path:
    """Where ``final`` is written before it is sealed and renamed: ``.NAME.tmp-TOKEN``, a name of
    this writer and attempt alone (``token``; empty: ``.NAME.tmp``)."""
    return final.with_name(f".{final.name}.tmp" + (f"-{token}" if token else ""))


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is named as ``temporary_name`` names (a leftover, once its writer is
    gone)."""
    return re.fullmatch(r"\.(step_\d+|.+\.ckpt)\.tmp(-\d+-[0-9a-f]{8})?", path.name) is not None


def writer_token(broadcast: Callable[[str], str] | None = None) -> str:
    """A name for one write, the same on every process of a job (a collective): the main process's,
    sent by ``broadcast`` (a framework's, as Lightning's ``strategy.broadcast``), else by
    ``torch.distributed`` if in use."""
    token = [f"{os.getpid()}-{uuid.uuid4().hex[:8]}"]
    if (
        broadcast is None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        dist.broadcast_object_list(token, src=0)
    return token[0] if broadcast is None else broadcast(token[0])


def write_manifest(directory: Path, *, checksums: bool = True) -> None:
    """Write ``directory``'s manifest (its files' sizes, and SHA-256 sums if ``checksums``),
    atomically."""
    files = {name: _describe(directory / name, checksums) for name in _files(directory)}
    manifest = directory / MANIFEST
    _write_atomically(
        manifest, json.dumps({"format": _MANIFEST_FORMAT, "files": files}, indent=1, sort_keys=True)
    )


def seal(directory: Path, final: Path, *, checksums: bool = True) -> None:
    """Write ``directory``'s manifest, then rename it to ``final`` (replacing an older
    ``final``)."""
    write_manifest(directory, checksums=checksums)
    if final.exists():
        shutil.rmtree(final)
    os.replace(directory, final)
    try:
        _fsync_directory(final.parent)
    except OSError as error:  # NOTE: the checkpoint is in place; only its durability is unconfirmed
        logger.warning("%s sealed; syncing its directory failed: %s", final, error)


def verify(directory: Path) -> None:
    """Raise [`CheckpointError`][loader_resume.job.checkpoint.CheckpointError] unless ``directory``
    matches its manifest byte for byte."""
    manifest = directory / MANIFEST
    try:
        described = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory}: no {MANIFEST}; expected a checkpoint sealed by loader-resume "
            "(killed before it was complete?)"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{manifest}: unreadable ({error}); expected the JSON manifest"
        ) from None
    if not isinstance(described, dict) or described.get("format") != _MANIFEST_FORMAT:
        found = described.get("format") if isinstance(described, dict) else described
        raise CheckpointError(f"{manifest}: format {found!r}; expected {_MANIFEST_FORMAT}")
    for name, expected in described["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing; the manifest lists it ({expected['size']} bytes)"
            )
        found = _describe(path, "sha256" in expected)
        if found != expected:
            raise CheckpointError(
                f"{path}: {found} does not match the manifest's {expected} "
                "(truncated, corrupted or edited after it was written); refusing to load it"
            )


def complete_checkpoints(root: Path, pattern: str = r"step_(\d+)") -> list[Path]:
    """Sealed checkpoints under ``root`` named ``pattern`` (one integer group), oldest first.

    Leftovers of interrupted saves (``.NAME.tmp``) and unsealed directories are skipped with a
    warning.
    """
    found: list[tuple[int, Path]] = []
    if not root.is_dir():
        return []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        if is_temporary(path):
            logger.warning(
                "skipping %s: an incomplete checkpoint (a save interrupted, or in progress)", path
            )
            continue
        match = re.fullmatch(pattern, path.name)
        if match is None:
            continue
        if not (path / MANIFEST).is_file():
            logger.warning("skipping %s: it has no %s, so it may be incomplete", path, MANIFEST)
            continue
        found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` sealed checkpoints under ``root``."""
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def write_sealed(
    final: Path,
    write_into: Callable[[Path], None],
    *,
    main: bool,
    agree: Callable[[bool], bool],
    step: int,
    checksums: bool = True,
    keep: int = 2,
    token: str | None = None,
    copy: Callable[[Path], object] | None = None,
) -> bool:
    """Write a checkpoint directory atomically, every process of a job together:
    ``write_into(temporary)`` on every process (the main one creates the directory first, under a
    name of this write alone: ``temporary_name``, ``writer_token``), then the main process seals it
    and renames it to ``final`` (``seal``), and deletes checkpoints beyond the newest ``keep``
    (``prune``).

    ``agree(flag)`` is whether ``flag`` holds on any process (a collective; on one process,
    ``flag``). A failed write on any process — any exception out of ``write_into`` or the seal: a
    full disk (``OSError`` or the ``RuntimeError`` torch's writer turns it into), a lost mount, a
    read-only file system — is agreed by all: the partial directory is removed, the error is logged
    naming the path and the cause, the previous checkpoints stay and ``False`` is returned.
    ``copy(final)``, if given, runs on the main process once the checkpoint is sealed
    (``RemoteCopy.upload``): its failure counts as the write's, though the sealed local directory
    stays. What the caller does then (train on, or exit) is its own. Another error (a bug) is agreed
    as well, then raised on every process (its own there, a ``RuntimeError`` naming it on the
    others); a failed collective is raised at once (no process is left to agree with). ``token``:
    the temporary name's, if the caller agreed on one. NOTE: every process takes the same branch at
    each agreement, so the collectives stay paired.
    """
    temporary = temporary_name(final, writer_token() if token is None else token)
    failure: Exception | None = None
    sealed = False
    try:
        if main:
            temporary.mkdir(parents=True)
    except OSError as error:
        failure = error
    if not agree(failure is not None):
        try:
            write_into(temporary)
        except Exception as error:  # NOTE: the caller decides whether training goes on
            failure = _unless_collective(error)
        if not agree(failure is not None) and main:
            try:
                seal(temporary, final, checksums=checksums)
                sealed = True
                if copy is not None:
                    copy(final)
            except Exception as error:
                failure = _unless_collective(error)
        if not agree(failure is not None):
            if main:
                try:
                    prune(final.parent, keep)
                except OSError as error:
                    logger.warning(
                        "checkpoint at step %d written; deleting older ones failed: %s", step, error
                    )
            return True
    if main:
        shutil.rmtree(temporary, ignore_errors=True)
    bug = failure is not None and not _of_the_storage(failure)
    # NOTE: every process stops: a bug on one is raised as itself, the others name it
    if agree(bug):
        if failure is not None and bug:
            raise failure
        raise RuntimeError(
            f"checkpoint at step {step} NOT written to {final}: another process failed with an "
            "error that is not the storage's (its log names it)"
        )
    cause = (
        describe_failure(failure, final.parent)
        if failure is not None
        else "failed on another process"
    )
    if sealed:
        logger.error("checkpoint at step %d written to %s but NOT copied: %s", step, final, cause)
        return False
    kept = complete_checkpoints(final.parent)
    logger.error(
        "checkpoint at step %d NOT written to %s: %s; the newest complete checkpoint is still %s",
        step,
        final,
        cause,
        kept[-1] if kept else "none",
    )
    return False


def storage_failure(error: Exception) -> Exception:
    """``error`` if a write can fail with it for a reason of the storage — ``OSError``, the
    ``RuntimeError`` torch's writer makes of one, safetensors' ``SafetensorError`` — else raised
    again (a bug, a failed collective)."""
    if _of_the_storage(error):
        return error
    raise error


def _of_the_storage(error: Exception) -> bool:
    distributed = getattr(dist, "DistError", ())
    return isinstance(error, OSError) or type(error).__name__ == "SafetensorError" or (
        isinstance(error, RuntimeError) and not isinstance(error, distributed))


def _unless_collective(error: Exception) -> Exception:
    if isinstance(error, getattr(dist, "DistError", ())):
        raise error
    return error


def describe_failure(error: BaseException, directory: Path) -> str:
    """``error`` as a log names it, with the cause a write into ``directory`` most likely had: a
    full disk (its free bytes), or a file system that cannot be written."""
    text = f"{type(error).__name__}: {error}"
    number = getattr(error, "errno", None)
    try:
        free: int | None = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if (
        number in (errno.ENOSPC, errno.EDQUOT)
        or (free is not None and free < _CHUNK)
        or "No space left" in text
    ):
        return (
            f"{text} (no space left on device, or over quota: {free} bytes free under {directory})"
        )
    if number in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{text} ({directory} cannot be written)"
    return text


def _files(directory: Path) -> Iterator[str]:
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            yield path.relative_to(directory).as_posix()


def _describe(path: Path, checksum: bool) -> dict[str, int | str]:
    described: dict[str, int | str] = {"size": path.stat().st_size}
    if checksum:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
        described["sha256"] = digest.hexdigest()
    return described


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
