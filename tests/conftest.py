"""Fixtures for the whole suite; shared datasets and launchers live in ``tests/support``."""

from __future__ import annotations

import os

# NOTE: one torch (OpenMP) thread in this process and every process a test starts (they inherit the
# environment): the suite runs two test processes, each starting training processes and their
# DataLoader workers, on 2 CPUs, where two compute threads per process only fight over them (a step
# of the tests' small models: 20 ms at 2 threads, 0.6 ms at 1). Every comparison is between runs
# made the same way, so each still holds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from support.data import seed_all


@pytest.fixture(autouse=True)
def _global_seeds() -> None:
    """Tests start from fixed global RNGs, so a test that depends on unkeyed values fails loudly."""
    seed_all(1234)
