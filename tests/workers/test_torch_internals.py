"""What the loader relies on in torch's DataLoader iterator, pinned: next_batch is torch's __next__
minus the range; fetch_items reads what torch's map-style fetcher reads; next_numbered names an
out-of-order batch's list."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.fetch import _MapDatasetFetcher
from torch.utils.data._utils.worker import WorkerInfo

import loader_resume.workers.torch_internals as torch_internals
from loader_resume import ResumableDataLoader
from loader_resume.workers.torch_internals import fetch_items, next_batch, next_numbered
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
    """One range per next() call, the one that ends the epoch included, as for a plain
    DataLoader."""
    for workers in (0, 2):
        kind = "_SingleProcessDataLoaderIter" if workers == 0 else "_MultiProcessingDataLoaderIter"
        name = f"enumerate(DataLoader)#{kind}.__next__"
        ranges = []
        for loader in (
            torch.utils.data.DataLoader(Augmented(12), batch_size=3, num_workers=workers),
            ResumableDataLoader(Augmented(12), batch_size=3, num_workers=workers),
        ):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                assert sum(1 for _ in loader) == 4
            ranges.append(sum(1 for event in prof.events() if event.name == name))
        assert ranges[0] == ranges[1] == 5


class _Batched(torch.utils.data.Dataset[int]):
    """Reads a batch through ``__getitems__`` (as HF ``datasets`` does), or not when it is set to
    None."""

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


class _SlowFirst(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 0:
            import time

            time.sleep(0.5)
        return index


def test_next_numbered_names_the_index_list_each_out_of_order_batch_was_made_from() -> None:
    """A plain DataLoader, in_order=False, one item a batch: the number is the list's place in the
    sampler's order (here the item itself), while the slow first batch arrives late."""
    loader = torch.utils.data.DataLoader(_SlowFirst(), num_workers=2, in_order=False)
    iterator = iter(loader)
    pairs = [next_numbered(iterator) for _ in range(8)]
    assert all(number == int(batch) for number, batch in pairs)
    assert [number for number, _ in pairs] != list(range(8)) and sorted(
        n for n, _ in pairs
    ) == list(range(8))


def test_torch_caps_each_workers_lists_in_flight_from_2_7() -> None:
    """torch 2.7 added the per-worker cap (``_workers_num_tasks``) that in_order=False needs; 2.6
    has in_order without it (a slow batch collects every list in flight:
    tests/order/test_out_of_order.py hangs there)."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert torch_internals.caps_worker_tasks() == (version >= (2, 7))


def test_in_order_false_is_refused_at_construction_where_torch_does_not_cap_workers_tasks() -> None:
    """torch 2.6 (the compat leg's oldest corner): refused at construction, naming the torch it
    needs, never a silent fallback or a wait; from torch 2.7 it is built and delivers every batch.
    in_order=True: built on any."""
    if torch_internals.caps_worker_tasks():
        loader = ResumableDataLoader(list(range(8)), batch_size=2, num_workers=2, in_order=False)
        assert sorted(x for batch in loader for x in batch.tolist()) == list(range(8))
    else:
        with pytest.raises(
            ValueError, match=r"in_order=False needs torch >= 2\.7: torch 2\.6.*in_order=True\)"
        ):
            ResumableDataLoader(list(range(8)), batch_size=2, num_workers=2, in_order=False)
    assert list(ResumableDataLoader(list(range(4)), batch_size=2, in_order=True))[1].tolist() == [
        2,
        3,
    ]


class _EveryOther(torch_internals.IndexHooks[int]):
    """Index lists from the subclass: every other item, always fetched as lists."""

    def _index_lists(self) -> Any:
        return [[0, 2], [4, 6]]

    def _fetches_lists(self) -> bool:
        return True


def test_index_hooks_decide_what_torchs_iterators_fetch_at_any_worker_count() -> None:
    for workers in (0, 2):
        batches = [batch.tolist() for batch in _EveryOther(list(range(8)), num_workers=workers)]
        assert batches == [[0, 2], [4, 6]]


def test_index_hooks_left_alone_answer_as_dataloader_does() -> None:
    for options in ({"batch_size": 3}, {"batch_size": None}):
        hooked = torch_internals.IndexHooks(list(range(7)), **options)
        plain = DataLoader(list(range(7)), **options)
        assert hooked._auto_collation == plain._auto_collation
        assert list(hooked._index_sampler) == list(plain._index_sampler)


def test_is_map_style_follows_torchs_dataset_kind() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    assert torch_internals.is_map_style(DataLoader(list(range(3))))
    assert not torch_internals.is_map_style(DataLoader(Stream()))


class _Pids(Dataset[int]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return os.getpid()


def test_a_forgotten_persistent_iterator_starts_new_workers() -> None:
    loader = DataLoader(_Pids(), num_workers=1, persistent_workers=True)
    first, kept = {int(pid) for pid in loader}, {int(pid) for pid in loader}
    torch_internals.forget_persistent_iterator(loader)
    fresh = {int(pid) for pid in loader}
    assert first == kept and len(fresh) == 1 and fresh != first


def test_wrap_fetcher_wraps_what_a_single_process_iterator_reads_through() -> None:
    iterator = iter(DataLoader(list(range(4)), batch_size=2))
    seen: list[list[int]] = []

    class Spy:
        def __init__(self, fetcher: Any) -> None:
            self.fetcher = fetcher

        def fetch(self, indices: list[int]) -> Any:
            seen.append(list(indices))
            return self.fetcher.fetch(indices)

    torch_internals.wrap_fetcher(iterator, Spy)
    assert [batch.tolist() for batch in iterator] == [[0, 1], [2, 3]] and seen == [[0, 1], [2, 3]]


def test_set_past_guard_writes_what_torch_refuses() -> None:
    loader = DataLoader(list(range(3)))
    with pytest.raises(ValueError, match="dataset attribute should not be set"):
        loader.dataset = [9]
    torch_internals.set_past_guard(loader, "dataset", [9])
    assert loader.dataset == [9]
    info = WorkerInfo(id=0, num_workers=2, seed=1, dataset=None)
    # frozen: torch's own error type varies between releases
    with pytest.raises(Exception):  # noqa: B017
        info.id = 1
    torch_internals.set_past_guard(info, "id", 1)
    assert info.id == 1


def test_random_sampler_num_samples_is_none_unless_given() -> None:
    """What ``sampler.classify``'s "our permutation may stand in for it" relies on: the public
    ``num_samples`` answers the length either way, the private field says whether it was given."""
    from torch.utils.data import RandomSampler

    from loader_resume.workers.torch_internals import random_sampler_num_samples

    data = list(range(10))
    assert (
        random_sampler_num_samples(RandomSampler(data)) is None
        and RandomSampler(data).num_samples == 10
    )
    assert random_sampler_num_samples(RandomSampler(data, num_samples=10)) == 10
