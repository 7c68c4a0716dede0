"""Accelerate's sharded optimizer load under torch's first FSDP (``accelerate_resume.fsdp``), on the
CPU.

Accelerate reads a sharded optimizer checkpoint through ``torch.distributed.checkpoint`` into a
template made from the optimizer's current state. These tests show, with that same load, that a
template made before the first step reads nothing back, and that one made after ``make_state`` reads
every entry. The whole path (Accelerate's FSDP on a GPU, SIGTERM, the same command again) is the GPU
tier's (``tests/frontdoors/test_gpu.py``); Accelerate ignores FSDP on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from accelerate_resume.fsdp import holds_optimizer_state, make_state


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as FSDP's optimizer state dicts are."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        "optimizer": {"state": {names[id(p)]: dict(state) for p, state in optimizer.state.items()}}
    }


def trained(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), weight_decay=0.1)
    )
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_sharded_load_reads_the_optimizer_state_only_into_a_made_state(
    tmp_path: Path, kind: str
) -> None:
    model, optimizer = trained(kind)
    saved = by_name(model, optimizer)
    dcp.save(saved, checkpoint_id=tmp_path / "optimizer_0", no_dist=True)
    assert holds_optimizer_state(tmp_path / "optimizer_0")

    fresh_model, fresh = trained(kind)
    fresh.state.clear()  # as before its first step
    template = by_name(fresh_model, fresh)
    dcp.load(template, checkpoint_id=tmp_path / "optimizer_0", no_dist=True)
    assert template["optimizer"]["state"] == {}  # what Accelerate alone loads: nothing

    before = [p.detach().clone() for p in fresh_model.parameters()]
    rate = fresh.param_groups[0]["lr"]
    make_state(fresh)
    # unchanged
    assert all(torch.equal(a, b) for a, b in zip(before, fresh_model.parameters(), strict=True))
    assert fresh.param_groups[0]["lr"] is rate and all(
        p.grad is None for p in fresh_model.parameters()
    )
    template = by_name(fresh_model, fresh)
    dcp.load(template, checkpoint_id=tmp_path / "optimizer_0", no_dist=True)
    loaded, expected = template["optimizer"]["state"], saved["optimizer"]["state"]
    assert loaded.keys() == expected.keys() == {"weight", "bias"}
    for name in expected:
        assert loaded[name].keys() == expected[name].keys()
        assert all(torch.equal(loaded[name][key], value) for key, value in expected[name].items())


def test_make_state_gives_back_the_gradients_it_found() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    make_state(optimizer)
    assert [p.grad for p in model.parameters()] == grads and optimizer.param_groups[0]["lr"] == 0.5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(
        torch.count_nonzero(optimizer.state[p]["momentum_buffer"]) == 0 for p in model.parameters()
    )


def test_only_a_checkpoint_with_optimizer_state_entries_counts(tmp_path: Path) -> None:
    dcp.save(
        {"optimizer": {"param_groups": {"lr": torch.tensor(0.1)}}},
        checkpoint_id=tmp_path / "groups",
        no_dist=True,
    )
    assert not holds_optimizer_state(tmp_path / "groups")
    assert not holds_optimizer_state(tmp_path / "absent")
