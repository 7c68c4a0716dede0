"""The data libraries users actually bring, for real, on data generated here.

HF ``datasets`` (map-style with ``set_transform``/``with_transform``, and streams:
``to_iterable_dataset``, ``.map``, ``.shuffle``), WebDataset (local tar shards) and litdata
(``litdata.optimize`` into a tmp dir). Mosaic Streaming is not here: ``import streaming`` imports
torchvision, whose only wheel for torch 2.13 is CUDA-linked and fails to import on the CPU build CI
runs (docs: Works with). Every test asserts exact resume over 2+ epochs, at ``num_workers`` 0 and 2,
and, where it applies, equal values across worker counts and an untouched caller RNG.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
from pathlib import Path
from typing import Any

import datasets
import litdata
import numpy as np
import pytest
import torch
import webdataset as wds

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, fingerprint, run_epochs
from support.data import caller_draws, seed_all

N = 24


# --- HF datasets, map-style -----------------------------------------------------------------------
def _augment(batch: dict[str, list[Any]]) -> dict[str, torch.Tensor]:
    count = len(batch["id"])
    return {"id": torch.tensor(batch["id"]), "torch": torch.rand(count),
            "numpy": torch.from_numpy(np.random.rand(count)),
            "random": torch.tensor([random.random() for _ in range(count)])}


def _hf_map(workers: int, how: str = "set_transform") -> ResumableDataLoader[Any]:
    dataset = datasets.Dataset.from_dict({"id": list(range(N))})
    if how == "set_transform":
        dataset.set_transform(_augment)
    else:
        dataset = dataset.with_transform(_augment)
    return ResumableDataLoader(dataset, batch_size=4, shuffle=True, seed=1, num_workers=workers)


@pytest.mark.parametrize("how", ["set_transform", "with_transform"])
def test_hf_map_style_transforms_are_keyed_and_leave_the_callers_rng_alone(how: str) -> None:
    seed_all(3)
    expected = caller_draws()
    seed_all(3)
    in_process = run_epochs(_hf_map(0, how), 2)
    assert caller_draws() == expected
    assert run_epochs(_hf_map(2, how), 2) == in_process


@pytest.mark.parametrize("workers", [0, 2])
def test_hf_map_style_resumes_exactly_at_every_cut(workers: int) -> None:
    assert_resumes_exactly(lambda: _hf_map(workers))


def test_hf_map_style_resumes_across_worker_counts() -> None:
    assert_resumes_exactly(
        lambda: _hf_map(2), make_resumed=lambda: _hf_map(0), cuts=[1, 3, 6, 7, 9]
    )


# --- HF datasets, streams -------------------------------------------------------------------------
def _noise(example: dict[str, Any]) -> dict[str, Any]:
    return {"id": example["id"], "noise": torch.rand(()).item()}


def _mix(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor([x["id"] for x in items]), "mix": torch.rand(len(items))}


def _hf_stream(
    workers: int, persistent: bool = False, shuffle: str = ""
) -> ResumableDataLoader[Any]:
    stream = datasets.Dataset.from_dict({"id": list(range(N))}).to_iterable_dataset(num_shards=4)
    if shuffle == "shards":
        stream = stream.shuffle(seed=1, buffer_size=1)
    elif shuffle == "buffer":
        # NOTE: random numbers drawn in an HF .map() upstream of a shuffle buffer are not
        # reproducible even between two uninterrupted runs (measured on datasets 5.2; docs: Works
        # with), so here the randomness is the collate's, keyed by the loader.
        return ResumableDataLoader(
            stream.shuffle(seed=1, buffer_size=8),
            batch_size=4,
            num_workers=workers,
            persistent_workers=persistent,
            collate_fn=_mix,
        )
    return ResumableDataLoader(
        stream.map(_noise), batch_size=4, num_workers=workers, persistent_workers=persistent
    )


STREAM_CASES = [(0, False), (2, False), (2, True)]


@pytest.mark.parametrize(("workers", "persistent"), STREAM_CASES)
def test_hf_stream_resumes_exactly_across_later_epochs(workers: int, persistent: bool) -> None:
    """Once resumed, later epochs start at their beginning (HF re-applies a loaded state until told
    a new epoch)."""
    assert_resumes_exactly(lambda: _hf_stream(workers, persistent), epochs=3)


@pytest.mark.parametrize(("workers", "persistent"), STREAM_CASES)
def test_hf_stream_shuffle_buffer_resumes_exactly_and_reshuffles_per_epoch(
        workers: int, persistent: bool, caplog: pytest.LogCaptureFixture) -> None:
    """HF's own state omits the buffer (and fails to load with workers): we replay instead,
    exactly."""
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        loader = _hf_stream(workers, persistent, shuffle="buffer")
    assert "omits the buffer's content" in caplog.text and "replaying" in caplog.text
    orders = [[int(i) for b in loader for i in b["id"]] for _ in range(2)]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(N))
    assert_resumes_exactly(lambda: _hf_stream(workers, persistent, shuffle="buffer"), epochs=2)


def test_hf_stream_is_told_the_epoch_and_reshuffles_its_shards() -> None:
    loader = _hf_stream(0, shuffle="shards")
    orders = [[int(i) for b in loader for i in b["id"]] for _ in range(3)]
    assert len({tuple(o) for o in orders}) > 1 and all(sorted(o) == list(range(N)) for o in orders)
    assert_resumes_exactly(lambda: _hf_stream(0, shuffle="shards"), epochs=3)


# --- WebDataset -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("wds")
    urls = []
    for shard in range(3):
        path = folder / f"shard-{shard}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(8):
                writer.write({"__key__": f"{shard:02d}{i:04d}", "id.txt": str(shard * 8 + i)})
        urls.append(str(Path(path)))
    return urls


def _decode(sample: dict[str, Any]) -> dict[str, Any]:
    return {"id": int(sample["id.txt"]), "noise": torch.rand(()).item()}


def _wds(urls: list[str], workers: int, shuffle: str = "") -> ResumableDataLoader[Any]:
    stream = wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(_decode)
    if shuffle == "seeded":
        stream = stream.shuffle(5, seed=3)
    elif shuffle == "unseeded":
        stream = stream.shuffle(5)
    return ResumableDataLoader(stream, batch_size=4, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", ["", "seeded"])
def test_webdataset_resumes_exactly_by_replay(
    shards: list[str], workers: int, shuffle: str
) -> None:
    assert_resumes_exactly(lambda: _wds(shards, workers, shuffle))


def test_webdataset_unseeded_shuffle_is_named_as_not_bit_identical(
        shards: list[str], caplog: pytest.LogCaptureFixture) -> None:
    loader = _wds(shards, 0, "unseeded")
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    rest = [fingerprint(b) for b in iterator]
    resumed = _wds(shards, 0, "unseeded")
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        resumed.load_state_dict(state)
    assert "will NOT be bit-identical" in caplog.text and "pass seed=" in caplog.text
    # and indeed it is not: the warning is not a formality
    assert [fingerprint(b) for b in resumed] != rest


# --- litdata --------------------------------------------------------------------------------------
def _lit_item(i: int) -> dict[str, Any]:
    return {"id": i, "x": np.full(3, i, dtype=np.float32)}


class _NoisyLit(litdata.StreamingDataset):  # type: ignore[misc]
    """litdata's dataset with a random augmentation, as a user subclasses it."""

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        item["noise"] = torch.rand(()).item()
        return item


@pytest.fixture(scope="module")
def lit_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("litdata") / "optimized")
    # NOTE: litdata.optimize sets the process-wide multiprocessing start method (to "spawn" by
    # default), which would make every later test's DataLoader workers spawn (slow; local classes
    # unpicklable): put it back.
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        litdata.optimize(
            fn=_lit_item,
            inputs=list(range(N)),
            output_dir=out,
            chunk_size=5,
            num_workers=1,
            start_method="fork",
        )
    finally:
        multiprocessing.set_start_method(previous, force=True)
    return out


def _lit(
    folder: str, workers: int, shuffle: bool, persistent: bool = False
) -> ResumableDataLoader[Any]:
    return ResumableDataLoader(_NoisyLit(input_dir=folder, shuffle=shuffle, seed=3), batch_size=4,
                               num_workers=workers, persistent_workers=persistent)


LIT_CASES = [(0, False), (0, True), (2, False), (2, True)]


@pytest.mark.parametrize(("workers", "shuffle"), LIT_CASES)
def test_litdata_resumes_exactly_through_its_own_state(
    lit_dir: str, workers: int, shuffle: bool
) -> None:
    """litdata's ``state_dict(num_samples_yielded, num_workers, batch_size)`` is fed with each
    worker's count."""
    loader = _lit(lit_dir, workers, shuffle)
    orders = [[int(i) for b in loader for i in b["id"]] for _ in range(2)]
    assert all(sorted(order) == list(range(N)) for order in orders)
    if shuffle:  # set_epoch reaches litdata, whose shuffle is seeded by (seed, epoch)
        assert orders[0] != orders[1]
    assert_resumes_exactly(lambda: _lit(lit_dir, workers, shuffle), epochs=3)


def test_litdata_with_persistent_workers_resumes_exactly_across_later_epochs(lit_dir: str) -> None:
    """litdata counts its own epochs in each worker; the loader's set_epoch overrides them on every
    pass."""
    assert_resumes_exactly(lambda: _lit(lit_dir, 2, True, persistent=True), epochs=3)


class _CountingLit(_NoisyLit):
    reads = 0

    def __getitem__(self, index: Any) -> Any:
        type(self).reads += 1
        return super().__getitem__(index)


def test_litdata_resume_reads_nothing_to_skip(
    lit_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """O(1): the first batch after a resume at 90 % of the epoch reads that batch's items and no
    other."""
    loader = ResumableDataLoader(
        _CountingLit(input_dir=lit_dir, shuffle=True, seed=3), batch_size=4
    )
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    state, rest = loader.state_dict(), [fingerprint(b) for b in iterator]
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        resumed = ResumableDataLoader(
            _CountingLit(input_dir=lit_dir, shuffle=True, seed=3), batch_size=4
        )
        resumed.load_state_dict(state)
        _CountingLit.reads = 0
        first = next(iter(resumed))
    assert _CountingLit.reads == 4 and [fingerprint(first)] == rest
    assert "replaying" not in caplog.text and "resume protocol" not in caplog.text
