"""The README is the front door: short, its links resolve, and its two commands are one line
each."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def test_the_readme_stays_a_front_door() -> None:
    assert len(README.splitlines()) <= 300


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert links, "the README links to the docs"
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing


def test_the_two_commands_are_one_line_each() -> None:
    # One command each, to copy whole; a long one is wrapped with a backslash (code lines stay <= 88
    # characters).
    blocks = [
        block.replace("\\\n", " ")
        for block in re.findall(r"```bash\n(.*?)```", _section("Two commands"), re.S)
    ]
    assert [block.count("\n") for block in blocks] == [1, 1], blocks
    main_job, tests = (block.strip() for block in blocks)
    assert main_job.endswith("python examples/digits_resume.py") and "torch==2.13.0" in main_job
    assert tests == "bash .ci/run"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    navigation = (ROOT / "mkdocs.yml").read_text()
    docs = ROOT / "docs"
    pages = sorted(page.relative_to(docs).as_posix() for page in docs.rglob("*.md"))
    assert "api/index.md" in pages
    assert [page for page in pages
            if f": {page}\n" not in navigation and f"- {page}\n" not in navigation] == []


def _named_test_paths() -> dict[str, list[str]]:
    """Each ``tests/...`` file or folder the README, the docs, the changelog's unreleased part and
    ``.ci`` name."""
    sources = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / ".ci").glob("*")),
    ]
    named: dict[str, list[str]] = {}
    for source in sources:
        if source.is_file() and source.suffix in {".md", ""}:
            for path in re.findall(r"\btests/[\w/*.-]*\w", source.read_text()):
                named.setdefault(path, []).append(source.name)
    return named


def test_every_test_file_the_docs_name_exists() -> None:
    """The pages say which test shows what (``tests/frontdoors/test_lightning.py``): each path named
    is there."""
    named = _named_test_paths()
    assert len(named) > 40, sorted(named)
    missing = {path: where for path, where in named.items()
               if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())}
    assert not missing, missing
