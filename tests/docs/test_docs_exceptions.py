"""Every exception the docs name imports from where they say: each ``### `XError` `` entry of the
troubleshooting page is on the API page as ``::: module.XError``, and every dotted ``module.XError``
any page or the README writes, imported from that module, is that very class."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGE = r"(?:loader_resume|lightning_resume|accelerate_resume|transformers_resume)"
DOTTED = re.compile(rf"\b({PACKAGE}(?:\.\w+)+)\.(\w+Error)\b")


def _named() -> dict[str, set[str]]:
    """Each exception class name the pages write dotted -> the modules they write it under."""
    named: dict[str, set[str]] = {}
    for page in PAGES:
        for module, name in DOTTED.findall(page.read_text()):
            named.setdefault(name, set()).add(module)
    return named


def test_every_exception_on_the_troubleshooting_page_is_on_the_api_page_under_a_module() -> None:
    headings = re.findall(
        r"^### `(\w+Error)`", (ROOT / "docs" / "troubleshooting.md").read_text(), re.M
    )
    assert "AuditFormatError" in headings and "StateError" in headings
    api = "\n".join(page.read_text() for page in sorted((ROOT / "docs" / "api").glob("*.md")))
    missing = [name for name in headings if not re.search(rf"^::: [\w.]+\.{name}\s*$", api, re.M)]
    assert not missing, f"named on the troubleshooting page, not on the API page: {missing}"


def test_every_dotted_exception_the_docs_write_imports_from_there() -> None:
    named = _named()
    assert "loader_resume.audit.check" in named.get("AuditFormatError", set()), (
        "the scan sees the API page"
    )
    wrong = []
    for name, modules in sorted(named.items()):
        for module in sorted(modules):
            try:
                found = getattr(importlib.import_module(module), name, None)
            # a module of a framework not installed here is not a wrong name
            except ImportError as error:
                assert "loader_resume" not in module, f"{module}: {error}"
                continue
            if not (isinstance(found, type) and issubclass(found, Exception)):
                wrong.append(f"{module}.{name}")
    assert not wrong, f"the docs name these, but they do not import from there: {wrong}"
