"""The addressable permutation: a bijection for every n, chosen by the key, O(1) at any position."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_resume.order.permutation import KeyedPermutation


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), key=st.integers(0, 2**64 - 1))
def test_is_a_bijection_of_range_n(n: int, key: int) -> None:
    values = KeyedPermutation(n, key)[np.arange(n)]
    assert sorted(values.tolist()) == list(range(n))


def test_key_chooses_the_order() -> None:
    orders = {tuple(KeyedPermutation(100, key)[np.arange(100)].tolist()) for key in range(20)}
    assert len(orders) == 20


def test_positions_are_addressable_deep_in_a_huge_range() -> None:
    n = 10**12
    perm = KeyedPermutation(n, 3)
    deep = np.arange(n - 1000, n)
    values = perm[deep]
    assert ((values >= 0) & (values < n)).all() and len(set(values.tolist())) == 1000
    assert perm[deep[:10]].tolist() == values[:10].tolist()


def test_shuffle_is_not_close_to_identity() -> None:
    values = KeyedPermutation(10_000, 11)[np.arange(10_000)]
    fixed_points = int((values == np.arange(10_000)).sum())
    assert fixed_points < 20
    assert abs(float(np.corrcoef(values, np.arange(10_000))[0, 1])) < 0.05


def test_every_position_is_equally_likely_to_hold_every_index() -> None:
    """Over many keys, each (position, index) cell of a 16-permutation is hit ~1/16 of the time."""
    n, keys = 16, 16_000
    counts = np.zeros((n, n), dtype=np.int64)
    positions = np.arange(n)
    for key in range(keys):
        counts[positions, KeyedPermutation(n, key)[positions]] += 1
    expected, sigma = keys / n, (keys * (1 / n) * (1 - 1 / n)) ** 0.5
    assert np.abs(counts - expected).max() < 5 * sigma, counts


def _reference(n: int, key: int, position: int) -> int:
    """The permutation written out in plain integers, one position at a time (the definition the
    vectorised, tabulated code must keep: checkpoints of every earlier version resume in this
    order)."""
    import hashlib

    half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
    words = hashlib.shake_256(key.to_bytes(16, "little")).digest(96)
    xors = [int.from_bytes(words[8 * i : 8 * i + 8], "little") for i in range(6)]
    multipliers = [int.from_bytes(words[48 + 8 * i : 56 + 8 * i], "little") | 1 for i in range(6)]
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for xor, multiplier in zip(xors, multipliers, strict=True):
            left, right = (
                right,
                left ^ ((((right ^ xor) * multiplier) & (2**64 - 1)) >> (64 - half)),
            )
        x = (left << half) | right
        if x < n:
            return x


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(1, 5000), st.integers(1, 2**40)), key=st.integers(0, 2**64 - 1),
       seed=st.integers(0, 2**32 - 1))
def test_values_are_those_of_the_plain_integer_definition(n: int, key: int, seed: int) -> None:
    """Both code paths (lookup tables up to n = 2^32, 64-bit arithmetic above) against the
    definition."""
    positions = np.random.default_rng(seed).integers(0, n, size=50)
    assert KeyedPermutation(n, key)[positions].tolist() == [
        _reference(n, key, int(p)) for p in positions
    ]


@pytest.mark.parametrize(
    "n", [0, 1, 2, 3, 255, 256, 257, 4_096, 4_097, 16_384, 16_385, 65_536, 65_537]
)
def test_whole_and_walked_lookups_give_the_definitions_values_at_the_domain_edges(n: int) -> None:
    """Up to a domain of 2^14 values the whole permutation is computed at the first lookup; above,
    position by position: on both sides of that edge and of the domain's own edges, the values are
    the definition's, in any order of lookup, and the whole range is a bijection."""
    key = 0x5EED + n
    positions = np.random.default_rng(n).integers(0, max(n, 1), size=40 if n else 0)
    perm = KeyedPermutation(n, key)
    assert perm[positions].tolist() == [_reference(n, key, int(p)) for p in positions]
    assert (
        perm[positions[::-1].reshape(-1, 8)].reshape(-1).tolist() == perm[positions][::-1].tolist()
    )
    assert sorted(KeyedPermutation(n, key)[np.arange(n)].tolist()) == list(range(n))


@pytest.mark.parametrize("n", [4_097, 16_384])
def test_every_position_of_a_whole_permutation_is_the_definitions_and_lookups_return_copies(
    n: int,
) -> None:
    perm = KeyedPermutation(n, 77)
    values = perm[np.arange(n)]
    assert values.tolist() == [_reference(n, 77, p) for p in range(n)]
    values[:] = 0  # a caller writing into what it got changes nothing a later lookup returns
    assert perm[np.arange(n)].tolist() == [_reference(n, 77, p) for p in range(n)]
