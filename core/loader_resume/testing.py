"""Prove a pipeline resumes exactly: ``assert_resumes_exactly(make_loader)``.

Runs the uninterrupted sequence, takes the state before the first batch and after every batch (so an
epoch's last batch and the epoch boundary are included), restores each into a fresh loader and
checks that the rest of the run is bit-identical. It also checks that a loaded state reads back
unchanged, that get/set/get is idempotent, that the state keeps one shape throughout, and that the
states the resumed run takes resume exactly too (a job cut twice). With ``round_trip``, each state
first goes where checkpoints go (JSON, ``torch.save`` loaded with ``weights_only=True``,
``torch.distributed.checkpoint``, another process). Use it on your own pipelines; our test suite
uses it everywhere.
"""

from __future__ import annotations

import copy
import hashlib
import io
import multiprocessing
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import torch

from loader_resume.round_trips import load_through_dcp, through

__all__ = [
    "ROUND_TRIPS",
    "ResumeReport",
    "StatefulLoader",
    "assert_delivers_rest_exactly_once",
    "assert_resumes_exactly",
    "fingerprint",
    "run_epochs",
]

ROUND_TRIPS: Final = ("copy", "json", "torch", "dcp", "process")
"""Where ``assert_resumes_exactly`` sends each state before the resumed loader gets it:

- ``"copy"``: a deep copy (the default);
- ``"json"``: ``json.dumps`` and back (the state is plain data);
- ``"torch"``: ``torch.save`` and ``torch.load(weights_only=True)`` (what framework checkpoints do);
- ``"dcp"``: ``torch.distributed.checkpoint.save`` of the state, then ``load`` into the resumed
  loader as a ``Stateful`` (DCP reads into the fresh loader's own ``state_dict()`` as its template,
  so a state whose user parts change shape between a fresh loader and a running one fails here: wrap
  such a loader in ``loader_resume.distributed.DCPLoaderState``);
- ``"process"``: ``torch.save`` bytes resumed in another, spawned process (``make_loader`` must then
  be picklable: a module-level function or a ``functools.partial`` of one)."""


class StatefulLoader(Protocol):
    def __iter__(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def fingerprint(batch: Any) -> str:
    """A stable hex digest of every tensor, array, number and string in ``batch`` (dtype and shape
    too)."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, batch)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, np.ndarray):
        digest.update(
            f"A{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
        )
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
    """What [`assert_resumes_exactly`][loader_resume.testing.assert_resumes_exactly] checked."""

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
    round_trip: str = "copy",
    after_batch: Callable[[Any, int], None] | None = None,
) -> ResumeReport:
    """Raise AssertionError unless every saved state resumes the exact rest of the run.

    Args:
        make_loader: builds a fresh loader; called once for the reference and once per cut.
        epochs: epochs in the reference run.
        cuts: batch counts after which to cut (0 = before the first batch); default: every one.
        make_resumed: builds the loader that resumes (default ``make_loader``): pass another
            ``num_workers`` or batch size here to prove the state is portable.
        round_trip: where each state goes before it is loaded, one of
            [`ROUND_TRIPS`][loader_resume.testing.ROUND_TRIPS].
        after_batch: called after each batch with the loader and the batches delivered so far (over
            all epochs), in the reference run and in every resumed one (counting on from the cut),
            before any state is taken: a run's per-step calls, such as ``Mixture.set_weights``
            (picklable with ``round_trip="process"``).
    """
    if round_trip not in ROUND_TRIPS:
        raise ValueError(f"round_trip={round_trip!r}: expected one of {list(ROUND_TRIPS)}")
    reference = make_loader()
    records: list[tuple[int, str]] = []
    states = [copy.deepcopy(reference.state_dict())]
    epoch_ends: list[tuple[int, dict[str, Any]]] = []
    for epoch in range(epochs):
        for batch in reference:
            records.append((epoch, fingerprint(batch)))
            if after_batch is not None:
                after_batch(reference, len(records))
            states.append(copy.deepcopy(reference.state_dict()))
        ended = copy.deepcopy(reference.state_dict())
        if fingerprint(ended) != fingerprint(states[-1]):
            # NOTE: a stream only learns it is spent when asked for more, so its state after the
            # last batch ("maybe more in this epoch") and after the epoch ended differ; both must
            # resume.
            epoch_ends.append((len(records), ended))
    chosen = tuple(range(len(records) + 1)) if cuts is None else tuple(cuts)
    checks = [(cut, states[cut]) for cut in chosen]
    checks += [(cut, ended) for cut, ended in epoch_ends if cuts is None or cut in chosen]
    make = make_resumed or make_loader
    pool = (
        ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        if round_trip == "process"
        else None
    )
    try:
        for cut, state in checks:
            if _shape(state) != _shape(states[0]):
                raise AssertionError(
                    f"cut {cut}: state shape changed: {_shape(state)} vs {_shape(states[0])}"
                )
            fallback = records[cut][0] if cut < len(records) else epochs
            if pool is not None:
                saved = io.BytesIO()
                torch.save(state, saved)
                outcome = pool.submit(_resume_from_bytes, make, saved.getvalue(), epochs, fallback,
                                      (after_batch, cut)).result()
            else:
                outcome = _resume(
                    make,
                    through(state, round_trip),
                    epochs,
                    fallback,
                    dcp=round_trip == "dcp",
                    calls=(after_batch, cut),
                )
            _check_cut(outcome, records, cut, make_resumed is None)
            if make_resumed is None:
                _check_later(make, outcome[4], states, records, cut, epochs, after_batch)
    finally:
        if pool is not None:
            pool.shutdown()
    return ResumeReport(batches=len(records), cuts=chosen)


_Outcome = tuple[
    dict[str, Any], dict[str, Any], dict[str, Any], list[tuple[int, str]], list[dict[str, Any]]
]
"""(the state as loaded, after its round trip; the state read back after the load; the state a
second loader loaded from that reads back; the rest of the run; the state after each of its
batches)."""


_Calls = tuple[Callable[[Any, int], None] | None, int]
"""``after_batch`` and the batches delivered before the cut."""


def _resume_from_bytes(make: Callable[[], StatefulLoader], saved: bytes, epochs: int, fallback: int,
                       calls: _Calls) -> _Outcome:
    """In another process: the state as ``torch.load(weights_only=True)`` reads it there,
    resumed."""
    return _resume(
        make,
        torch.load(io.BytesIO(saved), weights_only=True),
        epochs,
        fallback,
        dcp=False,
        calls=calls,
    )


def _resume(make: Callable[[], StatefulLoader], state: dict[str, Any], epochs: int, fallback: int,
            *, dcp: bool, calls: _Calls) -> _Outcome:
    resumed = make()
    if dcp:
        load_through_dcp(resumed, state)
    else:
        resumed.load_state_dict(state)
    read_back = copy.deepcopy(resumed.state_dict())
    again = make()
    again.load_state_dict(copy.deepcopy(read_back))
    # NOTE: an iterable stream cannot know it is spent until it is asked for more, so a state taken
    # after its last batch says "still in this epoch"; the loader's own epoch says where it resumes.
    first_epoch = getattr(resumed, "epoch", fallback)
    after_batch, delivered = calls
    rest, later = [], []
    for epoch in range(first_epoch, epochs):
        for batch in resumed:
            rest.append((epoch, fingerprint(batch)))
            if after_batch is not None:
                after_batch(resumed, delivered + len(rest))
            # NOTE: what a resume of this resumed run loads
            later.append(copy.deepcopy(resumed.state_dict()))
    return state, read_back, again.state_dict(), rest, later


def _check_cut(
    outcome: _Outcome, records: list[tuple[int, str]], cut: int, same_build: bool
) -> None:
    loaded, read_back, again, rest, _ = outcome
    if same_build:  # a loader built differently (other num_workers) may record its own settings
        _same(read_back, loaded, f"cut {cut}: state read back after load_state_dict")
    _same(again, read_back, f"cut {cut}: get/set/get")
    expected = records[cut:]
    for offset, (got, want) in enumerate(zip(rest, expected, strict=False)):
        if got != want:
            raise AssertionError(
                f"cut {cut}: batch {cut + offset} (epoch {want[0]}) differs after resume"
            )
    if len(rest) != len(expected):
        raise AssertionError(
            f"cut {cut}: resumed run gave {len(rest)} batches, uninterrupted run {len(expected)}"
        )


def _check_later(
    make: Callable[[], StatefulLoader],
    later: list[dict[str, Any]],
    states: list[dict[str, Any]],
    records: list[tuple[int, str]],
    cut: int,
    epochs: int,
    after_batch: Any,
) -> None:
    """The states the resumed run took are the uninterrupted run's; at the first that is not (a
    library's own state may record its read-ahead otherwise), a second resume, from it, must
    continue the run exactly."""
    for at, state in enumerate(later, cut + 1):
        if fingerprint(state) != fingerprint(states[at]):
            fallback = records[at][0] if at < len(records) else epochs
            rest = _resume(
                make, copy.deepcopy(state), epochs, fallback, dcp=False, calls=(after_batch, at)
            )[3]
            if rest != records[at:]:
                raise AssertionError(
                    f"cut {cut}, then again after batch {at - 1}: the resumed run's state there "
                    "does not continue the run (a second resume repeats or skips batches)"
                )
            return


def _same(got: Any, want: Any, what: str) -> None:
    if fingerprint(got) != fingerprint(want):
        raise AssertionError(f"{what}: {got!r} != {want!r}")


def _shape(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _shape(item) for key, item in value.items()}
    return type(value).__name__


def assert_delivers_rest_exactly_once(
    before: Iterable[int], after: Iterable[int], n: int, *, padding: int = 0
) -> None:
    """The samples delivered before a cut and after the resume (any ranks, any world size, in any
    order) make up one epoch of ``range(n)``: none lost, none twice — up to ``padding`` repeats
    allowed (the padding of an epoch's last step without ``drop_last``). Raises AssertionError
    naming what was lost or repeated.

    For resumes whose batches are composed differently from the uninterrupted run's (another world
    size, batch size or worker count), where
    [`assert_resumes_exactly`][loader_resume.testing.assert_resumes_exactly] cannot compare batch by
    batch.
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
