"""Atomic, verified checkpoint directories (used by the Accelerate hook; usable by any training loop).

A checkpoint directory is written under a temporary name (``.NAME.tmp``), sealed with a manifest
(every file's size and SHA-256) and renamed into place: a kill at any byte leaves either the previous
checkpoints untouched plus a ``.tmp`` leftover (ignored, with a warning), or a complete checkpoint.
Loading verifies the manifest first, so a truncated file, flipped bytes or an edited state are refused
with an error naming the file, never loaded as wrong data.

What goes into a checkpoint besides the loader state lives here too: :func:`global_rng_state` and
:func:`set_global_rng_state` (the process's generators, CPU and accelerators, as plain tensors).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_FORMAT", "MANIFEST", "CheckpointError", "complete_checkpoints", "global_rng_state", "prune", "seal",
    "set_global_rng_state", "temporary_name", "verify", "write_sealed",
]

logger = logging.getLogger(__name__)

MANIFEST = "loader_resume_manifest.json"
"""The file that seals a complete checkpoint directory."""
_MANIFEST_FORMAT = 1
CHECKPOINT_FORMAT: Final = 1
"""The format of what loader-resume adds to a training checkpoint (the Lightning entry, the Accelerate file)."""
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, corrupted or edited."""


def temporary_name(final: Path) -> Path:
    """Where ``final`` is written before it is sealed and renamed."""
    return final.with_name(f".{final.name}.tmp")


def seal(directory: Path, final: Path, *, checksums: bool = True) -> None:
    """Write ``directory``'s manifest, then rename it to ``final`` (replacing an older ``final``)."""
    files = {name: _describe(directory / name, checksums) for name in _files(directory)}
    manifest = directory / MANIFEST
    _write_atomically(manifest, json.dumps({"format": _MANIFEST_FORMAT, "files": files}, indent=1, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    os.replace(directory, final)
    _fsync_directory(final.parent)


def verify(directory: Path) -> None:
    """Raise :class:`CheckpointError` unless ``directory`` matches its manifest byte for byte."""
    manifest = directory / MANIFEST
    try:
        described = json.loads(manifest.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {MANIFEST}; expected a checkpoint sealed by loader-resume "
                              "(killed before it was complete?)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest}: unreadable ({error}); expected the JSON manifest") from None
    if not isinstance(described, dict) or described.get("format") != _MANIFEST_FORMAT:
        found = described.get("format") if isinstance(described, dict) else described
        raise CheckpointError(f"{manifest}: format {found!r}; expected {_MANIFEST_FORMAT}")
    for name, expected in described["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the manifest lists it ({expected['size']} bytes)")
        found = _describe(path, "sha256" in expected)
        if found != expected:
            raise CheckpointError(f"{path}: {found} does not match the manifest's {expected} "
                                  "(truncated, corrupted or edited after it was written); refusing to load it")


def complete_checkpoints(root: Path, pattern: str = r"step_(\d+)") -> list[Path]:
    """Sealed checkpoints under ``root`` named ``pattern`` (one integer group), oldest first.

    Leftovers of interrupted saves (``.NAME.tmp``) and unsealed directories are skipped with a warning.
    """
    found: list[tuple[int, Path]] = []
    if not root.is_dir():
        return []
    for path in sorted(root.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            logger.warning("skipping %s: an incomplete checkpoint (the save was interrupted)", path)
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


def write_sealed(final: Path, write_into: Callable[[Path], None], *, main: bool, agree: Callable[[bool], bool],
                 step: int, checksums: bool = True, keep: int = 2) -> bool:
    """Write a checkpoint directory atomically, every process of a job together: ``write_into(temporary)`` on
    every process (the main one creates the directory first), then the main process seals it and renames it
    to ``final`` (:func:`seal`), and deletes checkpoints beyond the newest ``keep`` (:func:`prune`).

    ``agree(flag)`` is whether ``flag`` holds on any process (a collective; on one process, ``flag``). A
    failed write (a full disk, a lost mount) on any process is agreed by all: the partial directory is
    removed, the error is logged, the previous checkpoints stay and ``False`` is returned. NOTE: every
    process takes the same branch at each agreement, so the collectives stay paired.
    """
    temporary = temporary_name(final)
    failure: OSError | None = None
    try:
        if main:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
    except OSError as error:
        failure = error
    if not agree(failure is not None):
        try:
            write_into(temporary)
        except OSError as error:
            failure = error
        if not agree(failure is not None) and main:
            try:
                seal(temporary, final, checksums=checksums)
                prune(final.parent, keep)
            except OSError as error:
                failure = error
        if not agree(failure is not None):
            return True
    if main:
        shutil.rmtree(temporary, ignore_errors=True)
    kept = complete_checkpoints(final.parent)
    logger.error("checkpoint at step %d failed (%s); training goes on, the newest checkpoint is still %s",
                 step, failure or "on another process", kept[-1] if kept else "none")
    return False


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


# --- RNG states for checkpoints -----------------------------------------------------------------
def global_rng_state() -> dict[str, Any]:
    """torch's default CPU generator, numpy's legacy global and Python's ``random`` states, and every
    accelerator generator this process has: ``"cuda"`` (one state per visible CUDA device) and
    ``"mps"``, present only where the device is.

    Plain values and tensors only, so a checkpoint holding it loads with ``weights_only=True``
    (Lightning 2.6 and our own loaders load that way). On a GPU, dropout draws from the CUDA
    generators, so resuming the model's random sequence needs them as much as the CPU one.
    """
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    numpy_state = {"kind": kind, "key": torch.from_numpy(np.asarray(key).astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": numpy_state, "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(device) for device in range(torch.cuda.device_count())]
    if _mps_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`global_rng_state` returned.

    CUDA states are restored only onto as many visible CUDA devices as were saved (device ``i`` gets
    saved state ``i``); otherwise they are left alone with a warning that names both counts, since a
    state for another device layout would continue another device's sequence. Likewise ``"mps"``.
    """
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    key = saved["key"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], key, saved["pos"], saved["has_gauss"], saved["gauss"]))
    random.setstate(state["random"])
    cuda = state.get("cuda")
    if cuda is not None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == len(cuda):
            for device, device_state in enumerate(cuda):
                torch.cuda.set_rng_state(device_state, device)
        else:
            logger.warning("RNG state: saved for %d CUDA device(s), this process sees %d; the CUDA generators "
                           "are NOT restored (GPU dropout will not continue the saved sequence; run with the same "
                           "CUDA_VISIBLE_DEVICES layout to restore them)", len(cuda), visible)
    mps = state.get("mps")
    if mps is not None:
        if _mps_available():
            torch.mps.set_rng_state(mps)
        else:
            logger.warning("RNG state: saved with an MPS generator, this process has no MPS device; not restored")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return backend is not None and bool(backend.is_available())
