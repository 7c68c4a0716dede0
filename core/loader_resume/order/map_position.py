"""Map-style data: the position is a count of global samples delivered in one keyed global order.

The order of an epoch is a function of ``(seed, epoch)`` (our permutation) or of the user's sampler;
each global step takes ``world * batch`` units of it (``loader_resume.order.sampler``). So the
position is the same number on every rank, and a resume at another world size, batch size or worker
count continues there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from loader_resume.audit.log import map_pass, map_step
from loader_resume.keyed.keyed_fetch import NextFetch
from loader_resume.keyed.worker_fetch import SeedAheadCollate
from loader_resume.load_warnings import warn_sampler_left
from loader_resume.order.index_plan import Pending, Plan, plan_indices
from loader_resume.order.mixture import Mixture
from loader_resume.order.out_of_order import OutOfOrder, checked_ahead
from loader_resume.order.sampler import Order, steps_per_epoch
from loader_resume.order.split_check import SplitCheck
from loader_resume.position import PassStart, Setup, tell_epoch
from loader_resume.state import StateError
from loader_resume.thirdparty import is_stateful

__all__ = ["MapPass", "MapPosition", "NextPass"]


@dataclass(frozen=True, slots=True)
class NextPass:
    """Where the next ``iter()`` over map-style data starts (the one value that decides it):
    ``epoch`` at global sample ``position``, a user sampler's state to load first, and the steps
    delivered past ``position`` (``in_order=False``) to skip. A load sets it; a pass, as it begins,
    leaves the start of the next epoch."""

    epoch: int
    position: int = 0
    sampler_state: Any = None
    ahead: frozenset[int] = frozenset()


class MapPass:
    """One ``iter()`` over map-style data: where it starts, and the steps produced but not yet
    delivered."""

    __slots__ = ("audited", "done", "epoch", "out_of_order", "pending", "sampler_state", "start")

    def __init__(self, epoch: int, start: int, sampler_state: Any = None,
                 out_of_order: OutOfOrder | None = None) -> None:
        self.epoch, self.start, self.done = epoch, start, False
        self.sampler_state = sampler_state
        """A user sampler's state to load before it is iterated (a resume), else None."""
        self.pending: deque[Pending] = deque()
        self.out_of_order = out_of_order
        """``in_order=False`` with workers: the steps, delivered in any order (else ``pending``, in
        order)."""
        # audit=DIR, a user sampler: the ids of each step in `pending`
        self.audited: deque[list[Any]] | None = None


class MapPosition:
    """Epoch and global samples delivered; see ``loader_resume.position.Position`` for the
    interface."""

    kind = "map"

    def __init__(self, setup: Setup, order: Order) -> None:
        """``order``: what orders the units (the user's sampler or batch sampler, or our keyed
        permutation)."""
        self.setup, self.sampler, self.shuffle = setup, order.sampler, order.shuffle
        """The user's sampler or batch sampler that orders the units (None: our keyed
        permutation)."""
        self.unit_is_batch = order.unit_is_batch
        self._n: int | None = len(setup.dataset) if hasattr(setup.dataset, "__len__") else None
        self._pool_epoch: int | None = None  # the epoch a persistent worker pool was told
        self._restart = False  # a loaded dataset state: a persistent pool's copies are stale
        settings = (setup.batch_size, setup.seed, order.shuffle, setup.drop_last)
        self._split_check: SplitCheck | None = SplitCheck(setup.dataset, settings)
        # (sampler, dataset): read once a pass, at its first state()
        self._stateful: tuple[bool, bool] | None = None
        self._warned_left = False  # warn_sampler_left said once
        self._mixture = setup.dataset if isinstance(setup.dataset, Mixture) else None
        if self._mixture is not None and (order.shuffle or order.sampler is not None):
            raise ValueError(
                "ResumableDataLoader over a Mixture: expected shuffle=False and no sampler (a "
                "Mixture orders its samples itself, and its weight changes apply from a position "
                "in that order)"
            )
        self.next_fetch = NextFetch()
        """Where the index plan records each list's key for the fetch in this process
        (``num_workers=0``)."""
        self.reset(None)

    # --- Position --------------------------------------------------------------------------------
    def reset(self, state: Mapping[str, Any] | None) -> None:
        epoch, position, sampler_state, restart, ahead = 0, 0, None, False, list[int]()
        # validated by check_state; the user's own states are checked here, before any change
        if state is not None:
            # the length the state was checked against (a dataset may grow between epochs)
            self._read_length()
            _check_user_state("sampler_state", state["sampler_state"], self.sampler)
            _check_user_state("dataset_state", state["dataset_state"], self.setup.dataset)
            if state["dataset_state"] is not None:
                self.setup.dataset.load_state_dict(state["dataset_state"])
                restart = True  # persistent workers hold copies of the old dataset
            epoch, position, sampler_state = (
                state["epoch"],
                state["position"],
                state["sampler_state"],
            )
            ahead = checked_ahead(state, self.setup)
            if self.sampler is None and position == self._n:
                epoch, position = epoch + 1, 0
        # NOTE: nothing past the loaded position is requested
        if self._mixture is not None and state is not None:
            self._mixture.requested(epoch, position)  # yet: changes apply there
        self._pass: MapPass | None = None
        self._restart = self._restart or restart
        # what a state reports now
        self.epoch, self._samples, self._sampler_state = epoch, position, sampler_state
        self._next = NextPass(epoch, position, sampler_state, frozenset(ahead))

    def begin(
        self, collate_fn: Callable[[Any], Any], worker_init_fn: Callable[[int], None] | None
    ) -> PassStart:
        # under torch.distributed: a dataset split per rank is refused
        if self._split_check is not None:
            shard = self.setup.shard()
            self._split_check = self._split_check.at_iter(shard.rank, shard.world)
        start = self._next
        self.epoch, self._samples = start.epoch, start.position
        if self._samples == 0:
            self._read_length()
        told = tell_epoch(self.setup.dataset, self.epoch)
        restart, self._restart = self._restart, False
        if told and self.setup.persistent_workers and self._pool_epoch != self.epoch:
            # NOTE: persistent workers keep the dataset copies they started with; a dataset that is
            # told its epoch gets a fresh pool each epoch, so every worker's copy is told too.
            restart, self._pool_epoch = True, self.epoch
        self._stateful = None
        numbered = not self.setup.in_order and self.setup.num_workers > 0
        skip = start.ahead
        # NOTE: a pass left mid-epoch ends its epoch: the iter() after it starts the next one (set
        # once nothing above can raise: a failed iter() leaves the start where it was)
        self._next = NextPass(start.epoch + 1)
        # NOTE: with no workers batches come in order, but the steps delivered ahead before a resume
        # are still skipped
        self._pass = MapPass(self.epoch, self._samples, start.sampler_state,
                             OutOfOrder(skip) if numbered or skip else None)
        if (
            map_pass(self.setup, self.epoch, self._samples, self.sampler, self._n)
            and self.sampler is not None
        ):
            # a user sampler's ids are recorded (ours follow from the positions)
            self._pass.audited = deque()
        collate = _Unbatch(collate_fn) if self.setup.unbatched else collate_fn
        if self.setup.seeds_ahead:
            collate = SeedAheadCollate(collate)
        return PassStart(self._pass, {"collate_fn": collate}, restart)

    def deliver(self, pass_: MapPass, item: Any, number: int | None = None) -> Any:
        if pass_ is self._pass:
            if pass_.out_of_order is not None:
                pass_.out_of_order.deliver(
                    number, lambda end, last, state: self._advance(pass_, end, last, state)
                )
                return item
            end, last, self._sampler_state = pass_.pending.popleft()
            if self.setup.audit is not None:
                map_step(self.setup, pass_, self._samples, end, last)
            self._samples = end
            if last:
                self._next_epoch(pass_)
        return item

    def _advance(self, pass_: MapPass, end: int, last: bool, sampler_state: Any) -> None:
        self._samples, self._sampler_state = end, sampler_state
        if last:
            self._next_epoch(pass_)

    def end(self, pass_: MapPass) -> None:
        if pass_ is self._pass and not pass_.done:
            self._next_epoch(pass_)

    def progress(self) -> tuple[int, int | None]:
        shard = self.setup.shard()
        unit = shard.world if self.unit_is_batch else shard.step
        # NOTE: a user's sampler may have none
        known = self.sampler is None or hasattr(self.sampler, "__len__")
        return -(-self._samples // unit), self.batches_per_epoch() if known else None

    def state(self, batches_ago: int = 0, pass_ended: bool = False) -> dict[str, Any]:
        if batches_ago:
            raise ValueError(
                f"batches_ago={batches_ago}: map-style states are exact at the last delivered "
                "batch; frameworks do not fetch ahead of sized loaders"
            )
        pass_ = self._pass
        live = pass_ is not None and not pass_.done
        # NOTE: where the next iter() starts (a loop that leaves this pass on purpose)
        state: dict[str, Any]
        if pass_ended and live:
            start = self._next
            state = {"epoch": start.epoch, "position": start.position}
            if not self.setup.in_order:
                state["ahead"] = sorted(start.ahead)
        else:
            state = {"epoch": self.epoch, "position": self._samples}
            if not self.setup.in_order:
                order = pass_.out_of_order if live else None  # type: ignore[union-attr]
                if order is not None:
                    state["ahead"] = order.ahead(self._samples)
                else:
                    state["ahead"] = sorted(self._next.ahead)
        sampler_stateful, dataset_stateful = self._stateful or self._stateful_flags()
        if sampler_stateful:
            if pass_ended and live:
                self._warn_sampler_left()
                state["sampler_state"] = self.sampler.state_dict()
            else:
                state["sampler_state"] = self._current_sampler_state()
        if dataset_stateful:
            state["dataset_state"] = self.setup.dataset.state_dict()
        return state

    def batches_per_epoch(self) -> int:
        total = self.dataset_len() if self.sampler is None else len(self.sampler)
        assert total is not None  # our permutation is only chosen for sized datasets
        return steps_per_epoch(total, self.setup.shard())

    def dataset_len(self) -> int | None:
        """The length the pass in flight was planned with, else (between passes, as ``DataLoader``'s
        ``len()``) the dataset's length now (it may grow between epochs); the next pass reads it
        when it begins."""
        if self._n is not None and self._samples == 0 and (self._pass is None or self._pass.done):
            return len(self.setup.dataset)
        return self._n

    def __iter__(self) -> Iterator[list[Any]]:
        pass_ = self._pass if self._pass is not None else MapPass(self.epoch, self._samples)
        plan = self._plan(fetch_here=self.setup.fetches_here)
        lists = plan_indices(plan, pass_.epoch, pass_.start, pass_.sampler_state)
        if self._mixture is not None:
            lists = _requested(self._mixture, pass_, lists)
        if pass_.out_of_order is not None:
            return pass_.out_of_order.planned(lists)
        return self._recorded(pass_, lists)

    def __len__(self) -> int:
        return self.batches_per_epoch()

    # --- beyond the interface --------------------------------------------------------------------
    def planned(self, epoch: int | None = None) -> list[list[Any]]:
        """The index lists of the next pass (or of ``epoch`` from its start), computed without
        reading data."""
        start = self._next if epoch is None else NextPass(epoch)
        lists = plan_indices(self._plan(), start.epoch, start.position, start.sampler_state)
        return [indices for indices, _ in lists]

    # --- internals -------------------------------------------------------------------------------
    def _plan(self, *, fetch_here: bool = False) -> Plan:
        setup = self.setup
        return Plan(
            sampler=self.sampler,
            n=self._n,
            shard=setup.shard(),
            seed=setup.seed,
            shuffle=self.shuffle,
            keying=setup.keying,
            mask=setup.mask,
            unit_is_batch=self.unit_is_batch,
            workers=setup.num_workers if setup.seeds_ahead else 0,
            next_fetch=self.next_fetch if fetch_here else None,
            resolve=None if self._mixture is None else self._mixture.resolve,
        )

    @staticmethod
    def _recorded(
        pass_: MapPass, lists: Iterator[tuple[list[Any], Pending]]
    ) -> Iterator[list[Any]]:
        audited = pass_.audited
        for indices, pending in lists:
            pass_.pending.append(pending)
            # NOTE: list.copy: a keyed list's own iteration may seed (keying="sample")
            if audited is not None:
                audited.append(list.copy(indices) if isinstance(indices, list) else list(indices))
            yield indices

    def _next_epoch(self, pass_: MapPass) -> None:
        self.epoch, self._samples, pass_.done = self.epoch + 1, 0, True

    def _read_length(self) -> None:
        """As DataLoader: a sized dataset's length is read again at each epoch's start (it may
        grow)."""
        if self._n is not None:
            self._n = len(self.setup.dataset)

    def _stateful_flags(self) -> tuple[bool, bool]:
        """Whether the sampler and the dataset are Stateful (read once a pass)."""
        if self._stateful is None:
            self._stateful = (is_stateful(self.sampler), is_stateful(self.setup.dataset))
        return self._stateful

    def _warn_sampler_left(self) -> None:
        if not self._warned_left:
            self._warned_left = True
            warn_sampler_left(self.sampler)

    def _current_sampler_state(self) -> Any:
        if not self._stateful_flags()[0]:
            return None
        if self._sampler_state is None:
            self._sampler_state = self.sampler.state_dict()
        return self._sampler_state


def _requested(mixture: Mixture, pass_: MapPass, lists: Iterator[tuple[Any, Pending]]
               ) -> Iterator[tuple[Any, Pending]]:
    """A mixture's lists (its positions resolved by the plan) as torch requests each one, telling
    the mixture how far requests have gone: its weight changes apply from there."""
    mixture.requested(pass_.epoch, pass_.start)
    for indices, pending in lists:
        mixture.requested(pass_.epoch, pending[0])
        yield indices, pending


class _Unbatch:
    """Collate for ``batch_size=None``: the fetcher hands us a one-index batch; give the item
    alone."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        return self.collate_fn(items[0])


def _check_user_state(field: str, saved: Any, owner: Any) -> None:
    stateful = is_stateful(owner)
    if saved is not None and not stateful:
        raise StateError(
            field,
            "<a saved state>",
            repr("None"),
            f"{type(owner).__name__} has no load_state_dict().",
        )
    if saved is None and stateful:
        raise StateError(
            field, None, repr(f"the state of {type(owner).__name__}"), "Required state missing."
        )
