"""Rank/world discovery, and one checkpoint for all ranks' loader states.

Map-style states are the same on every rank (the position is global). Iterable-dataset states are
not: each rank's workers hold their own part of the stream. ``gather_states`` collects every rank's
state so rank 0 can write a single checkpoint; ``load_rank_state`` hands each rank its own part::

    gathered = gather_states(loader)                 # every rank calls it (a collective)
    if dist.get_rank() == 0:
        torch.save({"loader": gathered, ...}, path)
    ...
    load_rank_state(loader, torch.load(path, weights_only=True)["loader"])
"""

from __future__ import annotations

import io
import os
import time
import uuid
from collections.abc import Mapping, Sized
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from loader_resume.job.checkpoint import global_rng_state
from loader_resume.order.split_check import describe_difference
from loader_resume.state import StateError
from loader_resume.thirdparty import content_identity

__all__ = [
    "DCPLoaderState",
    "any_rank",
    "check_same_dataset",
    "collective_device",
    "gather_rng_states",
    "gather_states",
    "init_process_group",
    "load_rank_state",
    "rank_and_world",
]


class _RankedLoader(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The ``(rank, world_size)`` a loader shards for; raises ValueError on an impossible pair."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank}, world_size={world_size}: expected world_size >= 1 and 0 <= rank < "
            "world_size"
        )
    return rank, world_size


def gather_states(loader: _RankedLoader, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every rank's ``loader.state_dict()`` (or ``state``, if given), in rank order, on every rank
    (a collective under DDP)."""
    state = loader.state_dict() if state is None else state
    if loader.world_size == 1:
        return {"world_size": 1, "ranks": [state]}
    states: list[Any] = [None] * loader.world_size
    dist.all_gather_object(states, state)
    return {"world_size": loader.world_size, "ranks": states}


def load_rank_state(loader: _RankedLoader, gathered: Mapping[str, Any]) -> None:
    """Load this rank's part of ``gathered`` (from
    [`gather_states`][loader_resume.distributed.gather_states]) into ``loader``.

    A map-style state may be resumed with another world size (the rest of the epoch is then spread
    over the new ranks); an iterable-dataset state only if its dataset defines ``reshard_states``
    (which then receives every old rank's workers' states, rank-major).
    """
    if not isinstance(gathered, Mapping) or set(gathered) != {"world_size", "ranks"}:
        raise StateError("<gathered>", gathered, "a dict with keys world_size, ranks",
                         "Pass what gather_states() returned.")
    saved_world, ranks = gathered["world_size"], gathered["ranks"]
    if type(ranks) is not list or len(ranks) != saved_world or not ranks:
        raise StateError(
            "ranks",
            ranks,
            f"a list of {saved_world} rank states",
            "The state was edited or corrupted.",
        )
    if saved_world == loader.world_size:
        loader.load_state_dict(ranks[loader.rank])
        return
    if all(isinstance(s, Mapping) and s.get("kind") == "map" for s in ranks):
        loader.load_state_dict(ranks[0])
        return
    reshard = getattr(loader, "load_resharded", None)
    if not callable(reshard):
        raise StateError("world_size", saved_world, repr(loader.world_size),
                         "This loader cannot re-shard an iterable dataset's per-rank state.")
    reshard(ranks)


class DCPLoaderState:
    """A loader as a ``torch.distributed.checkpoint`` ``Stateful``: every rank's state, in one
    value.

    ``dcp.load`` reads into the object's own ``state_dict()`` as a template, key by key, and keeps
    one copy of a non-tensor value that every rank saves under the same key. A loader's own state
    fits neither: a stream's states are per rank, and its shape changes as it runs (a worker's
    ``None`` becomes the dataset's state dict, which DCP then refuses: "Missing key in checkpoint").
    This holds what [`gather_states`][loader_resume.distributed.gather_states] returns — the same on
    every rank — as ``torch.save`` bytes under one key, and loads it through
    [`load_rank_state`][loader_resume.distributed.load_rank_state], so another world size resumes as
    it does there::

        dcp.save({"loader": DCPLoaderState(loader), ...}, checkpoint_id=path)   # every rank
        dcp.load({"loader": DCPLoaderState(loader), ...}, checkpoint_id=path)   # every rank

    ``state_dict()`` is a collective under ``torch.distributed`` (DCP calls it on every rank, when
    saving and, for the template, when loading). A map-style loader also works as a ``Stateful`` by
    itself.
    """

    KEY = "loader_resume"

    def __init__(self, loader: _RankedLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, bytes]:
        buffer = io.BytesIO()
        torch.save(gather_states(self.loader), buffer)
        return {self.KEY: buffer.getvalue()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = state_dict.get(self.KEY) if isinstance(state_dict, Mapping) else None
        if not isinstance(saved, bytes):
            raise StateError(
                self.KEY, type(saved).__name__, "bytes", "Save with DCPLoaderState(loader)."
            )
        load_rank_state(self.loader, torch.load(io.BytesIO(saved), weights_only=True))


def check_same_dataset(loader: _RankedLoader) -> None:
    """Raise ValueError unless every rank's loader reads the same map-style dataset (a collective:
    call it on every rank, once, after building the loader; the Lightning callback and the
    Accelerate hook do).

    The loader shards one whole dataset across ranks itself. A dataset already split per rank (HF
    ``split_dataset_by_node``, a per-rank ``Subset``) would be sharded a second time: each rank
    would see half of its half, silently. Compared: the dataset's type and length, and where the
    library keeps one, a content identity (HF ``datasets``' fingerprint). Two same-length splits of
    a dataset with no such identity cannot be told apart. Streams shard themselves and are not
    compared.
    """
    dataset = getattr(loader, "dataset", None)
    initialised = dist.is_available() and dist.is_initialized()
    if loader.world_size == 1 or not initialised or dist.get_world_size() != loader.world_size \
            or isinstance(dataset, IterableDataset):
        return
    size = len(dataset) if isinstance(dataset, Sized) else None
    mine = (type(dataset).__qualname__, size, content_identity(dataset))
    every: list[Any] = [None] * loader.world_size
    dist.all_gather_object(every, mine)
    if any(other != every[0] for other in every):
        raise ValueError(describe_difference(every))


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's [`global_rng_state`][loader_resume.global_rng_state], in rank order (a
    collective under ``torch.distributed``)."""
    state = global_rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    return gathered


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: one ``all_reduce`` under ``torch.distributed`` (call on
    all ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def collective_device() -> torch.device | None:
    """Where a tensor for a collective must live: the current CUDA device on an NCCL group, else the
    CPU.

    ``all_gather_object`` picks the same device by itself (torch's rule), so each rank must have
    called ``torch.cuda.set_device`` (Lightning, Accelerate and
    [`init_process_group`][loader_resume.distributed.init_process_group] do).
    """
    return (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in str(dist.get_backend())
        else None
    )


def init_process_group(backend: str = "gloo", timeout: timedelta = timedelta(minutes=30)) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment, safe across its
    restarts.

    NOTE: torchrun (torch 2.13, static and c10d rendezvous) hands every restarted attempt the same
    store, whose keys hold the previous attempt's addresses; gloo then sometimes connects to a dead
    worker ("connectFullMesh failed ... Connection refused") and the attempt fails, or hangs. So
    each rendezvous round gets keys of its own: its rank 0 draws a fresh *generation* from the store
    and every rank learns it (``_agree_on_generation``). ``TORCHELASTIC_RESTART_COUNT`` cannot
    serve: each agent counts only its own workers' failures, so after one node's worker crashes the
    two nodes' ranks would wait under different keys until the timeout. Outside torchrun (no
    ``TORCHELASTIC_RESTART_COUNT``) this is the plain ``env://`` initialisation. On an NCCL backend
    the CUDA device is set to ``LOCAL_RANK`` first (collectives use the current device).
    """
    if "nccl" in backend and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # NOTE: TCPStore and PrefixStore are public API, not re-exported for type checkers
    store = dist.TCPStore(  # type: ignore[attr-defined]
        address,
        port,
        world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    generation = _agree_on_generation(store, rank, world, timeout)
    prefix = f"loader_resume/generation_{generation}"
    prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)


_GENERATION = "loader_resume/generation"


def _agree_on_generation(store: Any, rank: int, world: int, timeout: timedelta) -> int:
    """A number every rank of this rendezvous round agrees on and no earlier round used.

    The store outlives rounds and holds their keys, and the ranks share no round number (each
    torchrun agent counts its own restarts). Every rank of an earlier round is dead before a new
    round starts, so: rank 0 takes the next value of a counter (fresh); every other rank posts a
    nonce of its own and waits for the answer addressed to that nonce (an answer to an earlier
    round's nonce cannot be mistaken for it); rank 0 answers each nonce it sees until every rank has
    acknowledged under the new generation (a key no earlier round could have written).
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_GENERATION}/hello/{rank}", nonce)
        store.wait([f"{_GENERATION}/welcome/{nonce}"], timeout)
        generation = int(store.get(f"{_GENERATION}/welcome/{nonce}"))
        store.set(f"{_GENERATION}/ack/{generation}/{rank}", nonce)
        return generation
    generation = int(store.add(f"{_GENERATION}/counter", 1))
    answered: dict[int, bytes] = {}
    waiting, deadline = set(range(1, world)), time.monotonic() + timeout.total_seconds()
    while waiting:
        for other in sorted(waiting):
            if store.check([f"{_GENERATION}/ack/{generation}/{other}"]):
                waiting.discard(other)
            elif store.check([f"{_GENERATION}/hello/{other}"]):
                nonce = store.get(f"{_GENERATION}/hello/{other}")
                # a stale nonce gets an answer nobody reads: harmless
                if answered.get(other) != nonce:
                    store.set(f"{_GENERATION}/welcome/{nonce.decode()}", str(generation))
                    answered[other] = nonce
        if waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"init_process_group: ranks {sorted(waiting)} of {world} did not join "
                    f"generation {generation} within {timeout}"
                )
            time.sleep(0.005)
    return generation
