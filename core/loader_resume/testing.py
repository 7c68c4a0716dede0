"""Prove a pipeline resumes exactly: ``assert_resumes_exactly(make_loader)``.

Runs the uninterrupted sequence, takes the state before the first batch and after every batch (so
an epoch's last batch and the epoch boundary are included), restores each into a fresh loader and
checks that the rest of the run is bit-identical. It also checks that a loaded state reads back
unchanged, that get/set/get is idempotent and that the state keeps one shape throughout. Use it on
your own pipelines; our test suite uses it everywhere.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "ResumeReport", "StatefulLoader", "assert_delivers_rest_exactly_once", "assert_resumes_exactly", "fingerprint",
    "run_epochs",
]


class StatefulLoader(Protocol):
    def __iter__(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def fingerprint(batch: Any) -> str:
    """A stable hex digest of every tensor, array, number and string in ``batch`` (dtype and shape too)."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, batch)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{type(value).__name__}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def run_epochs(loader: Iterable[Any], epochs: int, first_epoch: int = 0) -> list[tuple[int, str]]:
    """``(epoch, fingerprint)`` of every batch of ``epochs`` passes over ``loader``."""
    return [(epoch, fingerprint(batch)) for epoch in range(first_epoch, epochs) for batch in loader]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeReport:
    """What :func:`assert_resumes_exactly` checked."""

    batches: int
    """Batches in the uninterrupted run."""
    cuts: tuple[int, ...]
    """Cut points checked: the number of batches delivered before each saved state."""


def assert_resumes_exactly(
    make_loader: Callable[[], StatefulLoader],
    *,
    epochs: int = 2,
    cuts: Sequence[int] | None = None,
    make_resumed: Callable[[], StatefulLoader] | None = None,
) -> ResumeReport:
    """Raise AssertionError unless every saved state resumes the exact rest of the run.

    Args:
        make_loader: builds a fresh loader; called once for the reference and once per cut.
        epochs: epochs in the reference run.
        cuts: batch counts after which to cut (0 = before the first batch); default: every one.
        make_resumed: builds the loader that resumes (default ``make_loader``): pass another
            ``num_workers`` or batch size here to prove the state is portable.
    """
    reference = make_loader()
    records: list[tuple[int, str]] = []
    states = [copy.deepcopy(reference.state_dict())]
    epoch_ends: list[tuple[int, dict[str, Any]]] = []
    for epoch in range(epochs):
        for batch in reference:
            records.append((epoch, fingerprint(batch)))
            states.append(copy.deepcopy(reference.state_dict()))
        ended = copy.deepcopy(reference.state_dict())
        if fingerprint(ended) != fingerprint(states[-1]):
            # NOTE: a stream only learns it is spent when asked for more, so its state after the last
            # batch ("maybe more in this epoch") and after the epoch ended differ; both must resume.
            epoch_ends.append((len(records), ended))
    chosen = tuple(range(len(records) + 1)) if cuts is None else tuple(cuts)
    make = make_resumed or make_loader
    for cut in chosen:
        _check_cut(make, states[cut], states[0], records, cut, epochs, make_resumed is None)
    for cut, ended in epoch_ends:
        if cuts is None or cut in chosen:
            _check_cut(make, ended, states[0], records, cut, epochs, make_resumed is None)
    return ResumeReport(batches=len(records), cuts=chosen)


def _check_cut(
    make: Callable[[], StatefulLoader], state: dict[str, Any], initial: dict[str, Any],
    records: list[tuple[int, str]], cut: int, epochs: int, same_build: bool,
) -> None:
    if _shape(state) != _shape(initial):
        raise AssertionError(f"cut {cut}: state shape changed: {_shape(state)} vs {_shape(initial)}")
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(state))
    read_back = resumed.state_dict()
    if same_build:  # a loader built differently (other num_workers) may record its own settings
        _same(read_back, state, f"cut {cut}: state read back after load_state_dict")
    again = make()
    again.load_state_dict(copy.deepcopy(read_back))
    _same(again.state_dict(), read_back, f"cut {cut}: get/set/get")
    # NOTE: an iterable stream cannot know it is spent until it is asked for more, so a state taken
    # after its last batch says "still in this epoch"; the loader's own epoch says where it resumes.
    first_epoch = getattr(resumed, "epoch", records[cut][0] if cut < len(records) else epochs)
    rest = run_epochs(resumed, epochs, first_epoch)
    expected = records[cut:]
    for offset, (got, want) in enumerate(zip(rest, expected, strict=False)):
        if got != want:
            raise AssertionError(f"cut {cut}: batch {cut + offset} (epoch {want[0]}) differs after resume")
    if len(rest) != len(expected):
        raise AssertionError(f"cut {cut}: resumed run gave {len(rest)} batches, uninterrupted run {len(expected)}")


def _same(got: Any, want: Any, what: str) -> None:
    if fingerprint(got) != fingerprint(want):
        raise AssertionError(f"{what}: {got!r} != {want!r}")


def _shape(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _shape(item) for key, item in value.items()}
    return type(value).__name__


def assert_delivers_rest_exactly_once(before: Iterable[int], after: Iterable[int], n: int, *, padding: int = 0) -> None:
    """The samples delivered before a cut and after the resume (any ranks, any world size, in any order)
    make up one epoch of ``range(n)``: none lost, none twice — up to ``padding`` repeats allowed (the padding
    of an epoch's last step without ``drop_last``). Raises AssertionError naming what was lost or repeated.

    For resumes whose batches are composed differently from the uninterrupted run's (another world size,
    batch size or worker count), where :func:`assert_resumes_exactly` cannot compare batch by batch.
    """
    delivered = [*before, *after]
    counts: dict[int, int] = {}
    for sample in delivered:
        counts[sample] = counts.get(sample, 0) + 1
    lost = sorted(set(range(n)) - set(counts))
    foreign = sorted(set(counts) - set(range(n)))
    repeats = sum(count - 1 for count in counts.values())
    problems = []
    if lost:
        problems.append(f"{len(lost)} sample(s) never delivered: {lost[:10]}")
    if foreign:
        problems.append(f"sample(s) outside range({n}): {foreign[:10]}")
    if repeats > padding:
        twice = sorted(sample for sample, count in counts.items() if count > 1)
        problems.append(f"{repeats} repeat(s), {padding} allowed as padding: {twice[:10]}")
    assert not problems, "the epoch was not delivered exactly once: " + "; ".join(problems)
