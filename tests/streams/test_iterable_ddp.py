"""DDP for iterable datasets and the gather/load helper, with real gloo processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loader_resume import ResumableDataLoader, StateError
from loader_resume.distributed import DCPLoaderState, gather_states, load_rank_state
from loader_resume.testing import run_epochs
from support.data import StatefulShards, make
from support.launch import CHILDREN, launch


@pytest.mark.parametrize("via", ["torch", "dcp"])
def test_each_rank_resumes_its_own_stream_from_one_gathered_checkpoint(
    tmp_path: Path, via: str
) -> None:
    """Through torch.save of gather_states on rank 0, or torch.distributed.checkpoint with a
    DCPLoaderState."""
    script = CHILDREN / "ddp_stream_child.py"
    for mode in ("full", "save", "resume"):
        launch(script, mode, tmp_path, args=[via])
    full = [json.loads((tmp_path / f"full-{r}.json").read_text()) for r in range(2)]
    resumed = [json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        assert resumed[rank] == full[rank][4:]
    first_epoch = [i for r in range(2) for row in full[r][: len(full[r]) // 2] for i in row[0]]
    assert sorted(first_epoch) == list(range(37))


def test_a_stream_state_goes_through_dcp_as_one_value_where_the_loader_itself_does_not_fit(
    tmp_path: Path,
) -> None:
    """DCP loads into a fresh loader's state as a template; a stream's worker states change its
    shape."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(StatefulShards(11), batch_size=2, num_workers=2)

    reference = run_epochs(build(), 2)
    loader = build()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    dcp.save({"loader": loader}, checkpoint_id=str(tmp_path / "raw"), no_dist=True)
    with pytest.raises(
        CheckpointException, match=r"Missing key in checkpoint state_dict: loader\.stream\.workers"
    ):
        dcp.load({"loader": build()}, checkpoint_id=str(tmp_path / "raw"), no_dist=True)
    dcp.save({"loader": DCPLoaderState(loader)}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    resumed = build()
    dcp.load({"loader": DCPLoaderState(resumed)}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    assert run_epochs(resumed, 2, resumed.epoch) == reference[3:]
    with pytest.raises(StateError, match=r"'loader_resume': saved 'NoneType', expected bytes"):
        DCPLoaderState(build()).load_state_dict({"loader": {}})


def test_map_states_load_at_another_world_size_through_the_helper() -> None:
    old = [make(20, batch_size=2, shuffle=True, rank=r, world_size=2) for r in range(2)]
    iterators = [iter(loader) for loader in old]  # held: a dropped iterator's pass is over
    for iterator in iterators:
        next(iterator)
    gathered = {"world_size": 2, "ranks": [loader.state_dict() for loader in old]}
    single = make(20, batch_size=2, shuffle=True)
    load_rank_state(single, gathered)
    assert single.state_dict()["position"] == 4 and gather_states(single)["world_size"] == 1


def test_gathered_state_errors_are_clear() -> None:
    loader = make(10)
    with pytest.raises(
        StateError, match=r"'<gathered>'.*expected a dict with keys world_size, ranks"
    ):
        load_rank_state(loader, {"ranks": []})
    with pytest.raises(StateError, match=r"'ranks'.*expected a list of 2 rank states"):
        load_rank_state(loader, {"world_size": 2, "ranks": [loader.state_dict()]})
