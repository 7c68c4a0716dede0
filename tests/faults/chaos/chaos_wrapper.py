"""Run a training script (runpy) under a seeded kill plan: ``torchrun ... chaos_wrapper.py SCRIPT
[ARGS...]``.

``$CHAOS_PLAN`` is a JSON list of kills ``{"rank": r, "after": k, "in_save": bool}``, made in turn,
one per torchrun attempt: rank ``r`` SIGKILLs itself right after its ``k``-th optimizer step of the
attempt — or, with ``in_save``, in the middle of its first checkpoint write after that step: the
biggest file written so far is cut to half its bytes before the manifest and the rename (rank 0
writes the checkpoints). Kill ``i`` leaves the file ``$CHAOS_DIR/killed-i``, so the next attempt
makes the next kill (an attempt that died for another reason does not shift the plan).
``$CHAOS_STEP_SLEEP`` seconds are slept after every optimizer step. While the file ``$CHAOS_HOLD``
exists, each rank waits after its optimizer step (the test decides when the job may go on: it cannot
end before the events the test waits for), leaving ``$CHAOS_DIR/held-NAME-RANK-of-WORLD`` (NAME: the
file's text) so the test sees which world is held; a preemption signal (the agent stopping the
worker) ends the wait.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

import loader_resume.job.checkpoint as checkpoint

RANK = int(os.environ.get("RANK", 0))
PLAN, DIR = json.loads(os.environ.get("CHAOS_PLAN", "[]")), Path(os.environ.get("CHAOS_DIR", "."))
DONE = len(list(DIR.glob("killed-*")))
KILL = PLAN[DONE] if DONE < len(PLAN) and PLAN[DONE]["rank"] == RANK else None
SLEEP = float(os.environ.get("CHAOS_STEP_SLEEP", 0))
HOLD = Path(os.environ["CHAOS_HOLD"]) if os.environ.get("CHAOS_HOLD") else None
steps = 0


def die() -> None:
    (DIR / f"killed-{DONE}").touch()
    os.kill(os.getpid(), signal.SIGKILL)


def signalled() -> bool:
    """Whether the script's preemption handler (a ``Preemption``'s, installed for SIGTERM) caught a
    signal."""
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(getattr(handler, "__self__", None), "received", None) is not None


def hold() -> None:
    while HOLD is not None and not signalled():
        try:
            name = HOLD.read_text().strip()
        except FileNotFoundError:
            return
        (DIR / f"held-{name}-{RANK}-of-{os.environ.get('WORLD_SIZE', '1')}").touch()
        time.sleep(0.05)


def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global steps
    steps += 1
    if SLEEP:
        time.sleep(SLEEP)
    hold()
    if KILL is not None and not KILL["in_save"] and steps == KILL["after"]:
        die()


_seal = checkpoint.seal


def seal(directory: Path, final: Path, **options: Any) -> None:
    if KILL is not None and KILL["in_save"] and steps >= KILL["after"]:
        biggest = max(
            (p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
        )
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
        die()
    _seal(directory, final, **options)


register_optimizer_step_post_hook(after_step)
checkpoint.seal = seal
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).parent))
runpy.run_path(script, run_name="__main__")
