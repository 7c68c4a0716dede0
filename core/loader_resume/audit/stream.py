"""The stream check of ``loader_resume.audit.check`` (iterable datasets: each rank's workers own
their part): each worker's batches of an epoch must be numbered 1, 2, ... without a gap or a repeat
after the cuts, an attempt must continue each worker where its loaded state said, and no batch may
carry more items than a batch holds. Batches before a state taken outside the logs (the first
attempt's, with ``--began-before-audit``, or one no attempt in the logs took) are not known; a rank
with no log is a gap.
"""

from __future__ import annotations

from typing import Any

from loader_resume.audit.read import Attempt, first_load
from loader_resume.audit.report import Finding, LoaderReport, resumed_from

__all__ = ["StreamCheck"]


class StreamCheck:
    def __init__(self, report: LoaderReport) -> None:
        self.report = report
        # (epoch, rank, worker) -> batch number -> (the attempt that delivered it, the worker's
        # items after it)
        self.seen: dict[tuple[int, int, int], dict[int, tuple[int, int]]] = {}
        # (epoch, rank, worker) -> batch number -> items after it, where a state taken outside the
        # logs stood
        self.outside: dict[tuple[int, int, int], dict[int, int]] = {}
        self.batch = int(report.header.get("batch_size") or 1)
        self.unseen: set[int] = set()  # the ranks the attempt before had no log of

    def run(self, attempts: list[Attempt]) -> None:
        workers = None
        for index, attempt in enumerate(attempts):
            gaps = len(self.report.gaps)
            load = resumed_from(self.report, attempt, attempts[:index])
            counts = {
                len(record["wb"])
                for log in attempt.logs
                for record in log.records
                if record["t"] == "pass"
            }
            changed = workers is not None and bool(counts - {workers})
            workers = next(iter(counts), workers)
            if load is not None and ("resharded" in load or changed):
                self.report.findings.append(
                    Finding(
                        attempt.number,
                        load.get("e"),
                        None,
                        "resumed a stream at another world size or num_workers: the audit cannot "
                        "follow a re-shard (not checked)",
                    )
                )
                return
            outside = load is not None and (
                len(self.report.gaps) > gaps
                or (self.report.checked_from is not None and index == 0)
            )
            rolled, batches = 0, 0
            for log in attempt.logs:
                loaded = first_load(log)
                if loaded is not None or index:
                    rolled += self._cut(log.rank, loaded)
                if loaded is not None and (outside or log.rank in self.unseen):
                    self._outside(log.rank, loaded)
                for record in log.records:
                    if record["t"] == "b":
                        batches += 1
                        self._add(attempt.number, log.rank, record)
            self.unseen = self._absent(attempt, batches)
            resumed = (
                "(fresh)"
                if load is None
                else f"epoch {load['e']}, workers at batches {load.get('wb')}"
            )
            exact = all(log.ended for other in attempts[:index] for log in other.logs)
            self.report.attempts.append(
                {
                    "number": attempt.number,
                    "world": attempt.world,
                    "batches": batches,
                    "resumed": resumed,
                    "rolled_back": rolled,
                    "rolled_back_exact": exact,
                }
            )
        self._epochs(attempts[-1].number)

    def _epochs(self, last: int) -> None:
        for key, numbers in sorted(self.seen.items()):
            epoch, rank, worker = key
            outside = self.outside.get(key, {})
            gaps = sorted(
                set(range(1, max(numbers) + 1))
                - set(numbers)
                - set(range(1, max(outside, default=0) + 1))
            )
            samples = 0
            for n, (attempt, items) in sorted(numbers.items()):
                before = (
                    numbers[n - 1][1]
                    if n - 1 in numbers
                    else outside.get(n - 1, 0 if n == 1 else None)
                )
                if before is None:
                    continue
                samples += items - before
                if items - before > self.batch:
                    self.report.findings.append(
                        Finding(
                            attempt,
                            epoch,
                            n,
                            f"worker {worker}: batch {n} moved the "
                            f"stream {items - before} items on, more than a batch holds "
                            f"({self.batch}): {items - before - self.batch} items skipped",
                            rank,
                            items - before - self.batch,
                        )
                    )
            status = "ok"
            if gaps:
                after = next((numbers[n][0] for n in sorted(numbers) if n > gaps[0]), last)
                status = f"batch {gaps[0]} never delivered ({len(gaps)} missing)"
                self.report.findings.append(
                    Finding(
                        after,
                        epoch,
                        gaps[0],
                        f"worker {worker}: {len(gaps)} batch"
                        f"{'es' * (len(gaps) > 1)} never delivered, from batch {gaps[0]}",
                        rank,
                        len(gaps),
                    )
                )
            if outside:
                status += f" (from batch {max(outside) + 1}: earlier ones are not in these logs)"
            self.report.epochs.append(
                {
                    "epoch": epoch,
                    "rank": rank,
                    "worker": worker,
                    "batches": len(numbers),
                    "delivered": samples,
                    "padding": 0,
                    "dropped": 0,
                    "status": status,
                }
            )

    def _outside(self, rank: int, load: dict[str, Any]) -> None:
        """A state taken outside the logs: its workers' batches up to it are not known (not
        missing)."""
        items = load.get("wi") or [0] * len(load["wb"])
        for worker, (batches, count) in enumerate(zip(load["wb"], items, strict=True)):
            if batches:
                self.outside.setdefault((load["e"], rank, worker), {})[batches] = count

    def _absent(self, attempt: Attempt, batches: int) -> set[int]:
        """The ranks of ``attempt`` with no log (gaps, if it delivered anything)."""
        missing = set(range(attempt.world)) - {log.rank for log in attempt.logs}
        for rank in sorted(missing) if batches else []:
            self.report.gaps.append(
                Finding(
                    attempt.number,
                    None,
                    None,
                    f"no log of rank {rank}: what its workers handed over is not known (its file "
                    "deleted, or written to another directory?)",
                    rank,
                )
            )
        return missing

    def _cut(self, rank: int, load: dict[str, Any] | None) -> int:
        gone = 0
        for (epoch, owner, worker), numbers in self.seen.items():
            if owner != rank:
                continue
            keep = (
                0
                if load is None or epoch > load["e"]
                else None
                if epoch < load["e"]
                else load["wb"][worker]
            )
            if keep is None:
                continue
            cut = [n for n in numbers if n > keep]
            gone += len(cut)
            for n in cut:
                del numbers[n]
        return gone

    def _add(self, attempt: int, rank: int, record: dict[str, Any]) -> None:
        key = (record["e"], rank, record["w"])
        numbers = self.seen.setdefault(key, {})
        if record["b"] in numbers:
            self.report.findings.append(
                Finding(
                    attempt,
                    record["e"],
                    record["b"],
                    f"worker {record['w']}: batch "
                    f"{record['b']} delivered again, with no resume between",
                    rank,
                )
            )
        numbers[record["b"]] = (attempt, int(record.get("i", 0)))
