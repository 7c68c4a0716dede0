"""Fixtures for the whole suite; shared datasets and launchers live in ``tests/support``."""

from __future__ import annotations

import pytest

from support.data import seed_all


@pytest.fixture(autouse=True)
def _global_seeds() -> None:
    """Tests start from fixed global RNGs, so a test that depends on unkeyed values fails loudly."""
    seed_all(1234)
