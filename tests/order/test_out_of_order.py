"""``in_order=False``: a slow batch does not stall the others; over map-style data each batch is the
same whatever order it arrives in, and a state taken with batches delivered past a slow one resumes
every remaining batch of the epoch exactly once; over an iterable dataset, every remaining item
once."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from loader_resume import ResumableDataLoader, StateError
from loader_resume.testing import fingerprint
from loader_resume.workers.torch_internals import caps_worker_tasks

# NOTE: torch 2.6 has in_order=False but no per-worker cap: the loader refuses it there
# (tests/workers/test_torch_internals.py)
pytestmark = pytest.mark.skipif(
    not caps_worker_tasks(), reason=f"in_order=False needs torch >= 2.7 (torch {torch.__version__})"
)

N, BATCH = 40, 4


class HeldAt(Dataset[dict[str, Any]]):
    """Item ``held`` waits until the file ``release`` exists (in whichever worker reads it); every
    item draws from torch, numpy and random."""

    def __init__(self, release: Path, held: int = 0) -> None:
        self.release, self.held = release, held

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, Any]:
        while index == self.held and not self.release.exists():
            time.sleep(0.01)
        return {"id": index, "noise": torch.rand(()), "np": np.random.rand(), "py": random.random()}


def loader(release: Path, workers: int = 2, *, in_order: bool = False, batch_size: int = BATCH,
           held: int = 0) -> ResumableDataLoader[Any]:
    return ResumableDataLoader(HeldAt(release, held), batch_size=batch_size, shuffle=True, seed=5,
                               num_workers=workers, in_order=in_order)


def by_first_id(batches: list[Any]) -> dict[int, str]:
    return {int(batch["id"][0]): fingerprint(batch) for batch in batches}


def cut_with_batches_ahead(release: Path, count: int) -> tuple[list[Any], dict[str, Any]]:
    """``count`` batches delivered while the first batch of the epoch is held, the state, then the
    release."""
    running = loader(release, held=int(loader(release).planned_indices()[0][0]))
    iterator = iter(running)
    delivered = [next(iterator) for _ in range(count)]
    state = json.loads(json.dumps(running.state_dict()))
    release.touch()
    del iterator
    return delivered, state


def test_a_held_batch_does_not_stall_the_others_and_each_batch_is_the_in_order_runs(
    tmp_path: Path,
) -> None:
    release = tmp_path / "release"
    in_order = [batch for batch in loader(release / "x", in_order=True, held=-1)]
    delivered, state = cut_with_batches_ahead(release, 5)
    first = in_order[0]["id"].tolist()
    assert all(batch["id"].tolist() != first for batch in delivered)  # the held batch came later
    assert state["position"] == 0 and len(state["ahead"]) == 5
    ours = by_first_id(delivered)
    # keyed by step, not by arrival
    assert all(ours[key] == by_first_id(in_order)[key] for key in ours)


@pytest.mark.parametrize("workers", [2, 0])
def test_the_rest_of_the_epoch_comes_exactly_once_after_a_resume(
    tmp_path: Path, workers: int
) -> None:
    """Resumed with 2 workers out of order, or with none (in order): the held batch and every batch
    not yet delivered, once each, with the values of the in-order run; then whole epochs as the
    in-order run's."""
    release = tmp_path / "release"
    in_order = loader(release / "x", in_order=True, held=-1)
    reference = [[batch for batch in in_order] for _ in range(2)]
    delivered, state = cut_with_batches_ahead(release, 5)
    resumed = loader(release, workers)
    resumed.load_state_dict(state)
    rest = list(resumed)
    ids = sorted(i for batch in delivered + rest for i in batch["id"].tolist())
    assert ids == list(range(N)) and len(delivered) + len(rest) == N // BATCH
    assert by_first_id(delivered + rest) == by_first_id(reference[0])
    assert resumed.state_dict()["ahead"] == [] and resumed.state_dict()["epoch"] == 1
    assert by_first_id(list(resumed)) == by_first_id(reference[1])


def test_a_state_with_batches_ahead_is_refused_at_another_batch_size_or_in_order(
    tmp_path: Path,
) -> None:
    """(An in-order loader's own states have no ``ahead``: one taken before the skipped steps would
    lose them.)"""
    release = tmp_path / "release"
    _, state = cut_with_batches_ahead(release, 3)
    with pytest.raises(
        StateError,
        match=r"'ahead': saved \[.*\], expected \[\] to resume with world_size=1, "
        r"batch_size=8. Batches were delivered out of order",
    ):
        loader(release, batch_size=8).load_state_dict(state)
    with pytest.raises(StateError, match=r"expected \[\] for a loader built with in_order=True"):
        loader(release, in_order=True).load_state_dict(state)


def test_an_edited_ahead_is_refused(tmp_path: Path) -> None:
    state = loader(tmp_path).state_dict()
    assert state["ahead"] == []
    state["ahead"] = [0]
    with pytest.raises(StateError, match="'ahead': saved \\[0\\], expected a list of ints > 0"):
        loader(tmp_path).load_state_dict(state)


class HeldStream(IterableDataset[int]):
    """Items 0-19, worker w reading those ≡ w (mod 2), from its own position (its state); worker 1's
    first item waits until ``release`` exists."""

    def __init__(self, release: Path) -> None:
        self.release, self.next = release, 0

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        mine = list(range(worker, 20, 2))
        while self.next < len(mine):
            item = mine[self.next]
            while item == 1 and not self.release.exists():
                time.sleep(0.01)
            self.next += 1
            yield item
        self.next = 0

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def test_an_iterable_dataset_out_of_order_resumes_each_remaining_item_once(tmp_path: Path) -> None:
    """Each worker's progress is recorded with its own batches, whatever order they arrive in:
    worker 0's run on while worker 1 waits, and a resume gives every item not yet delivered once
    (its order, like the uninterrupted run's, depends on which worker finishes first)."""
    release = tmp_path / "release"
    running = ResumableDataLoader(
        HeldStream(release), batch_size=2, num_workers=2, in_order=False, seed=1
    )
    iterator = iter(running)
    delivered = [next(iterator).tolist() for _ in range(4)]
    state = json.loads(json.dumps(running.state_dict()))
    release.touch()
    del iterator
    # worker 1 held: worker 0's batches came on
    assert all(i % 2 == 0 for batch in delivered for i in batch)
    resumed = ResumableDataLoader(
        HeldStream(release), batch_size=2, num_workers=2, in_order=False, seed=1
    )
    resumed.load_state_dict(state)
    rest = [i for batch in resumed for i in batch.tolist()]
    assert sorted([i for batch in delivered for i in batch] + rest) == list(range(20))
    # in order: the layout as before
    assert "ahead" not in ResumableDataLoader(list(range(4))).state_dict()


def test_a_converted_loader_keeps_in_order_false(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from loader_resume.convert import resumable

    converted = resumable(
        DataLoader(HeldAt(tmp_path), batch_size=BATCH, num_workers=2, in_order=False), seed=5
    )
    assert converted.in_order is False and converted.state_dict()["ahead"] == []


def test_a_state_taken_after_a_resume_keeps_the_steps_still_ahead(tmp_path: Path) -> None:
    """Resumed without workers, one batch delivered (the held one, first in the plan), then a second
    state: the steps delivered before the first cut are still skipped by a second resume."""
    release = tmp_path / "release"
    delivered, state = cut_with_batches_ahead(release, 5)
    first = loader(release, 0)
    first.load_state_dict(state)
    iterator = iter(first)
    delivered.append(next(iterator))
    second_state = json.loads(json.dumps(first.state_dict()))
    assert second_state["ahead"] and min(second_state["ahead"]) > second_state["position"]
    second = loader(release, 2)
    second.load_state_dict(second_state)
    ids = sorted(i for batch in delivered + list(second) for i in batch["id"].tolist())
    assert ids == list(range(N))
