"""The built documentation as a reader sees it: its pages opened in a real headless Chromium at 1280
px and at a phone's 390 px.

The code is highlighted (a keyword's colour is not the plain text's), no code block scrolls sideways
at 1280 px (at 390 px a code block scrolls inside its box), no page itself does at either width,
nothing is requested from another host, the copy button covers no code (on a phone the code scrolls
under it), and the search finds a page without a server. Marked
`browser` (the default run deselects it); CI runs it with Debian's chromium-headless-shell, driven
by Playwright (`python -m pytest -m browser`).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from support.pages import built_site

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
# The home page, each front-end's page (a whole program each), the journeys and recipes: pages of
# code.
CODE_PAGES = [
    "",
    "pytorch/",
    "lightning/",
    "fabric/",
    "accelerate/",
    "transformers/",
    "ray/",
    "journeys/",
    "torchft/",
    "recipes/",
]
# Pages of tables and prose, and the API reference's pages (the docstrings, with signatures).
TEXT_PAGES = ["lightning-reference/", "guarantees/", "how-tested/", "troubleshooting/",
              "changelog/", "api/",
              *(f"api/{package}/" for package in ("loader_resume", "lightning_resume",
                "accelerate_resume", "transformers_resume", "ray_resume", "torchft_resume"))]
# Pages with a figure (docs/figures.py's SVGs, the benchmark's plot).
FIGURE_PAGES = ["how-it-works/", "clusters/", "benchmarks/"]
WIDTH, PHONE = 1280, 390

CHROMIUM = os.environ.get("LOADER_RESUME_CHROMIUM") or next(
    (found for name in ("chromium-headless-shell", "chromium") if (found := shutil.which(name))),
    None,
)


@pytest.fixture(scope="module")
def site_url() -> Iterator[str]:
    site = built_site()
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


# Run in the page: every code block's overflow, the page's, and a highlighted keyword's colour
# against the plain text of its block.
MEASURE = """() => {
  const blocks = [...document.querySelectorAll('.md-content pre > code')];
  const overflowing = blocks
    .filter(code => code.scrollWidth > code.clientWidth + 1)
    .map(code => ({text: code.innerText.split('\\n')[0].slice(0, 60),
                   scroll: code.scrollWidth, client: code.clientWidth}));
  const keyword = document.querySelector(
    '.md-content .highlight code .kn, .md-content .highlight code .k');
  const comment = document.querySelector('.md-content .highlight code .c1');
  const plain = keyword ? getComputedStyle(keyword.closest('code')).color : null;
  const figures = [...document.querySelectorAll('.md-content img')].map(img => ({
    src: img.getAttribute('src'), loaded: img.complete && img.naturalWidth > 0, alt: img.alt,
    right: img.getBoundingClientRect().right, shown: img.getBoundingClientRect().width}));
  // the copy button of each code block, and the code text under it (the part in view)
  const covered = [];
  for (const pre of document.querySelectorAll('.md-content pre')) {
    const button = pre.querySelector('.md-code__button[data-md-type=copy]');
    const code = pre.querySelector('code');
    if (!button || !code) continue;
    const b = button.getBoundingClientRect();
    const box = code.getBoundingClientRect();
    const range = document.createRange();
    range.selectNodeContents(code);
    const under = [...range.getClientRects()].filter(r => r.width > 0 && r.right > box.left
      && r.left < box.right && r.left < b.right && r.right > b.left && r.top < b.bottom
      && r.bottom > b.top);
    if (under.length) covered.push(code.innerText.split('\\n')[0].slice(0, 60));
  }
  return {
    buttons: document.querySelectorAll('.md-content .md-code__button[data-md-type=copy]').length,
    covered,
    figures,
    viewport: window.innerWidth,
    blocks: blocks.length,
    overflowing,
    pageScroll: document.documentElement.scrollWidth,
    pageClient: document.documentElement.clientWidth,
    keyword: keyword ? getComputedStyle(keyword).color : null,
    comment: comment ? getComputedStyle(comment).color : null,
    plain,
  };
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    try:
        import playwright.sync_api as playwright_api
    except ImportError:
        pytest.fail(
            "the browser check needs Playwright: pip install playwright (it drives Debian's "
            "Chromium)"
        )
    if CHROMIUM is None:
        pytest.fail(
            "no Chromium: apt-get install chromium-headless-shell (or set LOADER_RESUME_CHROMIUM)"
        )
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def opened(browser: object, url: str, width: int) -> tuple[dict[str, object], list[str]]:
    """What MEASURE sees on the page at ``url`` in a window ``width`` px wide, and every URL the
    page requested."""
    viewport = {"width": width, "height": 900}
    context = browser.new_context(viewport=viewport)  # type: ignore[attr-defined]
    page = context.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(url, wait_until="networkidle")
    seen = page.evaluate(MEASURE)
    context.close()
    return seen, requested


@pytest.mark.parametrize("page_path", CODE_PAGES + TEXT_PAGES + FIGURE_PAGES)
@pytest.mark.parametrize("width", [WIDTH, PHONE])
def test_a_page_reads_well_on_a_screen_and_a_phone(browser: object, site_url: str, page_path: str,
                                                   width: int) -> None:
    seen, requested = opened(browser, site_url + page_path, width)
    if page_path in CODE_PAGES:
        assert seen["blocks"] > 0, "the page has code blocks"
        assert seen["keyword"] and seen["plain"], seen
        assert seen["keyword"] != seen["plain"], (
            f"a keyword is drawn in the plain text's colour: {seen}"
        )
        if seen["comment"]:
            assert seen["comment"] != seen["plain"], seen
        assert seen["buttons"] > 0, "code blocks have their copy button"
        assert not seen["covered"], (
            f"the copy button covers code at {width} px, in the blocks beginning: {seen['covered']}"
        )
        if width == WIDTH:
            assert not seen["overflowing"], (
                f"code blocks scroll sideways at {WIDTH} px: {seen['overflowing']}"
            )
    assert seen["pageScroll"] <= seen["pageClient"], (
        f"the page scrolls sideways at {width} px: {seen}"
    )
    if page_path in FIGURE_PAGES:  # each figure drawn, with alt text, inside the window
        assert seen["figures"], "the page shows a figure"
        for figure in seen["figures"]:
            assert figure["loaded"] and figure["alt"] and figure["shown"] > 0, figure
            assert figure["right"] <= seen["viewport"], (
                f"a figure leaves the window at {width} px: {figure}"
            )
    local = urlparse(site_url).netloc
    elsewhere = [url for url in requested if urlparse(url).scheme in ("http", "https", "ws", "wss")
                 and urlparse(url).netloc != local]
    assert not elsewhere, f"requests to another host: {elsewhere}"
    assert any("/assets/javascripts/bundle." in url for url in requested), (
        "the theme's script loaded"
    )


def test_search_finds_a_page_in_the_browser(browser: object, site_url: str) -> None:
    """Material's search runs in the page (a web worker over the built index): no search server."""
    viewport = {"width": WIDTH, "height": 900}
    context = browser.new_context(viewport=viewport)  # type: ignore[attr-defined]
    page = context.new_page()
    page.goto(site_url, wait_until="networkidle")
    page.focus("input.md-search__input")
    # keystrokes: the search listens to them, not to a filled value
    page.keyboard.type("requeue", delay=20)
    page.wait_for_selector(".md-search-result__item", timeout=15_000)
    found = page.eval_on_selector_all(
        ".md-search-result__item a", "links => links.map(a => a.href)"
    )
    context.close()
    assert any("/recipes/" in url for url in found), found
