"""Several runs of a child script in one process, one after another: ``python CHILD --batch PLAN``.

For the runs whose subject is not the start of a process — uninterrupted reference runs, resumes
from a checkpoint file, refusals — a fresh process each would cost an import of the framework per
run (seconds), where the run itself takes a fraction of a second. The runs of a batch still start in
a process that has written none of the checkpoints they load (the test starts the batch after the
runs that wrote them).

Each run is ``main(argv)`` as its own process would run it: its standard error (the file descriptor,
so Python's, the logging's and the libraries' output alike) goes to a file of its own, and its exit
status is recorded as a process would end: 0, a ``SystemExit``'s code, or 1 with the traceback for
any other exception. Between runs the environment, the signal handlers and the warnings filters
(with their once-only registries) are put back as they were, so no run sees what an earlier one set.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import forked

__all__ = ["Done", "fresh_accelerate", "run_batch", "run_each"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@dataclass
class Done:
    """One run of a batch, as ``subprocess.run`` would report its process."""

    returncode: int
    stderr: str


def _status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # as the interpreter does with a SystemExit("message")
    return 1


def run_each(
    main: Callable[[list[str]], Any], plan: str, fresh: Callable[[], None] = lambda: None
) -> None:
    """The child's side: every run of the JSON file ``plan`` (``[{"argv": [...], "stderr": PATH,
    "exit": PATH}]``); ``fresh()`` before each run forgets what a library keeps for the whole
    process (Accelerate's shared state)."""
    for run in json.loads(Path(plan).read_text()):
        fresh()
        environ = dict(os.environ)
        handlers = {number: signal.getsignal(number) for number in SIGNALS}
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(2)
        with open(run["stderr"], "w") as stderr:
            os.dup2(stderr.fileno(), 2)
        try:
            # entering it resets every module's record of warnings shown
            with warnings.catch_warnings():
                warnings.onceregistry.clear()
                main(list(run["argv"]))
            code = 0
        except SystemExit as exit:
            code = _status(exit.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            gc.collect()  # the run's loaders end their workers now, not during the next run
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            os.environ.clear()
            os.environ.update(environ)
            for number, handler in handlers.items():
                signal.signal(number, handler)
        Path(run["exit"]).write_text(str(code))


def fresh_accelerate() -> None:
    """Forget Accelerate's state, shared by every ``Accelerator`` of a process (each run makes its
    own)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_batch(
    script: Path, runs: Sequence[Sequence[str]], where: Path, timeout: float = 600
) -> list[Done]:
    """The test's side: ``script --batch`` with ``runs`` (each the arguments of one run), its plan
    and the runs' reports in ``where``; each run's exit status and standard error."""
    where.mkdir(parents=True, exist_ok=True)
    plan = [{"argv": [str(arg) for arg in argv], "stderr": str(where / f"run-{index}.stderr"),
             "exit": str(where / f"run-{index}.exit")} for index, argv in enumerate(runs)]
    (where / "plan.json").write_text(json.dumps(plan))
    done = forked.run(
        [sys.executable, str(script), "--batch", str(where / "plan.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [
        Done(int(Path(run["exit"]).read_text()), Path(run["stderr"]).read_text()) for run in plan
    ]
