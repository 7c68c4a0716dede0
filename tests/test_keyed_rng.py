"""Keyed randomness: values are a function of (seed, epoch, position), never of workers or history."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from conftest import make
from loader_resume.keyed_rng import CallerRng, generator_mask
from loader_resume.testing import run_epochs


def _values(batches: list[dict[str, Any]]) -> dict[int, tuple[Any, ...]]:
    """id -> the values its sample drew."""
    out = {}
    for batch in batches:
        for i, index in enumerate(batch["id"].tolist()):
            out[index] = (tuple(batch["torch"][i].tolist()), float(batch["numpy"][i]), float(batch["random"][i]))
    return out


@pytest.mark.parametrize("keying", ["batch", "sample"])
def test_values_do_not_depend_on_num_workers(keying: str) -> None:
    runs = [run_epochs(make(12, num_workers=w, shuffle=True, keying=keying), 2) for w in (0, 2, 3)]
    assert runs[0] == runs[1] == runs[2]


def test_batch_mode_values_do_not_depend_on_caller_rng() -> None:
    first = run_epochs(make(9, shuffle=True), 1)
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert run_epochs(make(9, shuffle=True), 1) == first


def test_sample_mode_values_do_not_depend_on_batch_size_or_world_size() -> None:
    one = _values(list(make(12, batch_size=3, shuffle=True, keying="sample")))
    other = _values(list(make(12, batch_size=5, shuffle=True, keying="sample")))
    shards = [make(12, batch_size=2, shuffle=True, keying="sample", rank=r, world_size=3) for r in range(3)]
    sharded = {k: v for loader in shards for k, v in _values(list(loader)).items()}
    assert one == other == sharded and len(one) == 12


def test_batch_mode_samples_of_one_batch_draw_different_values() -> None:
    batch = next(iter(make(6, batch_size=6)))
    assert len({tuple(row.tolist()) for row in batch["torch"]}) == 6


def test_seed_changes_values_and_order() -> None:
    assert run_epochs(make(10, shuffle=True, seed=1), 1) != run_epochs(make(10, shuffle=True, seed=2), 1)


def test_keying_off_leaves_generators_alone() -> None:
    torch.manual_seed(7)
    plain = torch.utils.data.DataLoader(make(6).dataset, batch_size=3)
    expected = [b["torch"] for b in plain]
    torch.manual_seed(7)
    got = [b["torch"] for b in make(6, keying="off")]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_only_the_chosen_generators_are_keyed() -> None:
    def run() -> list[dict[str, Any]]:
        return list(make(6, keyed_generators=("torch",)))

    np.random.seed(1)
    first = run()
    np.random.seed(2)
    second = run()
    assert all(torch.equal(a["torch"], b["torch"]) for a, b in zip(first, second, strict=True))
    assert not all(torch.equal(a["numpy"], b["numpy"]) for a, b in zip(first, second, strict=True))


def test_unknown_generator_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keyed_generators: unknown generator\(s\) \['jax'\]"):
        make(6, keyed_generators=("torch", "jax"))


@pytest.mark.parametrize("keying", ["batch", "sample"])
def test_main_process_iteration_does_not_disturb_the_callers_stream(keying: str) -> None:
    """With num_workers=0 the fetch runs in the caller's process: its own draws (dropout) must not move."""

    def draws(loader: Any) -> list[tuple[float, float, float]]:
        torch.manual_seed(5)
        np.random.seed(5)
        random.seed(5)
        out = []
        for _ in loader:
            out.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
        return out

    assert draws(make(10, shuffle=True, keying=keying)) == draws(range(4))


def test_caller_rng_restores_numpy_state_exactly() -> None:
    np.random.seed(3)
    np.random.rand(5)
    saved = CallerRng(generator_mask(["numpy"])).save()
    expected = np.random.get_state()
    np.random.seed(42)
    np.random.rand(100)
    saved.restore()
    after = np.random.get_state()
    assert np.array_equal(after[1], expected[1]) and after[2] == expected[2]
