"""Production paths that CPU-only tests reach through narrow stand-ins or real stores: accelerator
RNG states in checkpoints, the NCCL collective device, torchrun round agreement, and a loaded state
that would be ignored."""

from __future__ import annotations

import io
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from loader_resume import ResumableDataLoader
from loader_resume.distributed import _agree_on_generation, collective_device
from loader_resume.job.checkpoint import global_rng_state, set_global_rng_state
from support.data import ids, make


class FakeCuda:
    """Stands in for torch.cuda's generator API on a machine without a GPU: one generator per
    device."""

    def __init__(self, devices: int) -> None:
        self.states = [torch.randint(0, 256, (16,), dtype=torch.uint8) for _ in range(devices)]
        self.restored: dict[int, torch.Tensor] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(self.states))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: self.states[device].clone())
        monkeypatch.setattr(
            torch.cuda,
            "set_rng_state",
            lambda state, device: self.restored.__setitem__(device, state),
        )


def test_cuda_generators_are_saved_loadable_with_weights_only_and_restored_per_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    saving = FakeCuda(2)
    saving.install(monkeypatch)
    buffer = io.BytesIO()
    torch.save(global_rng_state(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert [s.tolist() for s in loaded["cuda"]] == [s.tolist() for s in saving.states]
    resuming = FakeCuda(2)
    resuming.install(monkeypatch)
    set_global_rng_state(loaded)
    assert {d: s.tolist() for d, s in resuming.restored.items()} == {
        d: s.tolist() for d, s in enumerate(saving.states)
    }


@pytest.mark.parametrize("devices_now", [0, 1, 4])
def test_cuda_states_for_another_device_count_are_not_restored_and_say_so(
    devices_now: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    FakeCuda(2).install(monkeypatch)
    state = global_rng_state()
    resuming = FakeCuda(devices_now)
    resuming.install(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        set_global_rng_state(state)
    assert resuming.restored == {}
    # the CPU generator is restored all the same
    assert torch.equal(torch.get_rng_state(), state["torch"])
    warned = [r.getMessage() for r in caplog.records if "CUDA" in r.getMessage()]
    assert (
        len(warned) == 1
        and f"saved for 2 CUDA device(s), this process sees {devices_now}" in warned[0]
    )


def test_a_state_without_accelerators_loads_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(0).install(monkeypatch)  # NOTE: no CUDA device, on a GPU machine too
    state = global_rng_state()
    assert set(state) <= {"torch", "numpy", "random", "mps"} and {
        "torch",
        "numpy",
        "random",
    } <= set(state)
    draws = torch.rand(3)
    set_global_rng_state(state)
    assert torch.equal(torch.rand(3), draws)


def test_collectives_use_the_current_cuda_device_on_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device() is None


def _round(
    store_port: int, world: int, results: dict[int, int], errors: list[BaseException]
) -> None:
    def rank_main(rank: int) -> None:
        try:
            client = dist.TCPStore(
                "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=20)
            )
            results[rank] = _agree_on_generation(client, rank, world, timedelta(seconds=20))
        except BaseException as error:
            errors.append(error)
    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in reversed(range(world))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


def test_every_rank_of_a_round_agrees_on_a_generation_no_earlier_round_used() -> None:
    """The torchrun situation: one store outlives the rounds and keeps their keys (a stale nonce of
    rank 1 included); ranks of one round share no restart count. Each round must agree on one fresh
    generation."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    server.set("loader_resume/generation/hello/1", "stale-nonce-from-a-dead-round")
    seen: list[int] = []
    for world in (2, 3, 2, 1):
        results: dict[int, int] = {}
        errors: list[BaseException] = []
        _round(server.port, world, results, errors)
        assert not errors, errors
        assert sorted(results) == list(range(world))
        assert len(set(results.values())) == 1, results
        seen.append(results[0])
    assert len(set(seen)) == len(seen), f"a generation was used twice: {seen}"


class _Counting(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(12))


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_loading_while_an_iterator_is_mid_epoch_warns_once(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    loader: ResumableDataLoader[Any] = make(12, shuffle=True) if kind == "map" else \
        ResumableDataLoader(_Counting(), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        loader.load_state_dict(state)
        next(iterator)
        loader.load_state_dict(state)
    warned = [r.getMessage() for r in caplog.records if "mid-epoch" in r.getMessage()]
    assert len(warned) == 1 and "ignores the loaded state" in warned[0]
    del iterator


def test_loading_twice_with_no_iter_between_warns_once_and_the_second_state_wins(
        caplog: pytest.LogCaptureFixture) -> None:
    loader = make(12, shuffle=True)
    order = ids(list(make(12, shuffle=True)))
    states = []
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
        states.append(loader.state_dict())
    del iterator
    resumed = make(12, shuffle=True)
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        resumed.load_state_dict(states[0])
        resumed.load_state_dict(states[1])
        resumed.load_state_dict(states[2])
    warned = [r.getMessage() for r in caplog.records if "never used" in r.getMessage()]
    assert len(warned) == 1
    assert ids(list(resumed)) == order[3:]


def test_a_finished_or_dropped_iterator_and_a_used_state_give_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = make(12, shuffle=True)
    with caplog.at_level(logging.WARNING, logger="loader_resume"):
        list(loader)  # finished
        state = loader.state_dict()
        for _ in loader:
            break  # dropped: the for loop's iterator is gone
        loader.load_state_dict(state)
        list(loader)
        loader.load_state_dict(state)
    assert not [r for r in caplog.records if "load_state_dict()" in r.getMessage()]
