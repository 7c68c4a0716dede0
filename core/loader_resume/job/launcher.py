"""A launcher that does not pass signals on: the training process follows its death instead.

A one-process ``accelerate launch train.py`` (Accelerate's ``simple_launcher``) starts the script as
a child and waits for it, with no signal handler of its own. A SIGTERM sent to the launcher — what a
scheduler or a container runtime sends to the process it started — ends the launcher at once (exit
143) and never reaches the script, which goes on, detached, until something kills it: no preemption
checkpoint. (With several processes Accelerate runs torch's elastic agent, which passes SIGTERM to
every rank, and a torchrun worker has ``TORCHELASTIC_RUN_ID``.)

So, while ``Preemption`` is installed in a process whose parent is such a launcher, the process asks
the kernel to send it the preemption signal when the launcher dies (Linux
``prctl(PR_SET_PDEATHSIG)``): a SIGTERM to the launcher becomes a SIGTERM here, handled as any other
(the agreed checkpoint at the next step boundary, exit 143 of the training process). Nothing changes
under other parents: a shell, ``nohup``, torchrun, SLURM's ``srun``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

__all__ = ["follow_launcher", "silent_launcher"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # NOTE: <linux/prctl.h>
_ACCELERATE_LAUNCH = ("accelerate", "accelerate-launch", "accelerate.commands.launch")
"""The program names (or ``-m`` module) that start Accelerate's launcher."""


def silent_launcher(parent: int | None = None) -> str | None:
    """The command line of this process's parent if it is a launcher that does not pass signals on
    (a one-process ``accelerate launch``), else ``None``."""
    if "TORCHELASTIC_RUN_ID" in os.environ or not sys.platform.startswith("linux"):
        return None
    try:
        words = (
            Path(f"/proc/{parent or os.getppid()}/cmdline")
            .read_bytes()
            .decode(errors="replace")
            .split("\0")
        )
    except OSError:
        return None
    names = [os.path.basename(word) for word in words[:3]]
    launches = any(name in _ACCELERATE_LAUNCH for name in names) and (
        "launch" in words[:4]
        or "accelerate-launch" in names
        or "accelerate.commands.launch" in names
    )
    return " ".join(word for word in words if word) if launches else None


def follow_launcher(signum: int | None) -> bool:
    """Ask for ``signum`` when a silent launcher (``silent_launcher``) dies; ``None``: ask for
    nothing any more. Whether it was asked (Linux only; a launcher already gone sends ``signum`` at
    once)."""
    if signum is None:
        if sys.platform.startswith("linux"):
            _prctl_death_signal(0)
        return False
    parent = os.getppid()
    command = silent_launcher(parent)
    if command is None or not _prctl_death_signal(signum):
        return False
    logger.info(
        "this process's launcher (%s) does not pass signals on: a %s to it reaches this process "
        "when it ends, and leads to the agreed checkpoint",
        command,
        signal.Signals(signum).name,
    )
    if os.getppid() != parent:  # NOTE: it ended before the kernel was asked: nothing will come
        os.kill(os.getpid(), signum)
    return True


def _prctl_death_signal(signum: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
