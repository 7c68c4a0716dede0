"""Scale by simulation: 1,024 ranks, resumed at 768 and then 1,536, see each sample once.

The pure sampler, no processes: every rank's steps are computed exactly as a ResumableDataLoader on
that rank computes them. The default run uses n = 10^6; `pytest -m chaos` runs n = 10^8 and prints
time and memory per rank.
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest

from loader_resume.keyed.keyed_rng import derive_key
from loader_resume.order.permutation import KeyedPermutation
from loader_resume.order.sampler import Shard, permutation_steps

WORLDS = (1024, 768, 1536)


def simulate(n: int, batch: int) -> dict[str, float]:
    """Run one epoch: a third at each world size, every rank resuming from the shared position."""
    perm = KeyedPermutation(n, derive_key(0, 0, "perm"))
    seen = np.zeros(n, dtype=np.uint8)
    position, start = 0, time.perf_counter()
    for phase, world in enumerate(WORLDS):
        step = world * batch
        final = phase == len(WORLDS) - 1
        # a checkpoint at a step boundary
        stop = n if final else position + (n // len(WORLDS)) // step * step
        for rank in range(world):
            for units, _, end, _, _ in permutation_steps(
                perm, n, position, Shard(rank, world, batch, False)
            ):
                if end > stop:
                    break
                seen[np.asarray(units)] += 1
        tail = (n - position) % step if final else 0
        # the last step: ceil(tail / world) per rank
        padded = -(-tail // world) * world - tail if tail else 0
        position = stop
    elapsed = time.perf_counter() - start
    assert seen.min() == 1, "a sample was never delivered"
    assert int(seen.sum()) - n == padded and seen.max() <= 2, (
        "a sample was delivered twice (beyond padding)"
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds_per_rank": elapsed / sum(WORLDS), "peak_rss_mib": peak}


def test_elastic_resume_across_1024_768_1536_ranks_delivers_the_epoch_exactly_once() -> None:
    simulate(10**6, batch=4)


@pytest.mark.chaos
def test_elastic_resume_at_scale_n_1e8() -> None:
    figures = simulate(10**8, batch=32)
    print(
        f"\nn=1e8 over {WORLDS} ranks: {1000 * figures['seconds_per_rank']:.1f} ms per rank; "
        f"peak RSS of the whole simulation {figures['peak_rss_mib']:.0f} MiB (the sampler itself "
        "is O(1) per rank)"
    )
