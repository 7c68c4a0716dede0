"""``ResumeCallback``'s checkpoint files under storage faults: written atomically under a name of
their own, verified before Lightning loads them, and a corrupted preemption checkpoint passed over
at an automatic resume.

- ``save_atomically``: ``trainer.save_checkpoint`` into ``.NAME.tmp-TOKEN`` (a name of this write
  alone), then the writer waited for (``finish_writes``: Lightning's ``AsyncCheckpointIO`` writes in
  a thread after ``save_checkpoint`` returned), the file verified (a URL: found), and only then
  renamed (to an fsspec URL: one upload, visible only once complete); a failed write on any rank (a
  full disk, a read-only mount, a write that failed in the background, any exception) is agreed by
  all ranks, the temporary file is removed, the previous checkpoint stays, and ``None`` is returned.
- ``usable``: whether a checkpoint file verifies
  (``loader_resume.job.torch_file.verify_torch_file``), with a warning naming it and why not;
  ``verify_loads``: every file the strategy loads is verified first, so a changed or truncated
  checkpoint is refused naming the file (``fit(ckpt_path=...)`` included).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.plugins import AsyncCheckpointIO

from loader_resume.job.checkpoint import (
    CheckpointError,
    describe_failure,
    storage_failure,
    writer_token,
)
from loader_resume.job.storage import is_remote, remote_filesystem
from loader_resume.job.torch_file import verify_torch_file

__all__ = [
    "exists",
    "finish_writes",
    "nothing_else_to_resume",
    "save_atomically",
    "save_whole",
    "usable",
    "verify_loads",
]

logger = logging.getLogger(__name__)


def save_atomically(trainer: Trainer, final: str) -> str | None:
    """``trainer.save_checkpoint`` to ``final`` through a temporary file (every rank calls it):
    ``final`` once the file is whole on storage and verifies, or ``None`` when the write failed on
    any rank (logged with the path and the cause)."""
    strategy = trainer.strategy
    # NOTE: no rename on an object store: Lightning writes one upload, visible once complete
    remote = is_remote(final)
    folder, name = os.path.split(final)
    target = (
        final if remote else os.path.join(folder, f".{name}.tmp-{writer_token(strategy.broadcast)}")
    )
    failure = _write(trainer, target)
    if (
        not strategy.reduce_boolean_decision(failure is not None, all=False)
        and trainer.is_global_zero
        and not remote
    ):
        try:
            os.replace(target, final)
        except OSError as error:
            failure = error
    if not strategy.reduce_boolean_decision(failure is not None, all=False):
        return final
    cause = (
        "failed on another rank"
        if failure is None
        else f"{type(failure).__name__}: {failure}"
        if remote
        else describe_failure(failure, Path(final).parent)
    )
    if trainer.is_global_zero and not remote:
        with contextlib.suppress(OSError):
            os.remove(target)
    logger.error("checkpoint at step %d NOT written to %s: %s", trainer.global_step, final, cause)
    return None


def _write(trainer: Trainer, target: str) -> Exception | None:
    """``trainer.save_checkpoint(target)`` on this rank, the writer waited for and (on the rank that
    writes) the file verified: ``None``, or what failed. To a URL Lightning's checkpoint IO writes
    the whole file into one upload inside an fsspec transaction (``_atomic_save``): a reader sees
    the previous object or the new one, never a part."""
    try:
        trainer.save_checkpoint(target)
    # NOTE: the barrier save_checkpoint ends with, which the other ranks are in
    except Exception as error:
        trainer.strategy.barrier("Trainer.save_checkpoint")
        # NOTE: a store fails in its client's terms too (no credentials, a network error)
        return error if is_remote(target) else storage_failure(error)
    try:
        finish_writes(trainer.strategy)
        if trainer.is_global_zero and is_remote(target) and not exists(target):
            raise FileNotFoundError(f"{target}: not on the store once the checkpoint IO returned")
        # NOTE: a sharded save
        if trainer.is_global_zero and not is_remote(target) and not os.path.isdir(target):
            # NOTE: an upload is whole once visible: not read back over the network
            verify_torch_file(target)
    # NOTE: a write that failed in the writer's thread, or a file that is not whole
    except Exception as error:
        return error
    return None


def save_whole(fabric: Any, path: Path, state: dict[str, Any]) -> None:
    """``fabric.save(path, state)`` (every rank calls it), returning once the file is on storage
    (``finish_writes``: a Fabric may write through ``AsyncCheckpointIO`` too), or raising what
    failed (after the barrier ``fabric.save`` ends with, where the failure was in it: the other
    ranks are there)."""
    try:
        fabric.save(path, state)
    except Exception:
        if fabric.world_size > 1:
            fabric.barrier()
        raise
    finish_writes(fabric.strategy)
    if fabric.is_global_zero and not path.exists():
        raise FileNotFoundError(
            f"{path}: not on storage once the checkpoint IO's save_checkpoint and teardown() "
            "returned; expected a CheckpointIO whose teardown() waits for its writes"
        )


def finish_writes(strategy: Any) -> None:
    """Return once every file the ``strategy``'s checkpoint IO was asked to write is written, or
    raise why one was not.

    A checkpoint IO may write after its ``save_checkpoint`` returned: Lightning's
    ``AsyncCheckpointIO`` writes in a thread (so may a user's own). ``teardown()`` is the one moment
    Lightning's contract gives a checkpoint IO to finish its work (a strategy calls it as ``fit``
    ends; ``AsyncCheckpointIO`` waits for its thread there, raises the error of any write that
    failed in it, and starts a new thread at its next save), so each layer's ``teardown()`` runs,
    outermost first. A failure raised here is this save's failure, reported by the caller:
    ``AsyncCheckpointIO`` forgets it (it would raise it again at its next save and as ``fit`` ends,
    ending the process with a traceback instead of the agreed exit).
    """
    failure: BaseException | None = None
    try:
        layer = strategy.checkpoint_io
    # NOTE: FSDP's and ModelParallelStrategy's own writes (DCP), done when save returns
    except NotImplementedError:
        return
    while layer is not None:
        try:
            layer.teardown()
        except Exception as error:
            failure = failure or error
            if isinstance(layer, AsyncCheckpointIO):
                # NOTE: Lightning 2.6's record of the failed write; no public way to clear it
                layer._error = None
        # NOTE: Lightning's wrappers name the IO they wrap so
        layer = getattr(layer, "checkpoint_io", None)
    if failure is not None:
        raise failure


def exists(path: str) -> bool:
    """Whether the checkpoint file ``path`` (a local path or a URL) exists; a URL that cannot be
    reached (no credentials, no network, no such bucket) raises ``CheckpointError`` naming it and
    the cause."""
    if not is_remote(path):
        return os.path.isfile(path)
    fs, inner = remote_filesystem(path)
    try:
        # NOTE: not fs.isfile, which turns any error into False
        return bool(fs.info(inner)["type"] == "file")
    except FileNotFoundError:
        return False
    except Exception as error:
        raise CheckpointError(
            f"{path}: cannot reach the checkpoint storage ({type(error).__name__}: {error}); "
            "expected credentials, the network and the bucket (or container) to be there"
        ) from error


def usable(path: str) -> bool:
    """Whether the checkpoint file at ``path`` (a local path or a URL) verifies; a warning names it
    and why not (once per version of it: Lightning asks for it more than once)."""
    if is_remote(path):
        fs, inner = remote_filesystem(path)
        info = fs.info(inner)
        # NOTE: whatever the store gives
        version = info.get("ETag") or info.get("mtime") or fs.modified(inner)
        return _usable(path, int(info.get("size") or 0), str(version))
    stat = os.stat(path)
    return _usable(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _usable(path: str, size: int, version: Any) -> bool:
    try:
        verify_torch_file(path)
    except CheckpointError as error:
        logger.warning("skipping checkpoint %s at the automatic resume: %s", path, error)
        return False
    return True


def verify_loads(strategy: Any) -> None:
    """Every checkpoint file ``strategy.load_checkpoint`` reads from now on is verified first, a
    local path or a URL (a directory, as a sharded strategy saves, is left to the strategy)."""
    load = strategy.load_checkpoint
    if getattr(load, "verifies", False):
        return

    @functools.wraps(load)
    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, (str, os.PathLike)) and exists(os.fspath(checkpoint_path)):
            verify_torch_file(checkpoint_path)
        return load(checkpoint_path, *args, **kwargs)

    load_checkpoint.verifies = True  # type: ignore[attr-defined]
    strategy.load_checkpoint = load_checkpoint


def nothing_else_to_resume(skipped: str) -> CheckpointError:
    """The error when the preemption checkpoint ``skipped`` does not verify and Lightning found no
    other."""
    return CheckpointError(
        f"{skipped}: the preemption checkpoint does not verify (the warning above says why) and "
        "there is no other checkpoint to resume from; expected an intact one: move it away to "
        "start over"
    )
