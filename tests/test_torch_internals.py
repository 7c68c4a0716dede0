"""What the loader relies on in torch's DataLoader iterator, pinned: next_batch is torch's __next__ minus the range."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import loader_resume.torch_internals as torch_internals
from loader_resume import ResumableDataLoader
from loader_resume.torch_internals import next_batch
from support.data import Augmented


def test_torch_next_is_still_made_of_the_steps_next_batch_repeats() -> None:
    assert torch_internals._SAME_STEPS


def test_without_a_profiler_batches_and_counts_are_torchs() -> None:
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=3)
    ours, theirs = iter(loader), iter(loader)
    got = [next_batch(ours).tolist() for _ in range(4)]
    assert got == [next(theirs).tolist() for _ in range(4)]
    assert ours._num_yielded == theirs._num_yielded == 4


def test_a_profiler_still_sees_the_dataloader_ranges_torch_records() -> None:
    """One range per next() call, the one that ends the epoch included, as for a plain DataLoader."""
    for workers in (0, 2):
        kind = "_SingleProcessDataLoaderIter" if workers == 0 else "_MultiProcessingDataLoaderIter"
        name = f"enumerate(DataLoader)#{kind}.__next__"
        ranges = []
        for loader in (torch.utils.data.DataLoader(Augmented(12), batch_size=3, num_workers=workers),
                       ResumableDataLoader(Augmented(12), batch_size=3, num_workers=workers)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                assert sum(1 for _ in loader) == 4
            ranges.append(sum(1 for event in prof.events() if event.name == name))
        assert ranges[0] == ranges[1] == 5
