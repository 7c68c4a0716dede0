"""The process's generators in a checkpoint: torch's CPU generator, numpy's and Python's, and every
accelerator's, as plain values and tensors (a checkpoint holding them loads with
``weights_only=True``)."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

__all__ = ["global_rng_state", "set_global_rng_state"]

logger = logging.getLogger(__name__)


def global_rng_state() -> dict[str, Any]:
    """torch's default CPU generator, numpy's legacy global and Python's ``random`` states, and
    every accelerator generator this process has: ``"cuda"`` (one state per visible CUDA device) and
    ``"mps"``, present only where the device is.

    Plain values and tensors only, so a checkpoint holding it loads with ``weights_only=True``
    (Lightning 2.6 and our own loaders load that way). On a GPU, dropout draws from the CUDA
    generators, so resuming the model's random sequence needs them as much as the CPU one.
    """
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    numpy_state = {
        "kind": kind,
        "key": torch.from_numpy(np.asarray(key).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": numpy_state,
        "random": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            torch.cuda.get_rng_state(device) for device in range(torch.cuda.device_count())
        ]
    if _mps_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Restore what [`global_rng_state`][loader_resume.global_rng_state] returned.

    CUDA states are restored only onto as many visible CUDA devices as were saved (device ``i`` gets
    saved state ``i``); otherwise they are left alone with a warning that names both counts, since a
    state for another device layout would continue another device's sequence. Likewise ``"mps"``.
    """
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    key = saved["key"].numpy().astype(np.uint32)
    np.random.set_state((saved["kind"], key, saved["pos"], saved["has_gauss"], saved["gauss"]))
    random.setstate(state["random"])
    cuda = state.get("cuda")
    if cuda is not None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == len(cuda):
            for device, device_state in enumerate(cuda):
                torch.cuda.set_rng_state(device_state, device)
        else:
            logger.warning(
                "RNG state: saved for %d CUDA device(s), this process sees %d; the CUDA generators "
                "are NOT restored (GPU dropout will not continue the saved sequence; run with the "
                "same CUDA_VISIBLE_DEVICES layout to restore them)",
                len(cuda),
                visible,
            )
    mps = state.get("mps")
    if mps is not None:
        if _mps_available():
            torch.mps.set_rng_state(mps)
        else:
            logger.warning(
                "RNG state: saved with an MPS generator, this process has no MPS device; not "
                "restored"
            )


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return backend is not None and bool(backend.is_available())
