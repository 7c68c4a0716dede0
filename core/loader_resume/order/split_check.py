"""A dataset split per rank, caught by a plain loader under ``torch.distributed`` without a
collective.

The loader shards one whole map-style dataset across ranks itself; a dataset split per rank
beforehand (HF ``split_dataset_by_node``, a per-rank ``Subset``) is split again, and each rank
silently sees a fraction of its part. ``loader_resume.distributed.check_same_dataset`` compares the
ranks' datasets through a collective, which the integrations can call on every rank; a plain loop
may build or iterate a loader on some ranks only (a validation loader on rank 0), where a collective
would hang the job. So at each of its first ``iter()`` calls a loader *publishes* what it reads —
type, length, content identity — in the process group's key-value store, under a name the same
loader has on every rank (its settings and how many loaders with the same settings this process
built before it), and compares it with what the other ranks already published there. Nothing waits:
a rank that never builds or iterates the loader is never compared. Of two ranks iterating at the
same time at least one sees the other's entry (each publishes before it looks), so a split is
refused on at least one rank at its first ``iter()``, and on the others at their next ``iter()``
after every rank published (until then each ``iter()`` costs one store look-up per missing rank).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sized
from typing import Any

import torch.distributed as dist

from loader_resume.thirdparty import content_identity
from loader_resume.workers.torch_internals import default_store

__all__ = ["SplitCheck", "describe_difference"]

# loaders built in this process, per settings (the ordinal in the name)
_BUILT: Counter[str] = Counter()


class SplitCheck:
    """One loader's check (see the module doc); ``at_iter`` returns None once it is done."""

    def __init__(self, dataset: Any, settings: tuple[Any, ...]) -> None:
        self.dataset = dataset
        base = json.dumps([type(dataset).__qualname__, *map(repr, settings)])
        _BUILT[base] += 1
        self.name = f"{base}#{_BUILT[base]}"
        self.published = False

    def at_iter(self, rank: int, world: int) -> SplitCheck | None:
        """Publish and compare (raises ValueError on a split); None when there is nothing more to
        check."""
        if (
            world == 1
            or not (dist.is_available() and dist.is_initialized())
            or dist.get_world_size() != world
        ):
            return None
        store = default_store()
        size = len(self.dataset) if isinstance(self.dataset, Sized) else None
        mine = [type(self.dataset).__qualname__, size, content_identity(self.dataset)]
        # an agent store outlives restarted rounds
        round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"loader_resume/split_check/{round_}/{self.name}/"
        if not self.published:
            store.set(key + str(rank), json.dumps(mine))
            self.published = True
        every: list[Any] = [mine if other == rank else (json.loads(store.get(key + str(other)))
                                                       if store.check([key + str(other)]) else None)
                            for other in range(world)]
        if any(other is not None and other != mine for other in every):
            raise ValueError(describe_difference(every))
        # looked at again at the next iter() until every rank is in
        return self if None in every else None


def describe_difference(every: list[Any]) -> str:
    """The error for ranks whose datasets differ: ``every[rank]`` is ``(type, length, identity)`` or
    None."""
    described = "; ".join(f"rank {rank}: {kind} of {size} items" + (f", {ident}" if ident else "")
                          for rank, entry in enumerate(every) if entry is not None
                          for kind, size, ident in [entry])
    return (
        f"the ranks' datasets differ ({described}); expected the same whole dataset on every rank, "
        "which the loader shards across ranks itself. A dataset split per rank beforehand (HF "
        "split_dataset_by_node, a per-rank Subset) would be split again and each rank would see a "
        "fraction of its part. Pass the whole dataset, or, to keep your own split, build the "
        "loader with rank=0, world_size=1 on every rank (each rank's state is then its own; save "
        "it per rank)"
    )
