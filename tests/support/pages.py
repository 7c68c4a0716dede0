"""The documentation site as a reader sees it: the built pages, and the programs they mark runnable.

A page marks what a reader copies and runs with the class ``runnable`` on its code blocks
(```` ``` { .python .runnable title="train.py" } ````): a block with a title is a file, saved under
that name; a block without one holds the commands, one a line (``\\`` continues a line; a ``#``
comment ends it). A command whose comment says ``kill -TERM`` is the one the reader stops mid-run
(``kill -9``: kills); the command after it is the one that continues. :func:`runnable` reads them
from the built HTML, so what is tested is what the page shows (its included files, its
highlighting), not the Markdown.

The site is built once per test process (``mkdocs build --strict``), or read from
``$BUILT_DOCS_SITE``, a site ``.ci/run`` has built (the Ray and TorchFT suites' venvs have no
mkdocs).
"""

from __future__ import annotations

import html.parser
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Block", "Command", "Program", "built_site", "blocks", "runnable"]

ROOT = Path(__file__).resolve().parents[2]
_SITE: list[Path] = []


def built_site() -> Path:
    """The built site: ``$BUILT_DOCS_SITE``, else a strict build of ``docs/`` into a temporary
    directory (once per process)."""
    if os.environ.get("BUILT_DOCS_SITE"):
        site = Path(os.environ["BUILT_DOCS_SITE"])
        assert (site / "index.html").is_file(), (
            f"BUILT_DOCS_SITE={site} holds no built site (expected its index.html): "
            "mkdocs build --strict --site-dir DIR"
        )
        return site
    if not _SITE:
        mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which(
            "mkdocs"
        )
        assert mkdocs, (
            "no mkdocs here (the docs extra): build the site elsewhere and set "
            "BUILT_DOCS_SITE to its directory"
        )
        site = Path(tempfile.mkdtemp(prefix="loader-resume-site-"))
        subprocess.run([mkdocs, "build", "--strict", "--quiet", "--site-dir", str(site)],
                       cwd=ROOT, check=True)
        _SITE.append(site)
    return _SITE[0]


@dataclass
class Block:
    """One code block of a built page: its classes, its title (a file name), its text, and the
    1-based numbers of its highlighted lines."""

    classes: list[str]
    title: str | None
    text: str = ""
    highlighted: list[int] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


class _Reader(html.parser.HTMLParser):
    """Material's code blocks: ``<div class="... highlight"><span class="filename">T</span><pre>
    <code>...</code></pre></div>``, a highlighted line inside ``<span class="hll">``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[Block] = []
        self._block: Block | None = None
        self._in_title = self._in_code = False
        self._spans: list[bool] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div" and "highlight" in classes and self._block is None:
            self._block = Block(classes=classes, title=None)
        elif self._block is not None and tag == "span" and "filename" in classes:
            self._in_title = True
            self._block.title = ""
        elif self._block is not None and tag == "code":
            self._in_code = True
        elif self._in_code and tag == "span":
            if "hll" in classes:
                self._block.highlighted.append(self._block.text.count("\n") + 1)  # type: ignore[union-attr]
            self._spans.append("hll" in classes)

    def handle_endtag(self, tag: str) -> None:
        if self._in_title and tag == "span":
            self._in_title = False
        elif self._in_code and tag == "span" and self._spans:
            self._spans.pop()
        elif self._in_code and tag == "code":
            self._in_code = False
        elif self._block is not None and tag == "div" and not self._in_code:
            self.blocks.append(self._block)
            self._block = None

    def handle_data(self, data: str) -> None:
        if self._in_title and self._block is not None:
            self._block.title = (self._block.title or "") + data
        elif self._in_code and self._block is not None:
            self._block.text += data


def blocks(page: str) -> list[Block]:
    """Every code block of a built page (``"lightning/"``, ``""`` for the home page)."""
    reader = _Reader()
    reader.feed((built_site() / page / "index.html").read_text())
    return reader.blocks


@dataclass
class Command:
    """A command line of a page: its words, its variables, and whether the page says to stop it
    mid-run (``kill -TERM``) or kill it (``kill -9``)."""

    words: list[str]
    environment: dict[str, str]
    stopped: bool
    killed: bool = False

    def argv(self) -> list[str]:
        """The command as this environment runs it: ``python`` is this interpreter, a launcher
        (``torchrun``, ``accelerate``, ``torchft_lighthouse``) the one installed beside it."""
        first, *rest = self.words
        if first == "python":
            return [sys.executable, *rest]
        launcher = Path(sys.executable).with_name(first)
        assert launcher.is_file(), f"{first}: not installed beside {sys.executable}"
        return [str(launcher), *rest]


@dataclass
class Program:
    """What a page gives a reader to run: files by name, and the commands, in order."""

    files: dict[str, str]
    commands: list[Command]

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in self.files.items():
            (directory / name).write_text(text)


def _commands(text: str) -> list[Command]:
    commands: list[Command] = []
    pending = ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        code, _, comment = line.partition("#")
        if not code.strip():
            continue
        words = shlex.split(code)
        environment = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            environment[key] = value
        commands.append(Command(words, environment, stopped="kill -TERM" in comment,
                                killed="kill -9" in comment))
    return commands


def runnable(page: str) -> Program:
    """The files and commands a built page marks ``runnable``."""
    found = [block for block in blocks(page) if "runnable" in block.classes]
    files = {block.title: block.text for block in found if block.title}
    scripts = [block for block in found if not block.title]
    assert files and len(scripts) == 1, (
        f"{page}: expected runnable files and one runnable block of commands, found "
        f"{sorted(files)} and {len(scripts)} command blocks"
    )
    return Program(files, _commands(scripts[0].text))
