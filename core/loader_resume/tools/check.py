"""``loader-resume check MODULE:FACTORY``: prove that *your* pipeline resumes exactly.

FACTORY is a callable returning a DataLoader (plain ones are converted with
``loader_resume.convert``). The uninterrupted sequence runs in one process; each scenario saves a
state after ``cut`` batches in a second process and resumes it in a third, possibly with another
``num_workers``; at each cut, a job cut twice too: the resumed run is cut again one batch later, and
that state resumed in a fourth process. Batches are compared by fingerprint, field by field, so a
divergence report names the batch, its epoch and the field.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Scenario", "main", "run_check"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One cut-and-resume run and its verdict."""

    cut: int
    save_workers: int
    resume_workers: int
    exact: bool
    diverged_at: int | None = None
    epoch: int | None = None
    fields: tuple[str, ...] = ()
    world: int | None = None
    """A rescale scenario: resumed over this many ranks (from 1); judged on the samples
    delivered."""
    problem: str = ""
    refused: str = ""
    """The loader refuses this resume by design (e.g. an iterable dataset at another num_workers):
    why."""
    warned: tuple[str, ...] = ()
    """What the resume itself warned (loader_resume's log), e.g. that the continuation will not be
    bit-identical."""
    again: int | None = None
    """A job cut twice: the resumed run was cut again after this many batches in all, and resumed
    from there."""

    def describe(self) -> str:
        warned = "".join(f"; the resume warned: {message}" for message in self.warned)
        if self.refused:
            return f"refused: {self.refused}"
        if self.world is not None:
            return "the rest of the epoch exactly once" if self.exact else f"WRONG: {self.problem}"
        if self.exact:
            return "exact" + warned
        where = f"batch {self.diverged_at} (epoch {self.epoch})"
        fields = ", ".join(self.fields) or "missing or extra batches"
        return f"DIVERGES at {where}: {fields} differ{warned}"


def _fields(batch: Any) -> dict[str, str]:
    from loader_resume.testing import fingerprint

    if isinstance(batch, Mapping):
        return {repr(key): fingerprint(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return {f"[{i}]": fingerprint(value) for i, value in enumerate(batch)}
    return {"batch": fingerprint(batch)}


def _named(spec: str, what: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SystemExit(
            f"loader-resume check: {spec!r} is not MODULE:{what} (e.g. mypkg.data:make_loader)"
        )
    return getattr(importlib.import_module(module_name), attribute)


def _build(
    spec: str, workers: int | None, rank: int | None = None, world: int | None = None
) -> Any:
    factory: Callable[[], Any] = _named(spec, "FACTORY")
    from loader_resume.convert import resumable

    return resumable(factory(), num_workers=workers, rank=rank, world_size=world)


def _run(
    spec: str,
    epochs: int,
    workers: int | None,
    cut: int | None,
    load: str | None,
    save: str | None,
    after_batch: str | None = None,
    again: int | None = None,
) -> None:
    """Runner (a separate process): print one JSON line per batch: [epoch, {field: fingerprint}].
    ``cut``: the batches to deliver before saving to ``save``, or those delivered before the state
    in ``load``; with both, ``again``: the batches delivered in all when the resumed run saves to
    ``save``."""
    import torch

    from loader_resume.state import StateError

    loader = _build(spec, workers)
    warned = _Warnings()
    if load:
        logging.getLogger("loader_resume").addHandler(warned)
        try:
            loader.load_state_dict(torch.load(load, weights_only=True))
        except StateError as error:  # refused by design: a verdict of its own, not a crash
            sys.stdout.write(json.dumps({"refused": str(error)}) + "\n")
            return
    call = _named(after_batch, "FUNCTION") if after_batch else None
    delivered = cut if load and cut else 0
    while loader.epoch < epochs:
        epoch = loader.epoch
        for batch in loader:
            sys.stdout.write(json.dumps([epoch, _fields(batch)]) + "\n")
            delivered += 1
            if call is not None:
                call(loader, delivered)
            if save and delivered == (again if load else cut):
                torch.save(loader.state_dict(), save)
                return
    if load:
        sys.stdout.write(json.dumps({"warned": warned.messages}) + "\n")


class _Warnings(logging.Handler):
    """The warnings loader_resume logs while a resumed runner loads and iterates, for the
    verdict."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "will NOT be bit-identical" in message and message not in self.messages:
            self.messages.append(message)


def _rescale(spec: str, load: str, world: int) -> None:
    """Runner: the samples of the cut epoch delivered before the cut (1 rank) and after it
    (``world`` ranks), from the loaders' own index plans — no data is read. One JSON line."""
    import torch

    state = torch.load(load, weights_only=True)
    reference = _build(spec, 0)
    # NOTE: a Mixture's order depends on the weight changes the state holds
    reference.load_state_dict(state)
    full = [i for batch in reference.planned_indices(epoch=state["epoch"]) for i in batch]
    after: list[int] = []
    for rank in range(world):
        loader = _build(spec, 0, rank, world)
        loader.load_state_dict(state)
        if loader.epoch == state["epoch"]:
            after += [i for batch in loader.planned_indices() for i in batch]
    batch = reference.batch_size or 1
    sys.stdout.write(json.dumps({"full": full, "before": full[: state["position"]], "after": after,
                                 "drop_last": reference.drop_last, "step": world * batch}) + "\n")


def _judge_rescale(found: Mapping[str, Any], world: int) -> tuple[bool, str]:
    # NOTE: multisets, compared with the epoch's plan: a Mixture's epoch may hold a small source's
    # item twice
    def key(index: Any) -> Any:
        # JSON turned a Mixture's keys into lists
        return tuple(index) if isinstance(index, list) else index

    counts, plan = (
        Counter(map(key, found["before"] + found["after"])),
        Counter(map(key, found["full"])),
    )
    lost, extra = plan - counts, counts - plan
    if found["drop_last"]:
        if extra:
            return False, f"samples delivered twice: {sorted(extra)[:5]}"
        if lost.total() >= found["step"]:
            return False, f"{lost.total()} samples lost (more than one partial global step)"
        return True, ""
    if lost:
        return False, f"samples lost: {sorted(lost)[:5]}"
    if extra.total() >= world:
        return False, f"{extra.total()} repeated samples (more than the last step's padding)"
    return True, ""


def _spawn(args: list[str]) -> list[Any]:
    done = subprocess.run(
        [sys.executable, "-m", "loader_resume.tools.check", *args], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(
            f"loader-resume check: the pipeline failed in a subprocess:\n{done.stderr[-3000:]}"
        )
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith(("[", "{"))]


def _compare(
    reference: list[list[Any]], resumed: list[list[Any]], cut: int
) -> tuple[bool, int | None, int | None, tuple[str, ...]]:
    expected = reference[cut:]
    for offset, (want, got) in enumerate(zip(expected, resumed, strict=False)):
        if want != got:
            fields = tuple(
                sorted(k for k in set(want[1]) | set(got[1]) if want[1].get(k) != got[1].get(k))
            )
            return False, cut + offset, want[0], fields
    if len(expected) != len(resumed):
        at = cut + min(len(expected), len(resumed))
        return False, at, (expected[len(resumed)][0] if len(expected) > len(resumed) else None), ()
    return True, None, None, ()


def run_check(
    spec: str,
    *,
    epochs: int = 2,
    cuts: list[int] | None = None,
    workers: list[int] | None = None,
    worlds: list[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    after_batch: str | None = None,
) -> list[Scenario]:
    """The scenarios' verdicts (the uninterrupted run is the reference).

    ``worlds``: world sizes to resume a map-style loader's state over (default ``[2]``; ``[]`` for
    none); those scenarios are judged on the samples delivered, since batches are composed
    differently. ``after_batch``: ``MODULE:FUNCTION`` called as ``function(loader,
    batches_delivered)`` after every batch of every run (counting on from the cut after a resume): a
    job's per-step calls, e.g. ``Mixture.set_weights``.
    """
    calls = ["--after-batch", after_batch] if after_batch else []
    from torch.utils.data import IterableDataset

    own = _build(spec, None)
    own_workers = own.num_workers
    rescalable = not isinstance(own.dataset, IterableDataset) and own.world_size == 1
    rescales = (worlds if worlds is not None else [2]) if rescalable else []
    reference = _spawn(["_run", spec, "--epochs", str(epochs), *calls])
    per_epoch = sum(1 for epoch, _ in reference if epoch == 0)
    # first batch, mid-epoch, an epoch's last batch, the boundary's first batch of the next
    if cuts is None:
        candidates = (1, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 1)
        cuts = sorted({c for c in candidates if 0 < c <= len(reference)})
    resume_workers = (
        workers if workers is not None else sorted({own_workers, 0 if own_workers else 2})
    )
    plan = [(cut, w, None) for cut in cuts for w in resume_workers] + [
        (cut, 0, r) for cut in cuts for r in rescales
    ]
    scenarios = []
    with tempfile.TemporaryDirectory() as tmp:
        for done, (cut, resume_with, world) in enumerate(plan):
            state = str(Path(tmp) / f"state-{cut}.pt")
            if not Path(state).exists():
                _spawn(
                    [
                        "_run",
                        spec,
                        "--epochs",
                        str(epochs),
                        "--cut",
                        str(cut),
                        "--save",
                        state,
                        *calls,
                    ]
                )
            if world is None:
                resumed = _spawn(
                    [
                        "_run",
                        spec,
                        "--epochs",
                        str(epochs),
                        "--load",
                        state,
                        "--cut",
                        str(cut),
                        "--workers",
                        str(resume_with),
                        *calls,
                    ]
                )
                if resumed and isinstance(resumed[0], dict) and "refused" in resumed[0]:
                    scenarios.append(
                        Scenario(
                            cut, own_workers, resume_with, False, refused=resumed[0]["refused"]
                        )
                    )
                else:
                    warned = (
                        tuple(resumed.pop()["warned"])
                        if resumed and isinstance(resumed[-1], dict)
                        else ()
                    )
                    exact, at, epoch, fields = _compare(reference, resumed, cut)
                    scenarios.append(
                        Scenario(
                            cut, own_workers, resume_with, exact, at, epoch, fields, warned=warned
                        )
                    )
                    if resume_with == own_workers and exact and cut < len(reference):
                        scenarios.append(
                            _again(spec, epochs, state, cut, own_workers, reference, calls, tmp)
                        )
            else:
                (found,) = _spawn(["_run", spec, "--load", state, "--world", str(world)])
                exact, problem = _judge_rescale(found, world)
                scenarios.append(
                    Scenario(cut, own_workers, own_workers, exact, world=world, problem=problem)
                )
            if progress is not None:
                progress(done + 1, len(plan))
    return scenarios


def _again(spec: str, epochs: int, state: str, cut: int, workers: int, reference: list[list[Any]],
           calls: list[str], tmp: str) -> Scenario:
    """A job cut twice: resumed from ``state`` (after ``cut`` batches), cut again one batch later,
    resumed again."""
    again, second = cut + 1, str(Path(tmp) / f"state-{cut}-again.pt")
    same = ["--epochs", str(epochs), "--workers", str(workers), *calls]
    _spawn(
        [
            "_run",
            spec,
            *same,
            "--load",
            state,
            "--cut",
            str(cut),
            "--again",
            str(again),
            "--save",
            second,
        ]
    )
    resumed = _spawn(["_run", spec, *same, "--load", second, "--cut", str(again)])
    warned = tuple(resumed.pop()["warned"]) if resumed and isinstance(resumed[-1], dict) else ()
    exact, at, epoch, fields = _compare(reference, resumed, again)
    return Scenario(cut, workers, workers, exact, at, epoch, fields, warned=warned, again=again)


def _bar(done: int, total: int) -> None:
    filled = round(30 * done / total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} scenarios")
    sys.stderr.write("\n" if done == total else "")
    sys.stderr.flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "factory", metavar="MODULE:FACTORY", help="a callable returning your DataLoader"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--cuts", type=lambda s: [int(x) for x in s.split(",")], help="e.g. 1,5,10 (batches)"
    )
    parser.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        help="num_workers to resume with, e.g. 0,2 (default: the loader's own and another)",
    )
    parser.add_argument(
        "--worlds",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="world sizes to resume over, e.g. 2,3 (default: 2; '' for none; map-style data only)",
    )
    parser.add_argument(
        "--after-batch",
        metavar="MODULE:FUNCTION",
        help="called as FUNCTION(loader, batches_delivered) after every batch of every run "
        "(your job's per-step calls, e.g. Mixture.set_weights)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON")


def main(args: argparse.Namespace) -> int:
    """``loader-resume check``: exit code 0 if every scenario it ran resumes exactly, else 1.

    A scenario the loader refuses by design (an iterable dataset resumed at another ``num_workers``)
    is reported as ``refused: <reason>`` and does not fail the check: the refusal is the guarantee.
    """
    scenarios = run_check(
        args.factory,
        epochs=args.epochs,
        cuts=args.cuts,
        workers=args.workers,
        worlds=args.worlds,
        progress=None if args.json else _bar,
        after_batch=args.after_batch,
    )
    if args.json:
        sys.stdout.write(json.dumps([asdict(s) for s in scenarios], indent=2) + "\n")
    else:
        rows = [
            f"cut after {s.cut:>4} batches, "
            + (
                f"world size 1 -> {s.world}"
                if s.world is not None
                else f"num_workers {s.save_workers} -> {s.resume_workers}"
            )
            + (f", cut again after {s.again}" if s.again is not None else "")
            + f": {s.describe()}"
            for s in scenarios
        ]
        sys.stdout.write("\n".join(rows) + "\n")
        refused = sum(bool(s.refused) for s in scenarios)
        bad = sum(not s.exact and not s.refused for s in scenarios)
        tail = f", {refused} refused by design" if refused else ""
        sys.stdout.write(f"{len(scenarios) - bad - refused} exact, {bad} diverging{tail}\n")
    return 0 if all(s.exact or s.refused for s in scenarios) else 1


def _runner_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m loader_resume.tools.check")
    parser.add_argument("command", choices=["_run"])
    parser.add_argument("spec")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--cut", type=int)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--world", type=int)
    parser.add_argument("--after-batch")
    parser.add_argument("--again", type=int)
    args = parser.parse_args(argv)
    sys.path.insert(0, ".")
    if args.world:
        _rescale(args.spec, args.load, args.world)
        return
    _run(
        args.spec,
        args.epochs,
        args.workers,
        args.cut,
        args.load,
        args.save,
        args.after_batch,
        args.again,
    )


if __name__ == "__main__":
    _runner_main(sys.argv[1:])
