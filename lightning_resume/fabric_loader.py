"""What ``FabricResume`` hands back and keeps: the loader ``fabric.setup_dataloaders`` returns, its
reference inside a checkpoint's state, and how a process leaves after a preemption checkpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from loader_resume.convert import sharded_resumable
from loader_resume.job.checkpoint import CheckpointError
from loader_resume.job.step_boundary import ReportingDataLoader

from .callback import CHECKPOINT_KEY
from .stopping import leave_process

__all__ = ["FabricResumableDataLoader", "LoaderReference", "convert", "leave_launched_process",
           "loaded_into", "referenced"]


class FabricResumableDataLoader(ReportingDataLoader):
    """What ``fabric.setup_dataloaders`` returns under
    [`FabricResume`][lightning_resume.FabricResume]: a
    [`ResumableDataLoader`][loader_resume.ResumableDataLoader] sharded across Fabric's processes
    that moves batches to the device with ``fabric.to_device`` and reports batch requests (step
    boundaries)."""


class LoaderReference:
    """A loader of ``FabricResume`` inside the state given to ``fabric.save``/``fabric.load``: saved
    as a reference to the ``loader_resume`` entry, which holds every rank's state (loaded from
    there)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def state_dict(self) -> dict[str, Any]:
        return {CHECKPOINT_KEY: "loaders", "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (
            not isinstance(state, Mapping)
            or state.get(CHECKPOINT_KEY) != "loaders"
            or state.get("index") != self.index
        ):
            raise CheckpointError(
                f"the loader's entry holds {state!r}; expected a reference to checkpoint"
                f"['{CHECKPOINT_KEY}'] loader {self.index} (saved without FabricResume, or the "
                "loaders were set up in another order?)"
            )


def convert(
    loader: DataLoader[Any],
    fabric: Fabric,
    *,
    seed: int,
    keying: str,
    keyed_generators: Sequence[str],
    signals: Sequence[int],
    audit: str | None = None,
) -> FabricResumableDataLoader:
    """``loader`` as a ``FabricResumableDataLoader`` sharded for this rank; its workers ignore
    ``signals``. A collective (the ranks' datasets are compared)."""
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"setup_dataloaders(): {type(loader).__name__} is not a torch DataLoader; expected the "
            "DataLoader itself (not one already set up by Fabric)"
        )
    ours = sharded_resumable(loader, rank=fabric.global_rank, world_size=fabric.world_size,
                             loader_class=FabricResumableDataLoader, seed=seed, keying=keying,
                             keyed_generators=keyed_generators, ignore_signals=signals, audit=audit)
    return ours


def referenced(state: Mapping[str, Any], loaders: Sequence[Any]) -> dict[str, Any]:
    """``state`` with each of ``loaders`` replaced by a ``LoaderReference`` to its place in the
    entry."""
    ids = {id(loader): i for i, loader in enumerate(loaders)}
    return {
        key: LoaderReference(ids[id(value)]) if id(value) in ids else value
        for key, value in state.items()
    }


def loaded_into(state: dict[str, Any], given: Mapping[str, Any]) -> None:
    """What ``fabric.load`` put into ``given`` (``referenced(state, ...)``), back into the user's
    ``state``."""
    for key, value in given.items():  # Fabric's load updates plain values in the dict it is given
        original = state.get(key)
        # NOTE: Fabric's FSDP and model-parallel strategies, from a sharded checkpoint, put a
        # stateful object's state dict in its place (a scheduler would keep its fresh state): it
        # goes into the object instead
        if (
            isinstance(value, Mapping)
            and value is not original
            and hasattr(original, "load_state_dict")
        ):
            original.load_state_dict(value)  # type: ignore[union-attr]
        elif not isinstance(value, LoaderReference):
            state[key] = value


def leave_launched_process(fabric: Fabric, exit_code: int) -> None:
    """End this process with ``exit_code`` once every rank is here (all ranks call it): see
    ``leave_process``."""
    leave_process(fabric.barrier if fabric.world_size > 1 else None, fabric.global_rank, exit_code)


