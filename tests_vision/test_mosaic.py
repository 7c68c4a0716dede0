"""Mosaic Streaming for real: ``MDSWriter`` shards in a tmp dir, a subclass drawing augmentations.

Mosaic keeps its epoch and its position itself and takes them back only through its own
``state_dict(num_samples, from_beginning)`` / ``load_state_dict``; the loader feeds that protocol
with what it counts, at every pass (``loader_resume.streams.library_protocols``). Each scenario runs
in a process of its own (see ``mosaic_child.py``: Mosaic's shared memory limits the datasets one
process can hold).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from streaming import MDSWriter

CHILD = Path(__file__).resolve().parent / "mosaic_child.py"


@pytest.fixture(scope="module")
def mds_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("mds"))
    with MDSWriter(out=out, columns={"id": "int"}, size_limit=200) as writer:  # several shards
        for i in range(24):
            writer.write({"id": i})
    return out


def _run(
    folder: str, mode: str, workers: int = 0, shuffle: bool = True, persistent: bool = False
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(CHILD),
            folder,
            mode,
            str(workers),
            str(int(shuffle)),
            str(int(persistent)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_mosaic_resumes_exactly_at_every_cut_over_three_epochs(
        mds_dir: str, workers: int, persistent: bool, shuffle: bool) -> None:
    """Ids and augmentation values after each cut equal the uninterrupted run's, in a fresh
    dataset."""
    _run(mds_dir, "cuts", workers, shuffle, persistent)


def test_mosaic_resume_reads_only_the_batches_it_delivers(mds_dir: str) -> None:
    """O(1): resumed in epoch 3, nothing is read to skip, and Mosaic is told the loader's epoch."""
    _run(mds_dir, "first-batch")


def test_mosaic_state_from_another_worker_count_is_refused(mds_dir: str) -> None:
    _run(mds_dir, "other-workers")


def test_a_mosaic_batch_size_other_than_the_loaders_is_refused(mds_dir: str) -> None:
    """Mosaic partitions an epoch in batches of its own batch_size: another one would not be
    Mosaic's order."""
    _run(mds_dir, "batch-size")
