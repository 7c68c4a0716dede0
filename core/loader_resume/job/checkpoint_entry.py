"""A front-end's checkpoint entry: written by ``new_entry``, read back by ``checked_entry`` (every
front-end).

The entry of a hand-written loop's session (``{"format", "step", "epoch", "world_size", "rng": [each
rank's], "loaders": [each loader's gathered states], ...}``) is read before the loaders exist, or
after: ``PendingEntry`` checks its format, keeps this rank's generators until right before the next
batch is fetched, and loads the loaders' states as soon as as many loaders exist as it holds states
(each through ``load_rank_state``, so another world size resumes as it does there).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from loader_resume.distributed import load_rank_state
from loader_resume.job.checkpoint import CHECKPOINT_FORMAT, CheckpointError, set_global_rng_state

__all__ = ["PendingEntry", "checked_entry", "new_entry"]

logger = logging.getLogger(__name__)


def new_entry(**fields: Any) -> dict[str, Any]:
    """A front-end's checkpoint entry holding ``fields`` (its loaders' states, its generators, its
    step ...), in the format this release writes and ``checked_entry`` reads. Every front-end
    writes its entry through this."""
    return {"format": CHECKPOINT_FORMAT, **fields}


def checked_entry(
    saved: Any, where: str | os.PathLike[str], *, needs: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``saved``, a front-end's entry found at ``where`` (a file, or a checkpoint's key), if it is
    one this release reads, with every key in ``needs``; else ``CheckpointError`` naming where, what
    it found and what was expected. Every front-end reads its entry through this."""
    found = saved.get("format") if isinstance(saved, dict) else saved
    if found != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{os.fspath(where)}: format {found!r}; expected {CHECKPOINT_FORMAT} (written by "
            "another loader-resume release?)"
        )
    absent = [key for key in needs if key not in saved]
    if absent:
        raise CheckpointError(
            f"{os.fspath(where)}: {', '.join(absent)} missing; expected an entry written by "
            "loader-resume"
        )
    return saved  # type: ignore[no-any-return]


class PendingEntry:
    """What a loaded entry still has to restore: this rank's generators and the loaders' states."""

    def __init__(self) -> None:
        self._rng: dict[str, Any] | None = None
        self._loaders: list[Any] | None = None

    def read(self, saved: Any, path: str | os.PathLike[str], rank: int) -> dict[str, Any]:
        """``saved`` (an entry found at ``path``), checked; its generators of ``rank`` (none, with a
        warning, for a rank the saving run did not have) and its loader states wait for
        ``restore_rng`` and ``apply``."""
        rng = checked_entry(saved, path, needs=("rng", "loaders", "world_size"))["rng"]
        self._rng = rng[rank] if rank < len(rng) else None
        if self._rng is None:
            logger.warning(
                "rank %d has no saved RNG state (the checkpoint is from %d processes)",
                rank,
                saved["world_size"],
            )
        self._loaders = saved["loaders"]
        return saved  # type: ignore[no-any-return]

    def apply(self, loaders: Sequence[Any]) -> None:
        """The loaders of the job so far: once there are as many as the entry holds states, each
        gets its own (``CheckpointError`` if there are more)."""
        saved = self._loaders
        if saved is None or len(loaders) < len(saved):
            return
        if len(saved) != len(loaders):
            raise CheckpointError(
                f"the checkpoint holds {len(saved)} loader states; {len(loaders)} loaders were set "
                "up (expected the same loaders, in the same order)"
            )
        for loader, gathered in zip(loaders, saved, strict=True):
            load_rank_state(loader, gathered)
        self._loaders = None

    def restore_rng(self) -> None:
        """Right before the first batch after a load: this rank's generators as they were saved."""
        if self._rng is not None:
            set_global_rng_state(self._rng)
            self._rng = None
