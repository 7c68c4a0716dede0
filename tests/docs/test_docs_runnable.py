"""Each front-end page's program, copied from the built page into an empty directory, runs as
the page says: the commands of its runnable block in order, the one it says to stop stopped by
SIGTERM mid-run (exit 143), and the same command again continuing with the uninterrupted run's
steps and ending with its final weights. The highlighted lines of every page's program are the
ones its text names.

The pages' programs need only the package and its front-end's extras (Ray's and TorchFT's run in
their own suites: ``tests_ray/test_ray_example.py``, ``tests_torchft/test_torchft_page.py``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import forked
from support.launch import free_port
from support.pages import Command, Program, blocks, built_site, runnable

ROOT = Path(__file__).resolve().parents[2]
# The pages whose programs run in this suite's environment.
PAGES = ["pytorch/", "lightning/", "fabric/", "accelerate/", "transformers/"]
PROGRESS = re.compile(r"^epoch (\d+) step (\d+)\b(.*)$")
DIGEST = "final weights digest: "


def progress(output: str) -> dict[int, tuple[int, str]]:
    """step: (epoch, the rest of the line: the loss where it is printed) of every progress line a
    program printed."""
    return {
        int(found.group(2)): (int(found.group(1)), found.group(3))
        for line in output.splitlines()
        if (found := PROGRESS.match(line))
    }


def digest(output: str) -> str:
    found = [line for line in output.splitlines() if line.startswith(DIGEST)]
    assert found, f"no '{DIGEST}' line in:\n{output[-3000:]}"
    return found[-1][len(DIGEST):]


def environment(command: Command, audit: Path) -> dict[str, str]:
    """The page's variables over ours, with every run's batches audited into ``audit`` (each
    front-end reads ``$LOADER_RESUME_AUDIT``; the plain program takes it for its ``--audit``) and
    torchrun on a free port (``PET_MASTER_PORT``: its ``--master-port``)."""
    return {**os.environ, "LOADER_RESUME_AUDIT": str(audit), "PET_MASTER_PORT": str(free_port()),
            **command.environment}


def audited(audit: Path) -> dict[str, Any]:
    """``loader-resume audit`` of one job's log: it must pass (exit 0: every sample of each epoch
    it ran once, across the stop, nothing left unchecked); its report."""
    done = forked.run([str(Path(sys.executable).with_name("loader-resume")), "audit", str(audit),
                       "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (report,) = json.loads(done.stdout)
    assert report["epochs"], report
    return dict(report)


def processes(command: Command) -> int:
    """How many processes the page says a command starts (a launcher's count, else one)."""
    for flag in ("--nproc_per_node", "--num_processes", "--devices"):
        if flag in command.words:
            return int(command.words[command.words.index(flag) + 1])
    return 1


def run(command: Command, directory: Path, audit: Path) -> subprocess.CompletedProcess[str]:
    done = forked.run(command.argv(), cwd=directory, env=environment(command, audit),
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{' '.join(command.words)} in {directory}: exit {done.returncode}\n{done.stderr[-3000:]}"
    )
    return done


def stop_mid_run(command: Command, directory: Path, audit: Path) -> str:
    """Run ``command``, SIGTERM it at its first progress line after step 0; it must exit 143
    before its end. Its output."""
    process = forked.popen(command.argv(), cwd=directory, text=True,
                           env=environment(command, audit),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        found = PROGRESS.match(line.strip())
        if found and int(found.group(2)) > 0:
            process.send_signal(signal.SIGTERM)
            break
    rest = process.communicate(timeout=120)[0]
    output = "".join(seen) + rest
    assert process.returncode == 143 and DIGEST not in output, (
        f"SIGTERM mid-run: exit {process.returncode}\n{output[-3000:]}"
    )
    return output


@pytest.mark.parametrize("page", PAGES)
def test_a_front_end_pages_program_runs_as_copied_into_an_empty_directory(
    page: str, tmp_path: Path
) -> None:
    program: Program = runnable(page)
    assert all("/" not in name for name in program.files)
    stopped = [k for k, command in enumerate(program.commands) if command.stopped]
    assert len(stopped) == 1, f"{page}: the page says to stop one command mid-run"
    k = stopped[0]
    assert program.commands[k + 1].words == program.commands[k].words, (
        f"{page}: the command after the stopped one is the same command"
    )
    program.save(tmp_path / "uninterrupted")
    uninterrupted = run(program.commands[k], tmp_path / "uninterrupted",
                        tmp_path / "audit-0").stdout
    directory = tmp_path / "copied"
    program.save(directory)
    audits = {n: tmp_path / f"audit-{n + 1}" for n in range(len(program.commands))}
    audits[k + 1] = audits[k]  # the rerun continues the stopped job
    for n, command in enumerate(program.commands[:k]):
        run(command, directory, audits[n])
    cut = stop_mid_run(program.commands[k], directory, audits[k])
    rerun = run(program.commands[k + 1], directory, audits[k]).stdout
    # it continued: every step it printed is after the stop's, with the uninterrupted run's loss
    steps, done = progress(rerun), progress(uninterrupted)
    assert steps and min(steps) > max(progress(cut)), (cut[-2000:], rerun[-2000:])
    assert all(done[step] == steps[step] for step in steps), (steps, done)
    assert digest(rerun) == digest(uninterrupted)
    # the stopped job's audit: every sample once per epoch across the stop, in two attempts
    assert len(audited(audits[k])["attempts"]) == 2
    for n, command in enumerate(program.commands[k + 2:], k + 2):
        assert digest(run(command, directory, audits[n]).stdout)
        # as many processes as the page says, each with its share
        assert {attempt["world"] for attempt in audited(audits[n])["attempts"]} == {
            processes(command)
        }, " ".join(command.words)


def test_every_page_with_a_runnable_block_is_run_by_a_test() -> None:
    """A block marked runnable on any page runs somewhere: here, or in the Ray and TorchFT
    suites."""
    site = built_site()
    marked = sorted(
        str(path.parent.relative_to(site)) + "/"
        for path in site.rglob("index.html")
        if 'class="runnable highlight"' in path.read_text()
    )
    assert marked == sorted([*PAGES, "ray/", "torchft/"])


# What each page's text names as its highlighted lines: the lines holding these (with the rest
# of the statement a line opens). The text says why; this keeps the numbers on the lines as the
# files change.
PLAIN = ["gather_states(loader)", "gather_rng_states()}", "verify(found[-1])",
         "load_rank_state(loader,", "set_global_rng_state(rng", "loader = ResumableDataLoader(",
         "preemption = Preemption(", "preemption.agreed()", "save(root, step, epoch +",
         "raise SystemExit(143)"]
HIGHLIGHTED = {
    "lightning/": ["from lightning_resume import ResumeCallback",
                   "return DataLoader(NoisyDigits()", "ResumeCallback(dirpath=root",
                   "trainer.fit(model)"],
    "fabric/": ["from lightning_resume import FabricResume", "resume = FabricResume(",
                "fabric.setup_dataloaders(", "state = {", "resume.restore(state)",
                "in resume.epochs("],
    "accelerate/": ["from accelerate_resume import enable_resume", "resume = enable_resume(",
                    "DataLoader(NoisyDigits()", "= accelerator.prepare(", "resume.restore()",
                    "in resume.epochs("],
    "transformers/": ["from transformers_resume import ResumableTrainer",
                      "trainer = ResumableTrainer(",
                      "trainer.train(resume_from_checkpoint=True)"],
    "ray/": ["from ray_resume import RayResume, to_device", "loader = ResumableDataLoader(",
             "resume = RayResume(", "in resume.epochs(", "= to_device(", "resume.step_end(",
             "run_config=RunConfig("],
    "pytorch/": PLAIN,
    "": PLAIN,
}


def statement_lines(lines: list[str], anchors: list[str]) -> set[int]:
    """The 1-based numbers of the lines holding each anchor (exactly one line each), with the lines
    that continue the statement the line leaves open (brackets)."""
    numbers: set[int] = set()
    for anchor in anchors:
        found = [number for number, line in enumerate(lines) if anchor in line]
        assert len(found) == 1, f"{anchor!r} is on {len(found)} lines, expected one"
        number, depth = found[0], 0
        while True:
            numbers.add(number + 1)
            code = re.sub(r"#.*$|'[^']*'|\"[^\"]*\"", "", lines[number])
            depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
            if depth <= 0:
                break
            number += 1
    return numbers


@pytest.mark.parametrize("page", sorted(HIGHLIGHTED))
def test_the_highlighted_lines_are_the_ones_the_text_names(page: str) -> None:
    (block,) = [block for block in blocks(page) if block.highlighted]
    expected = statement_lines(block.lines, HIGHLIGHTED[page])
    assert set(block.highlighted) == expected, (
        f"{page or 'home'}: hl_lines=\"{' '.join(map(str, sorted(expected)))}\" would highlight "
        + "; ".join(block.lines[n - 1].strip() for n in sorted(expected))
    )


def test_the_page_reader_sees_files_commands_and_highlighting() -> None:
    program = runnable("lightning/")
    assert set(program.files) == {"lightning_digits.py", "lightning_digits.yaml"}
    assert "ResumeCallback(" in program.files["lightning_digits.py"]
    assert not any("--8<--" in text for text in program.files.values())
    assert [command.stopped for command in program.commands][:2] == [True, False]
    (block,) = [block for block in blocks("lightning/") if block.highlighted]
    assert any("from lightning_resume import ResumeCallback" in block.lines[n - 1]
               for n in block.highlighted)
