"""DDP for iterable datasets and the gather/load helper, with real gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loader_resume import StateError
from loader_resume.distributed import gather_states, load_rank_state
from support.data import make
from support.launch import launch


def test_each_rank_resumes_its_own_stream_from_one_gathered_checkpoint(tmp_path: Path) -> None:
    script = Path(__file__).parent / "ddp_stream_child.py"
    for mode in ("full", "save", "resume"):
        launch(script, mode, tmp_path)
    full = [json.loads((tmp_path / f"full-{r}.json").read_text()) for r in range(2)]
    resumed = [json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        assert resumed[rank] == full[rank][4:]
    first_epoch = [i for r in range(2) for row in full[r][: len(full[r]) // 2] for i in row[0]]
    assert sorted(first_epoch) == list(range(37))


def test_map_states_load_at_another_world_size_through_the_helper() -> None:
    old = [make(20, batch_size=2, shuffle=True, rank=r, world_size=2) for r in range(2)]
    for loader in old:
        iterator = iter(loader)
        next(iterator)
    gathered = {"world_size": 2, "ranks": [loader.state_dict() for loader in old]}
    single = make(20, batch_size=2, shuffle=True)
    load_rank_state(single, gathered)
    assert single.state_dict()["position"] == 4 and gather_states(single)["world_size"] == 1


def test_gathered_state_errors_are_clear() -> None:
    loader = make(10)
    with pytest.raises(StateError, match=r"'<gathered>'.*expected a dict with keys world_size, ranks"):
        load_rank_state(loader, {"ranks": []})
    with pytest.raises(StateError, match=r"'ranks'.*expected a list of 2 rank states"):
        load_rank_state(loader, {"world_size": 2, "ranks": [loader.state_dict()]})
