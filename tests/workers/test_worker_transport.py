"""Small tensors come back from workers by value (``by_value_bytes``), larger ones through shared
memory as DataLoader sends them; either way each batch is DataLoader's to the bit: type, dtype,
shape, strides, bytes."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import reduce_tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from loader_resume import ResumableDataLoader
from loader_resume.workers.worker_transport import BY_VALUE_BYTES, send_small_tensors_by_value

DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
BIG = BY_VALUE_BYTES // 8 + 1  # float64s: one more than fits, in one item already


class Mixed(Dataset[dict[str, Any]]):
    """Every dtype, a 0-dim and an empty tensor, a tensor over the limit once batched, and plain
    values."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(index)
        noise = torch.randn(3, generator=generator) * 50
        item: dict[str, Any] = {
            str(dtype).removeprefix("torch."): noise.to(dtype) for dtype in DTYPES
        }
        item["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
        item["scalar"] = torch.tensor(index)
        item["empty"] = torch.empty(0, 5)
        item["big"] = torch.randn(BIG, generator=generator, dtype=torch.float64)
        item["id"], item["name"] = index, f"item-{index}"
        return item


def transposed(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate whose output holds a view that is not contiguous (it goes through shared memory),
    and a channels-last greyscale batch: contiguous, with a size-1 dimension's stride that is not
    the default one."""
    batch = torch.utils.data.default_collate(items)
    batch["view"] = batch["float32"].t()
    batch["greyscale"] = torch.arange(36.0).view(4, 1, 3, 3).to(memory_format=torch.channels_last)
    assert batch["greyscale"].stride() == (9, 1, 3, 1)
    return batch


def same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.stride()) == (
            theirs.dtype,
            theirs.shape,
            theirs.stride(),
        )
        assert ours.contiguous().view(-1).view(torch.uint8).tolist() == \
            theirs.contiguous().view(-1).view(torch.uint8).tolist()  # bytes: NaN, -0.0 and all
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key in theirs:
            same(ours[key], theirs[key])
    else:
        assert ours == theirs


@pytest.mark.parametrize("persistent", [False, True])
def test_batches_equal_dataloaders_and_only_small_tensors_come_by_value(persistent: bool) -> None:
    common: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "collate_fn": transposed,
                              "persistent_workers": persistent}
    theirs = list(DataLoader(Mixed(), **common))
    loader = ResumableDataLoader(Mixed(), keying="off", **common)
    for _ in range(2):  # a persistent pool's second epoch too
        ours = list(loader)
        assert len(ours) == len(theirs) == 6
        for mine, reference in zip(ours, theirs, strict=True):
            same(mine, reference)
            shared = {
                key
                for key, value in mine.items()
                if isinstance(value, torch.Tensor) and value.is_shared()
            }
            assert shared == {"big", "view"}  # over the limit, and a view: as DataLoader sends them
            assert all(reference[key].is_shared() for key in shared)


def test_by_value_bytes_0_sends_every_tensor_as_dataloader_does() -> None:
    loader = ResumableDataLoader(Mixed(), batch_size=4, num_workers=2, by_value_bytes=0)
    ours, theirs = next(iter(loader)), next(iter(DataLoader(Mixed(), batch_size=4, num_workers=2)))
    assert loader.by_value_bytes == 0
    tensors = [key for key, value in theirs.items() if isinstance(value, torch.Tensor)]
    assert {key: ours[key].is_shared() for key in tensors} == {
        key: theirs[key].is_shared() for key in tensors
    }
    assert sum(theirs[key].is_shared() for key in tensors) > len(DTYPES)


class Counting(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        return iter([torch.full((4,), float(10 * worker + i)) for i in range(3)])


def test_a_converted_loader_keeps_by_value_bytes() -> None:
    from loader_resume.convert import resumable

    assert (
        resumable(
            ResumableDataLoader(Mixed(), num_workers=2, by_value_bytes=0), num_workers=1
        ).by_value_bytes
        == 0
    )


def test_a_stream_with_workers_comes_by_value_too() -> None:
    theirs = list(DataLoader(Counting(), batch_size=2, num_workers=2))
    ours = list(ResumableDataLoader(Counting(), batch_size=2, num_workers=2))
    for mine, reference in zip(ours, theirs, strict=True):
        same(mine, reference)
        assert not mine.is_shared() and reference.is_shared()


@pytest.mark.parametrize("value", [-1, 1.5, "64", True, None, 2**30 + 1])
def test_a_bad_by_value_bytes_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(
        ValueError, match=r"by_value_bytes=.*expected an int from 0 .* to 1073741824"
    ):
        ResumableDataLoader(Mixed(), by_value_bytes=value)


def test_by_value_bytes_cannot_be_written_after_construction() -> None:
    loader = ResumableDataLoader(Mixed(), num_workers=2)
    with pytest.raises(ValueError, match="by_value_bytes attribute should not be set"):
        loader.by_value_bytes = 0
    assert loader.by_value_bytes == BY_VALUE_BYTES


@pytest.fixture
def by_value_here() -> Iterator[None]:
    """The by-value reducer in this process (as in a worker), torch's own put back afterwards."""
    send_small_tensors_by_value(64)
    try:
        yield
    finally:
        ForkingPickler.register(torch.Tensor, reduce_tensor)


def sent(tensor: torch.Tensor) -> torch.Tensor:
    received = pickle.loads(bytes(ForkingPickler.dumps(tensor)))
    assert isinstance(received, torch.Tensor)
    return received


@pytest.mark.usefixtures("by_value_here")
def test_what_is_not_a_plain_small_tensor_owning_its_storage_goes_through_shared_memory() -> None:
    small = torch.arange(8, dtype=torch.int64)  # 64 bytes: by value
    received = sent(small)
    assert torch.equal(received, small) and not received.is_shared()
    received.resize_(16)  # an ordinary storage of its own
    small.resize_(16)  # and the sent one is left as it was
    # a training loop's default device is not where a received batch goes
    with torch.device("meta"):
        received = sent(small)
    assert received.device.type == "cpu" and torch.equal(received, small)
    for other in (torch.arange(9, dtype=torch.int64),  # over the limit
                  torch.arange(16)[:4],  # part of a larger storage
                  torch.arange(6.0).view(2, 3).t(),  # not contiguous
                  torch.nn.Parameter(torch.ones(2)),  # not a plain tensor
                  torch.ones(2, requires_grad=True)):  # autograd's
        received = sent(other)
        assert received.is_shared() and torch.equal(received.detach(), other.detach())
