"""Each front-end page's program, copied from the built page into an empty directory, runs as
the page says: the commands of its runnable block in order, the one it says to stop stopped by
SIGTERM mid-run (exit 143), and the same command again continuing with the uninterrupted run's
steps and ending with its final weights. The highlighted lines of every page's program are the
ones its text names.

The pages' programs need only the package and its front-end's extras (Ray's and TorchFT's run in
their own suites: ``tests_ray/test_ray_example.py``, ``tests_torchft/test_torchft_page.py``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import forked
from support.pages import Command, Program, blocks, runnable

ROOT = Path(__file__).resolve().parents[2]
# The pages whose programs run in this suite's environment.
PAGES = ["pytorch/", "lightning/", "fabric/", "accelerate/", "transformers/"]
PROGRESS = re.compile(r"^epoch (\d+) step (\d+)\b(.*)$")
DIGEST = "final weights digest: "


def argv(command: Command) -> list[str]:
    """The command as this environment runs it: ``python`` is this interpreter, a launcher
    (``torchrun``, ``accelerate``) the one installed beside it."""
    first, *rest = command.words
    if first == "python":
        return [sys.executable, *rest]
    launcher = Path(sys.executable).with_name(first)
    assert launcher.is_file(), f"{first}: not installed beside {sys.executable}"
    return [str(launcher), *rest]


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


def run(command: Command, directory: Path) -> subprocess.CompletedProcess[str]:
    done = forked.run(argv(command), cwd=directory, env={**os.environ, **command.environment},
                      capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{' '.join(command.words)} in {directory}: exit {done.returncode}\n{done.stderr[-3000:]}"
    )
    return done


def stop_mid_run(command: Command, directory: Path) -> str:
    """Run ``command``, SIGTERM it at its first progress line after step 0; it must exit 143
    before its end. Its output."""
    process = forked.popen(argv(command), cwd=directory, text=True,
                           env={**os.environ, **command.environment},
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
    uninterrupted = run(program.commands[k], tmp_path / "uninterrupted").stdout
    directory = tmp_path / "copied"
    program.save(directory)
    for command in program.commands[:k]:
        run(command, directory)
    cut = stop_mid_run(program.commands[k], directory)
    rerun = run(program.commands[k + 1], directory).stdout
    # it continued: every step it printed is after the stop's, with the uninterrupted run's loss
    steps, done = progress(rerun), progress(uninterrupted)
    assert steps and min(steps) > max(progress(cut)), (cut[-2000:], rerun[-2000:])
    assert all(done[step] == steps[step] for step in steps), (steps, done)
    assert digest(rerun) == digest(uninterrupted)
    for command in program.commands[k + 2:]:
        assert digest(run(command, directory).stdout)


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
