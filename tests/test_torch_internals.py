"""What the loader relies on in torch's DataLoader iterator, pinned: next_batch is torch's __next__ minus the
range; fetch_items reads what torch's map-style fetcher reads."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data._utils.fetch import _MapDatasetFetcher

import loader_resume.torch_internals as torch_internals
from loader_resume import ResumableDataLoader
from loader_resume.torch_internals import fetch_items, next_batch
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


class _Batched(torch.utils.data.Dataset[int]):
    """Reads a batch through ``__getitems__`` (as HF ``datasets`` does), or not when it is set to None."""

    def __init__(self, getitems: bool) -> None:
        if not getitems:
            self.__getitems__ = None

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[str, int]:
        return ("one", index)

    def __getitems__(self, indices: list[int]) -> list[tuple[str, int]]:
        return [("batch", index) for index in indices]


def test_fetch_items_reads_what_torchs_map_fetcher_reads() -> None:
    for dataset in (_Batched(True), _Batched(False), list(range(10))):
        torch_fetcher = _MapDatasetFetcher(dataset, True, lambda items: items, False)
        assert fetch_items(dataset, [3, 1, 4]) == torch_fetcher.fetch([3, 1, 4])
    assert fetch_items(_Batched(True), [2]) == [("batch", 2)]
    assert fetch_items(_Batched(False), [2]) == [("one", 2)]
