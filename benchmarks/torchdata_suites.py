"""Run torchdata's StatefulDataLoader test suites against ResumableDataLoader, beside it.

    python benchmarks/torchdata_suites.py --repo PATH            # prints the table; docs untouched
    python benchmarks/torchdata_suites.py --repo PATH --readme   # also into docs/comparison.md

``PATH`` is a local copy of github.com/pytorch/data: a checkout, or a bare git directory (its
``HEAD`` is read with ``git show``). Nothing is fetched. Without ``--repo``, ``$TORCHDATA_REPO`` is
used. ~15 min on 2 cores (each file runs twice: once unmodified, once with the loader swapped).

The files under ``test/stateful_dataloader/`` are copied to a temporary directory, twice: as they
are, and with their import of ``StatefulDataLoader`` replaced by
``loader_resume.ResumableDataLoader`` (nothing else changes; nothing of theirs is copied into this
repository). Every failure of ours must be one of the deliberate differences in :data:`DELIBERATE`
(each also stated in the docs and shown by a test of ours); any other failure makes the script exit
1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import markdown, write_docs_section

FILES = ("test_dataloader.py", "test_state_dict.py", "test_hugging_face.py")
SUITE_DIR = "test/stateful_dataloader"

# (their import, ours): every one must be found in the files that use it.
IMPORTS = (
    ("from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader\n",
     "from loader_resume import ResumableDataLoader as DataLoader\n"),
    ("from torchdata.stateful_dataloader import Stateful, StatefulDataLoader\n",
     "from torchdata.stateful_dataloader import Stateful\n"
     "from loader_resume import ResumableDataLoader as StatefulDataLoader\n"),
    ("from torchdata.stateful_dataloader import StatefulDataLoader\n",
     "from loader_resume import ResumableDataLoader as StatefulDataLoader\n"),
)

# Test-id pattern -> the deliberate difference that makes it fail (docs/comparison.md).
DELIBERATE: dict[str, str] = {
    r"test_state_dict\.py::TestOutOfOrderWithCheckpointing::test_out_of_order_iterable":
        "reads torchdata's state layout",
    r"test_state_dict\.py::TestNumWorkersMismatch":
        "a map-style state resumes with another num_workers",
    r"test_state_dict\.py::TestEndOfEpochBehavior":
        "a state after an epoch's last batch resumes at the next epoch",
    r"test_state_dict\.py::TestDynamicStateIterableDataset": "reads torchdata's state layout",
    r"test_state_dict\.py::TestDatasetIteratorStateDuplication": "reads torchdata's state layout",
    r"test_state_dict\.py::TestSingleIterCalled": "reads torchdata's state layout",
    r"test_state_dict\.py::TestInitialState_shard0::"
    r"test_(initial_state|load_state_after_initial_state_dict)":
        "reads torchdata's state layout",
    r"test_state_dict\.py::TestInitialState_shard0::test_init_error":
        "a worker_init_fn error is raised at the first next(), as DataLoader, not at iter()",
    r"test_dataloader\.py::.*::test_worker_init_fn":
        "keyed torch: a worker_init_fn's torch.manual_seed is overridden",
    r"test_dataloader\.py::.*::test_shuffler_iterdatapipe":
        "the order follows the loader's seed, not the global RNG",
    # Not ours: torch 2.13's WorkerInfo is a frozen dataclass; the test expects a RuntimeError on
    # assignment.
    r"test_dataloader\.py::.*::test_get_worker_info":
        "fails for StatefulDataLoader too (torch 2.13 WorkerInfo)",
}

# Tests whose result is reported by name (a second table): out-of-order delivery. torchdata's
# TestOutOfOrderDataLoader holds torch's own two (index datasets) and two over iterable datasets.
NAMED = (
    "test_dataloader.py::TestOutOfOrderDataLoader::test_in_order_index_ds",
    "test_dataloader.py::TestOutOfOrderDataLoader::test_out_of_order_index_ds",
    "test_dataloader.py::TestOutOfOrderDataLoader::test_in_order_iterable_ds",
    "test_dataloader.py::TestOutOfOrderDataLoader::test_out_of_order_iterable_ds",
    "test_state_dict.py::TestOutOfOrderWithCheckpointing::test_out_of_order_index_ds",
    "test_state_dict.py::TestOutOfOrderWithCheckpointing::"
    "test_out_of_order_iterable_ds_one_completed_worker",
    "test_state_dict.py::TestOutOfOrderWithCheckpointing::"
    "test_out_of_order_iterable_ds_no_completed_workers",
)


def read_suite(repo: Path, name: str) -> str:
    checkout = repo / SUITE_DIR / name
    if checkout.is_file():
        return checkout.read_text()
    return subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{SUITE_DIR}/{name}"],
                          check=True, capture_output=True, text=True).stdout


def ours(text: str, name: str) -> str:
    swapped = 0
    for theirs, replacement in IMPORTS:
        swapped += text.count(theirs)
        text = text.replace(theirs, replacement)
    if not swapped:
        raise SystemExit(
            f"{name}: no import of StatefulDataLoader found to swap (did the upstream file change?)"
        )
    return text


def run(folder: Path, name: str) -> tuple[dict[str, int], list[str], set[str]]:
    """pytest on one file: its counts, the ids of the tests that failed and those of the tests that
    passed."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:warnings",
            "-o",
            "addopts=",
            "--timeout",
            "300",
            name,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"},
    )
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    counts = {
        kind: int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)
    }
    if not counts:
        raise SystemExit(
            f"{name}: pytest gave no summary:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    failed = sorted(
        {m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)}
    )
    passed = {m.group(1) for m in re.finditer(r"^PASSED (\S+)", done.stdout, re.M)}
    return counts, failed, passed


def outcome(test: str, passed: set[str], failed: list[str]) -> str:
    """``passed``, ``failed`` or ``not run`` for a test id of one run (ids there carry the file's
    prefix)."""
    if test in passed:
        return "passed"
    return "failed" if any(f == test or f.startswith(test + "[") for f in failed) else "not run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--repo", default=os.environ.get("TORCHDATA_REPO"), help="a local copy of pytorch/data"
    )
    parser.add_argument(
        "--readme", action="store_true", help="write the table to docs/comparison.md"
    )
    parser.add_argument(
        "--only", choices=FILES, action="append", help="run only this file (repeatable)"
    )
    args = parser.parse_args()
    if not args.repo:
        raise SystemExit(
            "no copy of pytorch/data: pass --repo PATH or set TORCHDATA_REPO (nothing is fetched)"
        )
    repo = Path(args.repo)
    rows, unexplained, named = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.only or FILES:
            text = read_suite(repo, name)
            (folder / f"theirs_{name}").write_text(text)
            (folder / f"ours_{name}").write_text(ours(text, name))
            theirs_counts, theirs_failed, theirs_passed = run(folder, f"theirs_{name}")
            ours_counts, failed, ours_passed = run(folder, f"ours_{name}")
            named += [
                [
                    f"`{test}`",
                    outcome(f"theirs_{test}", theirs_passed, theirs_failed),
                    outcome(f"ours_{test}", ours_passed, failed),
                ]
                for test in NAMED
                if test.startswith(name)
            ]
            reasons: dict[str, int] = {}
            for test in failed:
                test_id = test.replace("ours_", "", 1)
                reason = next(
                    (why for pattern, why in DELIBERATE.items() if re.search(pattern, test_id)),
                    None,
                )
                if reason is None:
                    unexplained.append(test_id)
                else:
                    reasons[reason] = reasons.get(reason, 0) + 1
            rows.append(
                [
                    name,
                    f"{theirs_counts.get('passed', 0)} / {theirs_counts.get('failed', 0)}",
                    f"{ours_counts.get('passed', 0)} / {ours_counts.get('failed', 0)}",
                    "; ".join(f"{why} ({n})" for why, n in sorted(reasons.items())) or "—",
                ]
            )
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    text = (
        "Measured by `python benchmarks/torchdata_suites.py` on pytorch/data "
        f"`{commit or 'unknown'}` `test/stateful_dataloader/`, each file run unmodified and with "
        "its loader swapped for ours. Passed / failed are pytest's counts (failed subtests "
        "included); the last column counts failing tests.\n\n"
        + markdown(
            [
                "file",
                "StatefulDataLoader passed / failed",
                "ours passed / failed",
                "our failures: the deliberate difference",
            ],
            rows,
        )
    )
    if named:
        text += ("\n\nOut-of-order delivery (`in_order=False`), test by test:\n\n"
                 + markdown(["test", "StatefulDataLoader", "ours"], named))
    if unexplained:
        text += ("\n\nFailures that are **not** a deliberate difference (open work):\n\n"
                 + "\n".join(f"- `{test}`" for test in unexplained))
    print(text)
    if args.readme:
        write_docs_section("torchdata", text)
    sys.exit(1 if unexplained else 0)


if __name__ == "__main__":
    main()
