"""The TorchFT page's program, ``train.py``, copied from the built page into an empty directory and
run with the page's commands: the lighthouse, then every replica group; the group the page says to
kill is SIGKILLed mid-run and started again with the same command. Every group ends (exit 0) with
the same final weights, and the job's audit finds every sample trained once per epoch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.pages import runnable

BIN = Path(sys.executable).parent
DIGEST = re.compile(r"^final weights digest: (\w+)$", re.M)


def test_the_pages_program_survives_a_killed_group_as_the_page_says(tmp_path: Path) -> None:
    program = runnable("torchft/")
    assert set(program.files) == {"train.py"}
    program.save(tmp_path)
    lighthouse, *groups = program.commands
    assert lighthouse.words[0] == "torchft_lighthouse"
    (k,) = [k for k, command in enumerate(groups) if command.killed]
    assert (groups[k + 1].words, groups[k + 1].environment) == (
        groups[k].words, groups[k].environment), "the killed group is started again the same way"
    env = {**os.environ, "LOADER_RESUME_AUDIT": str(tmp_path / "audit")}
    started = [subprocess.Popen(lighthouse.argv(), cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)]
    try:
        time.sleep(0.5)
        assert started[0].poll() is None, "the page's lighthouse did not start (its port taken?)"
        outputs = []
        for n, command in enumerate(groups):
            if n == k + 1:
                continue  # started once its first run is killed
            outputs.append(tmp_path / f"{n}.out")
            started.append(subprocess.Popen(
                command.argv(), cwd=tmp_path, env={**env, **command.environment},
                stdout=outputs[-1].open("w"), stderr=subprocess.STDOUT))
        killed = started[1 + k]
        deadline = time.monotonic() + 240
        while not re.search(r"^group \d+ step [1-9]", outputs[k].read_text(), re.M):
            assert killed.poll() is None and time.monotonic() < deadline, (
                outputs[k].read_text()[-3000:]
            )
            time.sleep(0.05)
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        outputs.append(tmp_path / "again.out")
        again = groups[k + 1]
        started.append(subprocess.Popen(
            again.argv(), cwd=tmp_path, env={**env, **again.environment},
            stdout=outputs[-1].open("w"), stderr=subprocess.STDOUT))
        running = [p for n, p in enumerate(started[1:]) if n != k]
        assert [p.wait(timeout=300) for p in running] == [0] * len(running), [
            path.read_text()[-2000:] for path in outputs
        ]
        assert started[0].poll() is None, "the page's lighthouse ran throughout"
    finally:
        for process in started:
            process.kill()
            process.wait()
    finished = [path for n, path in enumerate(outputs) if n != k]
    digests = {DIGEST.findall(path.read_text())[-1] for path in finished}
    assert len(digests) == 1, digests
    assert not DIGEST.search(outputs[k].read_text()), "the killed group did not finish"
    done = subprocess.run([str(BIN / "loader-resume"), "audit", str(tmp_path / "audit"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (report,) = json.loads(done.stdout)
    assert [row["status"] for row in report["epochs"]] == ["ok"] * 3, report["epochs"]
