"""The map-style check of ``loader_resume.audit.check``: positions are global, so each attempt's
batches are laid out by epoch and global position. An attempt that loaded a state resumes where that
state stands, and continues the attempt that took it: the batches that count are the last attempt's,
then, back along the states each attempt loaded, each earlier one's from where it resumed up to
where the next one resumed. What an attempt delivered past the state its successor loaded was rolled
back with the model (counted, not an error). The first batch after a load must start where the state
said. Then each epoch must hold every position exactly once; the documented exceptions: the padding
of the last step (``DistributedSampler``'s rule: positions past the end), what ``drop_last`` leaves
out (a tail shorter than one step), an epoch the loop itself left (it began the next pass, or said
``pass_ended=True``), and the job's last epoch, which may stop part-way. A rank of an attempt with
no log leaves its share of each step unknown: a gap, not a sample never delivered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from loader_resume.audit.read import Attempt
from loader_resume.audit.report import Finding, LoaderReport, resumed_from

__all__ = ["MapCheck"]

Key = tuple[int, int]
"""(epoch, global position), or (epoch, a step's start)."""


class _Own:
    """One attempt's own deliveries (map-style): position -> (rank, its step's start); step start ->
    end; positions of ranks with no log -> (rank, its step's start)."""

    def __init__(self, number: int, world: int) -> None:
        self.number, self.world = number, world
        self.seen: dict[Key, tuple[int, int]] = {}
        self.steps: dict[Key, int] = {}
        self.unknown: dict[Key, tuple[int, int]] = {}
        # (epoch, rank before, rank, the position a run of repeats would go on at) -> its finding's
        # index
        self.twice: dict[tuple[int, int, int, int], int] = {}


class MapCheck:
    """Each attempt's own deliveries, then the batches that count: the last attempt's, and back
    along the states each attempt loaded, each earlier one's from where it resumed up to where the
    next one resumed."""

    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        self.units: dict[int, int | None] = {}
        self.last_end: dict[int, int] = {}  # epoch -> the end of its last step (delivered, flagged)
        self.padding: dict[int, int] = {}
        self.step_size: dict[int, int] = {}  # epoch -> units of its largest step
        # epoch -> first position this audit saw (a job resumed from elsewhere)
        self.known_from: dict[int, int] = {}
        self.left: dict[int, str] = {}  # epoch -> how the loop left it before its end (on purpose)
        self.latest = -1  # the latest epoch a batch, a pass or a state reached
        # the attempts that count: (own, from, until)
        self.lineage: list[tuple[_Own, Key, Key | None]] = []
        # attempt index -> the attempt number after it that loaded an untaken state
        self.untaken: dict[int, int] = {}

    def run(self, attempts: list[Attempt]) -> None:
        owns: list[_Own] = []
        starts: list[Key | None] = []  # where each attempt resumed (None: afresh)
        parents: list[int | None] = []
        # state digest -> (attempt index, its record)
        taken: dict[str, tuple[int, dict[str, Any]]] = {}
        for index, attempt in enumerate(attempts):
            load = resumed_from(self.report, attempt, attempts[:index])
            where = None if load is None else (load["e"], load["pos"])
            # NOTE: a state no attempt took (named by resumed_from) continues the attempt before, as
            # its position says
            parent = (
                taken[load["d"]][0]
                if load is not None and load["d"] in taken
                else index - 1
                if index
                else None
            )
            if load is not None and index and load["d"] not in taken and "resharded" not in load:
                # NOTE: a gap (resumed_from): a log missing, or another run's
                self.untaken[index - 1] = attempt.number
            if load is not None and load["d"] in taken and taken[load["d"]][1].get("x"):
                self.left.setdefault(load["e"] - 1, "the loop left it (pass_ended=True)")
            if where is not None and index == 0:
                self.known_from[where[0]] = where[1]
            own, batches = self._read(attempt, taken, index)
            if where is not None:
                self._check_landing(attempt, where)
            rolled, exact = 0, True
            if parent is not None and where is not None:
                rolled = sum(1 for key in owns[parent].steps if key >= where)
                exact = all(log.ended for log in attempts[parent].logs)
            elif load is None and index:
                rolled = sum(len(other.steps) for other in owns)
                exact = all(log.ended for other in attempts[:index] for log in other.logs)
            owns.append(own)
            starts.append(where)
            parents.append(parent)
            self.report.attempts.append(
                {
                    "number": attempt.number,
                    "world": attempt.world,
                    "batches": batches,
                    "resumed": "(fresh)"
                    if where is None
                    else f"epoch {where[0]} position {where[1]}",
                    "rolled_back": rolled,
                    "rolled_back_exact": exact,
                }
            )
        counted: dict[Key, tuple[int, int, int]] = {}
        # position -> (attempt, rank) of a rank with no log
        unknown: dict[Key, tuple[int, int]] = {}
        steps: dict[Key, int] = {}
        cursor: int | None = len(attempts) - 1  # NOTE: back along the loads, from the last attempt
        until: Key | None = None
        while cursor is not None:
            own, begin = owns[cursor], starts[cursor] or (-1, 0)
            self.lineage.append((own, begin, until))
            # NOTE: what it did not deliver before that state is in no log: not known
            if cursor in self.untaken:
                last = max([(epoch, end) for (epoch, _), end in own.steps.items()], default=begin)
                for key in self._between(last, until):
                    unknown.setdefault(key, (self.untaken[cursor], -1))
            for key, (rank, start) in own.seen.items():
                if (key[0], start) >= begin and (until is None or (key[0], start) < until):
                    counted[key] = (own.number, rank, start)
            for key, (rank, start) in own.unknown.items():
                if (key[0], start) >= begin and (until is None or (key[0], start) < until):
                    unknown.setdefault(key, (own.number, rank))
            steps.update({key: end for key, end in own.steps.items()
                          if key >= begin and (until is None or key < until)})
            until, cursor = starts[cursor], parents[cursor] if starts[cursor] is not None else None
        self._epochs(counted, unknown, steps)

    def _read(
        self, attempt: Attempt, taken: dict[str, tuple[int, dict[str, Any]]], index: int
    ) -> tuple[_Own, int]:
        own, batches = _Own(attempt.number, attempt.world), 0
        absent = sorted(set(range(attempt.world)) - {log.rank for log in attempt.logs})
        # NOTE: ranks step together: an epoch whose last step one rank delivered was not left by the
        # loop
        ended = {record["e"] for log in attempt.logs for record in log.records
                 if record["t"] == "b" and record.get("l")}
        for log in attempt.logs:
            epoch_of_pass = None
            for record in log.records:
                kind = record["t"]
                if kind == "pass":
                    self.units[record["e"]] = record["units"]
                    if (
                        epoch_of_pass is not None
                        and record["e"] > epoch_of_pass
                        and epoch_of_pass not in ended
                    ):
                        self.left.setdefault(
                            epoch_of_pass, "the loop began the next pass before its end"
                        )
                    epoch_of_pass = record["e"]
                    self.latest = max(self.latest, record["e"])
                elif kind == "b":
                    batches += 1
                    self._add(own, log.rank, log.world, record)
                    for rank in absent:  # NOTE: its share of the step is not known (no log of it)
                        for position in self._share(record, rank, log.world):
                            own.unknown.setdefault((record["e"], position), (rank, record["s"]))
                elif kind == "state":
                    taken[record["d"]] = (index, record)
                    self.latest = max(
                        self.latest, record["e"] if record.get("e") is not None else -1
                    )
                elif kind == "load":
                    self.latest = max(
                        self.latest, record["e"] if record.get("e") is not None else -1
                    )
        return own, batches

    def _check_landing(self, attempt: Attempt, where: Key) -> None:
        for log in attempt.logs:
            first = next((record for record in log.records if record["t"] == "b"), None)
            if first is None:
                continue
            got = (first["e"], first["s"])
            at_end = got == (where[0] + 1, 0) and where[1] in (
                self.units.get(where[0]),
                self.last_end.get(where[0]),
            )
            if got != where and not at_end:
                self.report.findings.append(
                    Finding(
                        attempt.number,
                        got[0],
                        got[1],
                        f"resumed from epoch {where[0]} position {where[1]}, but its first "
                        f"batch starts at epoch {got[0]} position {got[1]}",
                        log.rank,
                    )
                )

    def _between(self, first: Key, until: Key | None) -> list[Key]:
        """The positions from ``first`` up to ``until`` (epochs of unknown length: none)."""
        if until is None:
            return []
        keys: list[Key] = []
        for epoch in range(max(first[0], 0), until[0] + 1):
            end = until[1] if epoch == until[0] else self.units.get(epoch)
            begin = first[1] if epoch == first[0] else 0
            keys.extend((epoch, position) for position in range(begin, end or 0))
        return keys

    def _share(self, record: dict[str, Any], rank: int, world: int) -> range:
        """The positions of ``rank``'s part of a step (``loader_resume.order.sampler``: a full
        step's batch each, or the tail's share), those past the epoch's end (padding) left out."""
        units = -(-(record["end"] - record["s"]) // world)
        first = record["s"] + rank * units
        total = self.units.get(record["e"])
        limit = total if total is not None else record["end"] if record.get("l") else None
        return range(
            first, first + units if limit is None else max(first, min(first + units, limit))
        )

    def _add(self, own: _Own, rank: int, world: int, record: dict[str, Any]) -> None:
        epoch, start, end = record["e"], record["s"], record["end"]
        units = -(-(end - start) // world)
        own.steps[(epoch, start)] = end
        self.step_size[epoch] = max(self.step_size.get(epoch, 0), units * world)
        self.latest = max(self.latest, epoch)
        if record.get("l"):
            self.last_end[epoch] = end
        share = self._share(record, rank, world)
        self.padding[epoch] = self.padding.get(epoch, 0) + units - len(share)
        for position in share:
            previous = own.seen.get((epoch, position))
            if previous is None:
                own.seen[(epoch, position)] = (rank, start)
                continue
            findings = self.report.findings
            # NOTE: the run of repeats goes on
            index = own.twice.pop((epoch, previous[0], rank, position), None)
            if index is None:
                findings.append(Finding(own.number, epoch, position, "", rank, 0))
                index = len(findings) - 1
            own.twice[(epoch, previous[0], rank, position + 1)] = index
            count = findings[index].count + 1
            findings[index] = dataclasses.replace(
                findings[index],
                count=count,
                message=(
                    f"delivered twice in one attempt (ranks {previous[0]} and {rank}), with no "
                    f"resume between: {count} "
                    f"sample{'s' * (count > 1)} from position {findings[index].position}"
                ),
            )

    def _owner(self, key: Key) -> tuple[int, int | None]:
        """The attempt (of the batches that count) and rank that should have delivered ``key``."""
        for own, begin, until in self.lineage:
            if key >= begin and (until is None or key < until):
                # NOTE: the step itself, if it ran (a tail is smaller)
                for (epoch, start), end in own.steps.items():
                    if epoch == key[0] and start <= key[1] < end:
                        return own.number, min(
                            (key[1] - start) // -(-(end - start) // own.world), own.world - 1
                        )
                step = self.step_size.get(key[0]) or 1
                base = begin[1] if begin[0] == key[0] else 0
                offset = (key[1] - base) % step
                return own.number, min(offset // max(step // own.world, 1), own.world - 1)
        return self.lineage[-1][0].number if self.lineage else 1, None

    def _epochs(self, counted: dict[Key, tuple[int, int, int]], unknown: dict[Key, tuple[int, int]],
                steps: dict[Key, int]) -> None:
        header = self.report.header
        # (attempt, rank with no log) -> its positions that count
        gaps: dict[tuple[int, int], list[Key]] = {}
        for epoch in sorted(
            {epoch for epoch, _ in counted} | set(self.padding) | {epoch for epoch, _ in unknown}
        ):
            positions = sorted(position for e, position in counted if e == epoch)
            total = self.units.get(epoch)
            end = total if total is not None else self.last_end.get(epoch)
            reached = end is not None
            end = end if end is not None else (positions[-1] + 1 if positions else 0)
            begin = self.known_from.get(epoch, 0)
            missing = [p for p in range(begin, end) if (epoch, p) not in counted]
            for p in [p for p in missing if (epoch, p) in unknown]:
                gaps.setdefault(unknown[(epoch, p)], []).append((epoch, p))
            missing = [p for p in missing if (epoch, p) not in unknown]
            if not reached and epoch < self.latest and epoch not in self.left:
                missing = missing or [end]
            dropped, dropped_from, status = 0, None, "ok"
            if missing:
                suffix = missing == list(range(missing[0], max(end, missing[0] + 1)))
                if suffix and header["drop_last"] and len(missing) < self.step_size.get(epoch, 0):
                    dropped, dropped_from = len(missing), missing[0]
                elif suffix and epoch == self.latest and epoch not in self.left:
                    status = f"partial: the job stopped at position {missing[0]}"
                elif suffix and epoch in self.left:
                    status = f"left at position {missing[0]}: {self.left[epoch]}"
                else:
                    step = sum(1 for e, start in steps if e == epoch and start < missing[0])
                    status = f"position {missing[0]} never delivered ({len(missing)} missing)"
                    attempt, rank = self._owner((epoch, missing[0]))
                    self.report.findings.append(
                        Finding(
                            attempt,
                            epoch,
                            missing[0],
                            f"never delivered: {len(missing)} "
                            f"samples from step {step} of the epoch on",
                            rank,
                            len(missing),
                        )
                    )
            if begin:
                status += f" (from position {begin}: " + (
                    "earlier ones ran before this audit)"
                    if self.report.checked_from
                    else "earlier ones are in no log)"
                )
            self.report.epochs.append(
                {
                    "epoch": epoch,
                    "delivered": len(positions),
                    "dropped": dropped,
                    "dropped_from": dropped_from,
                    "padding": self.padding.get(epoch, 0),
                    "status": status,
                }
            )
        for (attempt, rank), keys in sorted(gaps.items()):
            if rank >= 0:
                self.report.gaps.append(
                    Finding(
                        attempt,
                        keys[0][0],
                        keys[0][1],
                        f"no log of rank {rank}: what it "
                        f"was handed is not known ({len(keys)} samples that count were its "
                        "share; its file deleted, or written to another directory?)",
                        rank,
                        len(keys),
                    )
                )
                continue
            index = next(i for i, gap in enumerate(self.report.gaps) if gap.attempt == attempt)
            gap = self.report.gaps[index]
            self.report.gaps[index] = dataclasses.replace(
                gap,
                count=len(keys),
                message=f"{gap.message}; {len(keys)} samples before it, from epoch {keys[0][0]} "
                f"position {keys[0][1]}, are in no log",
            )

