"""Accelerate's sharded optimizer load under torch's first FSDP, made whole.

With ``FullyShardedDataParallelPlugin(fsdp_version=1)`` and a sharded state dict
(``SHARDED_STATE_DICT``, ``LOCAL_STATE_DICT``), ``accelerator.load_state`` reads each optimizer
through ``torch.distributed.checkpoint`` into a template made from the optimizer's current state,
and reads nothing that the template lacks. torch's optimizers make their state (SGD's momentum,
Adam's moments and step) at their first step, so an optimizer loaded before training has none: the
checkpoint's optimizer state is silently dropped, and the resumed run diverges from the
uninterrupted one at its first step. ``load_state`` after ``enable_resume`` therefore first makes
the state of each such optimizer whose checkpoint holds one (a step with zero gradients at learning
rate 0, as ``torch.distributed.checkpoint.state_dict`` does for the second FSDP), so that the load
fills every entry.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

logger = logging.getLogger(__name__)


def optimizers_missing_state(accelerator: Accelerator,
                             input_dir: str | os.PathLike[str]) -> list[torch.optim.Optimizer]:
    """The optimizers (torch's, unwrapped) that ``accelerator.load_state(input_dir)`` would leave
    without the state their checkpoint holds: torch's first FSDP, a sharded state dict, no state
    yet."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return []
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 1 or "FULL" in str(plugin.state_dict_type):
        return []
    missing = []
    for index, prepared in enumerate(getattr(accelerator, "_optimizers", [])):
        # Accelerate's AcceleratedOptimizer wraps torch's
        optimizer = getattr(prepared, "optimizer", prepared)
        if not optimizer.state and holds_optimizer_state(Path(input_dir) / f"optimizer_{index}"):
            missing.append(optimizer)
    return missing


def holds_optimizer_state(directory: Path) -> bool:
    """Whether the ``torch.distributed.checkpoint`` directory Accelerate wrote for an optimizer has
    state entries (momentum, moments), not only parameter groups."""
    if not (directory / ".metadata").is_file():
        return False
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(os.fspath(directory)).read_metadata().state_dict_metadata
    return any(key.startswith("optimizer.state.") for key in keys)


def make_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state without changing a parameter: one step with zero gradients at
    learning rate 0; the gradients and learning rates it had are put back. What the step wrote (zero
    momentum, a step count of
    1) is overwritten by the load that follows."""
    groups: list[dict[str, Any]] = optimizer.param_groups
    params = [p for group in groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    rates = [group.get("lr") for group in groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in groups:
            if "lr" in group:
                group["lr"] = (
                    torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
                )
        optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for group, rate in zip(groups, rates, strict=True):
            if rate is not None:
                group["lr"] = rate


def fill_before_load(accelerator: Accelerator, input_dir: str | os.PathLike[str] | None) -> None:
    """Before ``load_state(input_dir)``: make the state of every optimizer the load would leave
    without it (``None``: the newest of Accelerate's automatically named checkpoints, as
    ``load_state`` picks it)."""
    if input_dir is None:
        automatic = Path(accelerator.project_dir or ".") / "checkpoints"
        if (
            not accelerator.project_configuration.automatic_checkpoint_naming
            or not automatic.is_dir()
        ):
            return
        numbered = [(int(found[0]), path) for path in automatic.iterdir()
                    if (found := re.findall(r"[0-9]+", path.name))]
        if not numbered:
            return
        input_dir = max(numbered)[1]
    for optimizer in optimizers_missing_state(accelerator, input_dir):
        make_state(optimizer)
        logger.info(
            "made the optimizer's state before loading its sharded FSDP checkpoint from %s "
            "(Accelerate reads into the state the optimizer already has, and before its first step "
            "it has none)",
            input_dir,
        )


def filling_load_state(accelerator: Accelerator) -> Callable[..., Any]:
    """``accelerator.load_state`` (Accelerate's own, bound now) that first makes the state of every
    optimizer the load would leave without it: what ``enable_resume`` puts on the instance, for
    every load, ours and the user's own."""
    load_state = accelerator.load_state

    def filling(input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        fill_before_load(accelerator, input_dir)
        return load_state(input_dir, *args, **kwargs)

    return filling
