"""The one private torch detail the split check relies on: the default process group's store."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from loader_resume.workers.torch_internals import default_store


def test_the_default_store_is_the_process_groups_and_answers_without_waiting(
    tmp_path: Path,
) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found = default_store()
        found.set("loader_resume/pinned", "1")
        assert found.get("loader_resume/pinned") == b"1" and found.check(["loader_resume/pinned"])
        # check() does not wait for a missing key
        assert not found.check(["loader_resume/never-set"])
    finally:
        dist.destroy_process_group()
