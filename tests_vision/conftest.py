"""The vision suite runs in its own venv (torchvision, Mosaic Streaming; no Lightning: torchvision's
presence breaks ``import lightning`` on CPU torch). torchvision is made importable on CPU torch
first."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchvision_cpu  # noqa: F401  (before anything imports torchvision)


@pytest.fixture(autouse=True)
def _global_seeds() -> None:
    """Tests start from fixed global RNGs, so a test that depends on unkeyed values fails loudly."""
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
