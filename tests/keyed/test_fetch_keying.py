"""Keys are applied at the fetch, whatever the dataset does with the index list."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from loader_resume import ResumableDataLoader
from loader_resume.keyed.keyed_rng import CallerRng, generator_mask
from loader_resume.testing import assert_resumes_exactly, run_epochs
from support.data import caller_draws, seed_all


def _draw(count: int) -> dict[str, torch.Tensor]:
    return {"torch": torch.rand(count), "numpy": torch.from_numpy(np.random.rand(count)),
            "random": torch.tensor([random.random() for _ in range(count)])}


class IteratesThrice(Dataset[Any]):
    """Like HF datasets' ``__getitems__``: ``max``, ``min`` and a conversion of the list before a
    batch transform."""

    def __len__(self) -> int:
        return 24

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        assert 0 <= min(indices) and max(indices) < len(self)
        ids = np.fromiter(indices, dtype=np.int64)
        noise = _draw(len(ids))
        return [{"id": int(i), **{k: v[j] for k, v in noise.items()}} for j, i in enumerate(ids)]


class Converts(IteratesThrice):
    """Converts the list with numpy and torch; never calls ``__iter__`` on it."""

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        ids = torch.as_tensor(np.asarray(indices))
        noise = _draw(len(ids))
        return [{"id": int(i), **{k: v[j] for k, v in noise.items()}} for j, i in enumerate(ids)]


class NeverLooks(IteratesThrice):
    """Draws before it reads the list at all (a batch-level augmentation decided up front)."""

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        noise = _draw(4)
        return [
            {"id": i, **{k: v[j % 4] for k, v in noise.items()}} for j, i in enumerate(indices[:])
        ]


class ItemByItem(Dataset[Any]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, **{k: v[0] for k, v in _draw(1).items()}}


DATASETS = [IteratesThrice, Converts, NeverLooks]


def _loader(cls: type[Dataset[Any]], workers: int, **options: Any) -> ResumableDataLoader[Any]:
    options.setdefault("seed", 1)
    return ResumableDataLoader(cls(), batch_size=4, shuffle=True, num_workers=workers, **options)


@pytest.mark.parametrize("cls", DATASETS)
def test_batch_values_are_keyed_whatever_the_dataset_does_with_the_list(
    cls: type[Dataset[Any]],
) -> None:
    in_process = run_epochs(_loader(cls, 0), 2)
    assert run_epochs(_loader(cls, 2), 2) == in_process
    # the values are keyed, not constant
    assert run_epochs(_loader(cls, 0, seed=2), 2) != in_process


@pytest.mark.parametrize("cls", DATASETS)
def test_the_callers_generators_do_not_move_while_iterating_in_process(
    cls: type[Dataset[Any]],
) -> None:
    seed_all(5)
    expected = caller_draws()
    seed_all(5)
    run_epochs(_loader(cls, 0), 2)
    assert caller_draws() == expected


@pytest.mark.parametrize("cls", DATASETS)
def test_batch_read_datasets_resume_exactly_in_process_and_across_worker_counts(
    cls: type[Dataset[Any]],
) -> None:
    assert_resumes_exactly(lambda: _loader(cls, 0))
    assert_resumes_exactly(
        lambda: _loader(cls, 0), make_resumed=lambda: _loader(cls, 2), cuts=[1, 5, 6, 7]
    )


def test_per_sample_keys_still_reach_item_by_item_datasets() -> None:
    """keying='sample': an item's values depend on its index only, not on the batch it came in."""
    small = {int(b["id"][j]): b["torch"][j].item() for b in _loader(ItemByItem, 0, keying="sample")
             for j in range(len(b["id"]))}
    big = ResumableDataLoader(
        ItemByItem(), batch_size=6, shuffle=True, seed=1, num_workers=2, keying="sample"
    )
    assert {
        int(b["id"][j]): b["torch"][j].item() for b in big for j in range(len(b["id"]))
    } == small


def test_per_sample_keying_over_a_batch_read_dataset_warns_once_what_it_keys(
        caplog: pytest.LogCaptureFixture) -> None:
    class Batched(Converts):
        pass

    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        _loader(Batched, 0, keying="sample")
        _loader(Batched, 0, keying="sample")
    messages = [r.getMessage() for r in caplog.records if "__getitems__" in r.getMessage()]
    assert (
        len(messages) == 1
        and "Batched" in messages[0]
        and "keyed by the batch's key" in messages[0]
    )
    # ... and what it says holds: values are keyed (equal across worker counts) though read as
    # a batch.
    assert run_epochs(_loader(Batched, 0, keying="sample"), 1) == run_epochs(
        _loader(Batched, 2, keying="sample"), 1
    )


def test_caller_rng_restores_every_generator_exactly() -> None:
    """The fast paths (numpy's and random's MT structs copied through ctypes) restore exactly."""
    seed_all(3)
    random.gauss(0, 1)  # leaves a cached spare Gaussian in random.gauss_next
    guard = CallerRng(generator_mask(["torch", "numpy", "random"])).save()
    expected = (*caller_draws(), random.gauss(0, 1), random.getrandbits(200))
    guard.restore()
    seed_all(99)  # a keyed fetch moves everything
    guard.restore()
    assert (*caller_draws(), random.gauss(0, 1), random.getrandbits(200)) == expected
