"""The documentation site: built strictly, offline when read (nothing fetched from another host),
code highlighted at build time, search without a server, and no code line wider than the page's code
box."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.pages import built_site

ROOT = Path(__file__).resolve().parents[2]
# characters: a code box at 1280 px holds this many without a horizontal scroll bar
MAX_CODE_LINE = 88

# Material's JavaScript bundle names a few URLs it loads only in a situation this site never
# creates; each is allowed here with that situation, and the test checks the situation is absent.
BUNDLE_URLS = {
    "https://unpkg.com/mermaid": "only on a page with a Mermaid diagram",
    "https://unpkg.com/resize-observer-polyfill": "only in a browser without ResizeObserver",
    "https://api.github.com/repos/": 'only for a data-md-component="source" link (the '
                                     'repository\'s star count)',
    "https://api.github.com/users/": 'only for a data-md-component="source" link',
    "https://bit.ly/2s3ChXG": "a link in the search worker's warning about an invalid query",
}


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


SNIPPET = re.compile(r'^\s*--8<-- "([^":]+)(?::([\w-]+))?"\s*$')


def _included(line: str) -> list[str] | None:
    """The lines a ``--8<-- "path"`` or ``--8<-- "path:section"`` line includes (section markers
    left out), or None for any other line."""
    match = SNIPPET.match(line)
    if match is None:
        return None
    text = (ROOT / match.group(1)).read_text()
    if match.group(2):
        start, end = f"[start:{match.group(2)}]", f"[end:{match.group(2)}]"
        text = text[text.index("\n", text.index(start)) + 1 : text.rindex("\n", 0, text.index(end))]
    return [line for line in text.splitlines() if "--8<-- [" not in line]


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Every line inside a fenced code block of a Markdown file, with its line number; a snippet
    line stands for the lines it includes (each with the snippet line's number)."""
    lines, fence = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and match:
            fence = match.group(1)
        elif (
            fence is not None
            and line.strip().startswith(fence)
            and line.strip() == fence[0] * len(line.strip())
        ):
            fence = None
        elif fence is not None:
            lines += [(number, included) for included in _included(line) or [line]]
    assert fence is None, f"{path.name}: a code block is not closed"
    return lines


def test_no_code_line_is_wider_than_the_code_box() -> None:
    too_long = [
        f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
        for path in _markdown_files()
        for number, line in _code_lines(path)
        if len(line) > MAX_CODE_LINE
    ]
    assert not too_long, f"code lines over {MAX_CODE_LINE} characters:\n" + "\n".join(too_long)


def test_the_line_check_sees_code_blocks() -> None:
    index = _code_lines(ROOT / "docs" / "index.md")
    assert any("ResumableDataLoader(" in line for _, line in index)
    assert not any(line.startswith("# loader-resume") for _, line in index)


@pytest.fixture(scope="module")
def site() -> Path:
    return built_site()


def _files(site: Path, *suffixes: str) -> list[Path]:
    return [path for path in site.rglob("*") if path.suffix in suffixes and path.is_file()]


EXTERNAL = r"(?:https?:)?//"


def test_no_page_loads_a_script_style_or_font_from_another_host(site: Path) -> None:
    found = []
    for page in _files(site, ".html"):
        html = page.read_text()
        for tag in re.findall(r"<(?:script|link|img|iframe|source)\b[^>]*>", html, re.I):
            if re.search(r"\b(?:src|href|srcset)\s*=\s*[\"']?" + EXTERNAL, tag, re.I):
                found.append(f"{page.relative_to(site)}: {tag}")
        for style in re.findall(r"<style\b.*?</style>", html, re.I | re.S):
            found += [f"{page.relative_to(site)}: {m}" for m in _css_loads(style)]
        for script in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.I | re.S):
            found += [f"{page.relative_to(site)}: {url}" for url in _urls(script)]
    for sheet in _files(site, ".css"):
        found += [f"{sheet.relative_to(site)}: {m}" for m in _css_loads(sheet.read_text())]
    assert not found, "\n".join(found)


def _css_loads(css: str) -> list[str]:
    imports = re.findall(r"@import\s+(?:url\()?\s*[\"']?" + EXTERNAL + r"[^;]*", css, re.I)
    urls = re.findall(r"url\(\s*[\"']?" + EXTERNAL + r"[^)]*\)", css, re.I)
    return imports + urls


def _urls(text: str) -> list[str]:
    return re.findall(r"https?://[A-Za-z0-9.-]+[^\s\"'`)]*", text)


def _without_comments(script: str) -> str:
    """A script without its comments (licences, references), where URLs are only text."""
    script = re.sub(r"/\*.*?\*/", "", script, flags=re.S)
    return "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("//"))


def test_scripts_fetch_nothing_from_another_host(site: Path) -> None:
    unexpected = sorted(
        {
            f"{script.relative_to(site)}: {url}"
            for script in _files(site, ".js")
            for url in _urls(_without_comments(script.read_text()))
            if not any(url.startswith(allowed) for allowed in BUNDLE_URLS)
        }
    )
    assert not unexpected, unexpected
    # The situations in which the bundle's URLs would be used never arise here. repo_url is set, but
    # the link to it is plain (overrides/partials/source.html): no source component to fetch for.
    assert not any(
        'data-md-component="source"' in page.read_text() for page in _files(site, ".html")
    )
    assert REPO_URL in (site / "index.html").read_text()
    assert not any('class="mermaid"' in page.read_text() for page in _files(site, ".html"))


def test_code_is_highlighted_at_build_time(site: Path) -> None:
    home = (site / "index.html").read_text()
    assert 'class="highlight"' in home
    # Pygments' token classes: a keyword and a name, in the page itself (no highlighter runs in the
    # browser).
    assert re.search(r'<span class="k">def</span>', home), (
        "Python code carries Pygments' token spans"
    )
    assert "highlight.js" not in home and "hljs" not in home
    assert not _urls("".join(re.findall(r'<link\b[^>]*rel="stylesheet"[^>]*>', home)))


def test_search_works_without_a_server(site: Path) -> None:
    index = site / "search" / "search_index.json"
    assert index.is_file() and '"location":"accelerate/"' in index.read_text().replace(" ", "")
    workers = list((site / "assets" / "javascripts" / "workers").glob("search.*.js"))
    assert workers, "Material's search runs in a web worker shipped with the site"
    assert 'id="__search"' in (site / "index.html").read_text()


FRONT_ENDS = [
    "pytorch.md",
    "lightning.md",
    "fabric.md",
    "accelerate.md",
    "transformers.md",
    "ray.md",
]


@pytest.mark.parametrize("page", [*FRONT_ENDS, "torchft.md"])
def test_a_front_end_page_opens_with_the_change_then_a_whole_program_then_the_rest(
    page: str,
) -> None:
    text = (ROOT / "docs" / page).read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[:3] == ["The change", "A whole program", "What happens"], sections
    # TorchFT's page goes on with when to use it, its guarantees and limits, its troubleshooting
    assert page == "torchft.md" or sections[3] == "Reference", sections
    change = text[text.index("\n## The change\n") : text.index("\n## A whole program\n")]
    assert re.search(r"^```diff\n(.*\n)*\+", change, re.M), f"{page}: the change is a diff"
    program = text[text.index("\n## A whole program\n") : text.index("\n## What happens\n")]
    assert ".runnable" in program, f"{page}: the whole program is marked runnable"
    assert "!!! " in text, f"{page}: its limits and warnings are set apart as admonitions"


def test_the_recipes_name_their_tested_programs() -> None:
    recipes = (ROOT / "docs" / "recipes.md").read_text()
    sections = re.findall(r"^## (.+)$", recipes, re.M)
    assert len(sections) == 6 and all(
        "Tested:" in part for part in re.split(r"^## .+$", recipes, flags=re.M)[1:]
    )
    for path in re.findall(r"`((?:examples|tests|tests_ray)/[\w/]+\.py)", recipes):
        assert (ROOT / path).is_file(), path
    for path, name in re.findall(r"`((?:tests|tests_ray)/[\w/]+\.py)::(\w+)`", recipes):
        assert f"def {name}(" in (ROOT / path).read_text(), (path, name)


REPO_URL = "https://github.com/loader-resume/loader-resume"
EXAMPLES = {
    "pytorch.md": "plain_digits.py",
    "lightning.md": "lightning_digits.py",
    "fabric.md": "fabric_digits.py",
    "accelerate.md": "accelerate_digits.py",
    "transformers.md": "transformers_digits.py",
    "ray.md": "ray_digits.py",
}


def test_the_site_shows_the_release_of_pyproject() -> None:
    version = re.search(
        r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M
    ).group(1)
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(rf"^copyright: loader-resume {re.escape(version)} ", config, re.M), (
        "mkdocs.yml's copyright line"
    )
    assert f"repo_url: {REPO_URL}\n" in config
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and re.search(
        rf"^## \[{re.escape(version)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M
    )
    init = (ROOT / "core" / "loader_resume" / "__init__.py").read_text()
    assert f'__version__ = "{version}"' in init


@pytest.mark.parametrize("page", FRONT_ENDS)
def test_a_front_end_page_links_to_its_example(page: str) -> None:
    example = EXAMPLES[page]
    assert (ROOT / "examples" / example).is_file()
    assert f"]({REPO_URL}/blob/main/examples/{example})" in (ROOT / "docs" / page).read_text()


@pytest.mark.parametrize("page", FRONT_ENDS)
def test_a_front_end_program_is_its_whole_example_included_from_the_file(page: str) -> None:
    """One source: the page shows the file CI runs, never a copy that can drift from it."""
    text = (ROOT / "docs" / page).read_text()
    program = text[text.index("\n## A whole program\n") : text.index("\n## What happens\n")]
    assert f'--8<-- "examples/{EXAMPLES[page]}"' in program
    assert re.search(
        r'``` \{ \.python \.runnable title="' + re.escape(EXAMPLES[page])
        + r'" hl_lines="[\d ]+" \}',
        program,
    )


def test_the_line_check_reads_included_files() -> None:
    home = _code_lines(ROOT / "docs" / "index.md")
    assert any("preemption = Preemption(" in line for _, line in home)
    assert not any("--8<--" in line for _, line in home)


def test_the_fsdp_launch_configuration_is_one_accelerate_reads() -> None:
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    config = config_args.load_config_from_file(str(ROOT / "configs" / "accelerate_fsdp.yaml"))
    assert config.distributed_type == "FSDP"
    assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


# NOTE: the pages describe the product as it is; its history is the changelog's, and how it is built
# is the development page's
HISTORY = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|[Ll]ast run|[Ww]here it last ran|once existed|used to \w+ (?:a|the)\b"
    r"|no longer|[Pp]reviously|was fixed|fixed in \d|\bbefore (?:this|that) release"
)


def test_user_pages_hold_no_dated_status_lines_or_history() -> None:
    pages = [ROOT / "README.md"] + [
        path for path in sorted((ROOT / "docs").rglob("*.md"))
        if path.name not in ("changelog.md", "development.md")
    ]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in pages
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert found == []


def test_the_history_check_sees_dates_and_history() -> None:
    for line in ("Last run: 63 passed (2026-11-27).", "a bug of this kind once existed",
                 "fixed in 5.20", "it no longer reads them"):
        assert HISTORY.search(line), line
    assert not HISTORY.search("transformers 5.18 and newer place it on `cpu`")


