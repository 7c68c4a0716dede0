"""Exact resume: every cut point, 3 epochs, the whole option matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, run_epochs
from support.data import Augmented, ids, make


def _pair_collate(items: list[dict[str, Any]]) -> tuple[list[int], torch.Tensor]:
    return [item["id"] for item in items], torch.stack([item["torch"] for item in items])


MATRIX = [
    # (num_workers, persistent_workers, shuffle, drop_last, batch_size, collate_fn)
    (0, False, True, False, 3, None),
    (0, False, False, False, 3, None),
    (0, False, True, True, 3, None),
    (0, False, True, False, 5, _pair_collate),
    (0, False, False, True, 4, _pair_collate),
    (2, False, True, False, 3, None),
    (2, True, True, False, 3, None),
    (2, True, False, True, 4, None),
    (2, False, True, True, 5, _pair_collate),
    (2, True, True, False, 4, _pair_collate),
]


@pytest.mark.parametrize(("workers", "persistent", "shuffle", "drop_last", "batch_size", "collate"), MATRIX)
def test_every_cut_point_resumes_exactly(
    workers: int, persistent: bool, shuffle: bool, drop_last: bool, batch_size: int, collate: Any
) -> None:
    def factory() -> ResumableDataLoader[Any]:
        return make(10, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, num_workers=workers,
                    persistent_workers=persistent, collate_fn=collate)

    per_epoch = 10 // batch_size if drop_last else -(-10 // batch_size)
    # With workers every resumed pass starts processes, so cut at the interesting points only: before the
    # first batch, after it, at an epoch's last batch, at the boundary, just after it, and at the end.
    cuts = None if workers == 0 else sorted({0, 1, per_epoch - 1, per_epoch, per_epoch + 1, 3 * per_epoch})
    report = assert_resumes_exactly(factory, epochs=3, cuts=cuts)
    assert report.batches == 3 * per_epoch


def test_epochs_differ_and_each_covers_the_dataset_once() -> None:
    loader = make(10, shuffle=True)
    epochs = [sum(ids(list(loader)), []) for _ in range(3)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_state_after_last_batch_resumes_at_next_epoch_without_an_empty_epoch() -> None:
    loader = make(9, shuffle=True)
    first = list(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed = make(9, shuffle=True)
    resumed.load_state_dict(state)
    assert ids(list(resumed)) == ids(list(loader)) != ids(first)


def test_new_iter_without_load_starts_a_new_epoch_like_dataloader() -> None:
    loader = make(10, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["epoch"] == 0
    assert len(list(loader)) == 4 and loader.epoch == 2


def test_dataloader_hands_over_the_users_dataset_and_length() -> None:
    dataset = Augmented(10)
    loader = ResumableDataLoader(dataset, batch_size=3, drop_last=True)
    assert loader.dataset is dataset and loader.batch_size == 3
    assert len(loader) == len(torch.utils.data.DataLoader(dataset, batch_size=3, drop_last=True)) == 3


def test_batch_size_none_yields_single_items_and_resumes() -> None:
    assert_resumes_exactly(lambda: make(5, batch_size=None, shuffle=True, num_workers=2), epochs=2)
    item = next(iter(make(5, batch_size=None)))
    assert item["id"] == 0 and item["torch"].shape == (2,)


_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from support.data import make
loader = make(10, batch_size=3, shuffle=True, num_workers=2)
mode, path = sys.argv[1], sys.argv[2]
if mode == "save":
    delivered = [b for e in range(2) for b in loader][:5]
    loader = make(10, batch_size=3, shuffle=True, num_workers=2)
    for epoch in range(2):
        for batch in loader:
            delivered = delivered[1:]
            if not delivered:
                torch.save(loader.state_dict(), path)
                sys.exit(0)
else:
    loader.load_state_dict(torch.load(path, weights_only=True))
    out = [b["id"].tolist() + b["torch"].flatten().tolist() for e in range(2) for b in loader]
    print(json.dumps(out))
"""


def test_resume_across_a_real_process_boundary(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(Path(__file__).parent)))
    state = tmp_path / "state.pt"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run([sys.executable, str(script), "save", str(state)], check=True, env=env)
    done = subprocess.run([sys.executable, str(script), "load", str(state)], check=True, env=env,
                          capture_output=True, text=True)
    reference = make(10, batch_size=3, shuffle=True, num_workers=2)
    batches = [b for e in range(3) for b in reference]
    expected = [b["id"].tolist() + b["torch"].flatten().tolist() for b in batches[5:]]
    assert json.loads(done.stdout) == expected


def test_run_epochs_helper_labels_epochs() -> None:
    records = run_epochs(make(4, batch_size=2), 2)
    assert [epoch for epoch, _ in records] == [0, 0, 1, 1]


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_and_its_workers_are_freed_without_the_cycle_collector(persistent: bool) -> None:
    """A reference cycle through the persistent iterator makes every shutdown wait 5 s per worker."""
    import gc
    import weakref

    loader = make(10, num_workers=2, persistent_workers=persistent)
    iterator = iter(loader)
    next(iterator)
    list(loader)
    ref = weakref.ref(loader)
    gc.disable()
    try:
        del loader, iterator
        assert ref() is None
    finally:
        gc.enable()
