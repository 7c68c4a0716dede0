"""A real one-node SLURM cluster for the tests: Debian's ``slurmctld``, ``slurmd`` and ``munge``
(``.ci/run`` installs them; the tests run as root, as CI does), started on this machine with a
configuration of their own under a temporary directory (free ports, their state, spool and logs
there), and stopped when the ``with`` block ends.

``SLURM_CONF`` in the environment of ``Cluster.env`` points SLURM's commands (``sbatch``,
``squeue``, ``scancel``, ``scontrol``) at it. The node runs jobs as the user that submits them, with
process groups for job steps (``proctrack/pgid``: no cgroups needed); ``JobRequeue=1`` so a batch
job may be requeued.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["Cluster", "cluster"]

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
# The states a job ends in (``squeue --help``'s base states); every other one (PENDING, RUNNING,
# CONFIGURING, COMPLETING, REQUEUED, SIGNALING, STAGE_OUT, RESIZING...) is on its way to one of
# these.
ENDED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "SPECIAL_EXIT",
    }
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """The running cluster: its environment for SLURM's commands, and helpers over them."""

    def __init__(self, root: Path) -> None:
        self.root, self.node = root, socket.gethostname().split(".")[0]
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                    "SLURM_CONF": str(root / "slurm.conf")}

    def run(self, *command: str) -> str:
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)
        assert done.returncode == 0, f"{' '.join(command)}: exit {done.returncode}: {done.stderr}"
        return done.stdout

    def submit(self, script: str, *options: str) -> int:
        """``sbatch OPTIONS`` of a batch script given as text; the job id."""
        path = self.root / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        return int(self.run("sbatch", "--parsable", *options, str(path)).strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Reason``, ``Restarts``...)."""
        text = self.run("scontrol", "show", "job", str(job))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def to_the_end(self, job: int, timeout: float = 600) -> dict[str, str]:
        """Wait for the job to end, starting it at once each time it waits for its ``BeginTime``
        after a requeue (SLURM sets it about two minutes on; an administrator may start it now:
        ``scontrol update JobId=N StartTime=now``). Its last fields."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job)
            if fields["JobState"] in ENDED:
                return fields
            if fields["JobState"] == "PENDING" and fields["Reason"] == "BeginTime":
                self.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            assert time.monotonic() < deadline, f"job {job} did not end: {fields}"
            time.sleep(0.3)


def _configuration(root: Path, node: str) -> str:
    return "\n".join(
        [
            "ClusterName=tests",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=30",
            "MinJobAge=600",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 "
            "State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
            "",
        ]
    )


def _munge() -> None:
    """``munged`` running (as the ``munge`` user, with the key Debian's package made), if it is not
    already."""
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return
    for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        os.makedirs(folder, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    deadline = time.monotonic() + 10
    while subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, "munged did not start"
        time.sleep(0.1)


@contextmanager
def cluster(root: Path) -> Iterator[Cluster]:
    """A one-node cluster under ``root``, idle and ready for jobs."""
    missing = [name for name in DAEMONS if shutil.which(name) is None
               and not os.path.exists(f"/usr/sbin/{name}")]
    assert not missing, (
        f"{missing} not installed: apt-get install slurmd slurmctld slurm-client munge (.ci/run "
        "does)"
    )
    for folder in ("state", "spool"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    slurm = Cluster(root)
    (root / "slurm.conf").write_text(_configuration(root, slurm.node))
    _munge()
    conf = str(root / "slurm.conf")
    subprocess.run(["/usr/sbin/slurmctld", "-f", conf, "-i"], check=True, env=slurm.env)
    subprocess.run(["/usr/sbin/slurmd", "-f", conf], check=True, env=slurm.env)
    try:
        deadline = time.monotonic() + 60
        while "idle" not in slurm.run("sinfo", "--noheader", "--format=%T"):
            assert time.monotonic() < deadline, (root / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.2)
        yield slurm
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=slurm.env, capture_output=True)
        for name in ("slurmd", "slurmctld"):
            pid = root / f"{name}.pid"
            if pid.exists():
                try:
                    os.kill(int(pid.read_text()), signal.SIGTERM)
                except (ValueError, ProcessLookupError):
                    pass
