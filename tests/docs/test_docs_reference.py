"""The API reference (docs/api/, a page per package) lists every public name, each on its
package's page, and the docstrings it renders are Markdown that mkdocstrings reads: no Sphinx role
(``:class:`X```) shown as raw text. Read from the sources, nothing imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "loader_resume": ROOT / "core" / "loader_resume",
    "lightning_resume": ROOT / "lightning_resume",
    "accelerate_resume": ROOT / "accelerate_resume",
    "transformers_resume": ROOT / "transformers_resume",
    "ray_resume": ROOT / "ray_resume",
    "torchft_resume": ROOT / "torchft_resume",
}
# Public modules beside the packages themselves: their whole __all__ is public too.
PUBLIC_MODULES = {"loader_resume.testing": PACKAGES["loader_resume"] / "testing.py",
                  "loader_resume.distributed": PACKAGES["loader_resume"] / "distributed.py"}
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const|ref|term)s?:`")


def _directives() -> set[str]:
    return {name for page in sorted((ROOT / "docs" / "api").glob("*.md"))
            for name in re.findall(r"^::: (\S+)\s*$", page.read_text(), re.M)}


def _all(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path}: no __all__")


def _sources() -> list[Path]:
    return sorted(path for folder in PACKAGES.values() for path in folder.rglob("*.py"))


def test_every_name_of_each_public_module_is_on_the_api_page() -> None:
    directives = _directives()
    modules = {name: folder / "__init__.py" for name, folder in PACKAGES.items()} | PUBLIC_MODULES
    missing = [f"{module}.{name}" for module, path in modules.items() for name in _all(path)
               if f"{module}.{name}" not in directives]
    assert not missing, (
        f"public names missing from docs/api/ (add a '::: name' line to its package's page): "
        f"{missing}"
    )


def test_each_name_is_on_its_package_page() -> None:
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    assert {page.stem for page in pages} == {"index", *PACKAGES}
    elsewhere = [f"{page.name}: {name}" for page in pages
                 for name in re.findall(r"^::: (\S+)\s*$", page.read_text(), re.M)
                 if name.split(".")[0] != page.stem]
    assert not elsewhere, f"a name on another package's page of docs/api/: {elsewhere}"


def _imported_names() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from <our package...> import name`` in the pages, the README
    and the examples."""
    texts = [path.read_text() for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
                                           *(ROOT / "examples").glob("*.py")]]
    ours = re.compile(r"^\s*from ((?:" + "|".join(PACKAGES) + r")[\w.]*) import ([^\n#]+)", re.M)
    found = set()
    for text in texts:
        for module, names in ours.findall(text):
            found |= {(module, name.strip(" ()")) for name in names.split(",") if name.strip(" ()")}
    return {(module, name) for module, name in found if not _is_module(f"{module}.{name}")}


def _is_module(dotted: str) -> bool:
    """``loader_resume.tools.demo`` (the demo program behind ``loader-resume demo``, imported whole
    by an example)."""
    top, *rest = dotted.split(".")
    path = PACKAGES[top].joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_name_the_pages_and_examples_import_is_on_the_api_page() -> None:
    documented = _directives()
    imported = _imported_names()
    assert ("loader_resume.distributed", "DCPLoaderState") in imported, (
        "the import scan sees the pages"
    )
    # A name may be documented where it is defined or where it is re-exported
    # (loader_resume.set_global_rng_state).
    missing = sorted(
        f"{module}.{name}"
        for module, name in imported
        if not any(
            d.split(".")[0] == module.split(".")[0] and d.endswith(f".{name}") for d in documented
        )
    )
    assert not missing, f"imported in the docs or examples but not on the API page: {missing}"


def test_the_api_page_names_only_what_exists() -> None:
    defined = {path: path.read_text() for path in _sources()}
    for directive in _directives():
        name = directive.rsplit(".", 1)[1]
        pattern = re.compile(
            rf"^(?:class|def) {re.escape(name)}\b|^{re.escape(name)}\b[:\s]*[:=]", re.M
        )
        assert any(pattern.search(text) for text in defined.values()), (
            f"::: {directive}: no such definition"
        )


def _docstrings(tree: ast.AST) -> list[ast.Constant]:
    """Every string statement: module, class and function docstrings, and the attribute docstrings
    below a name."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]


def test_no_docstring_holds_a_sphinx_role() -> None:
    found = [f"{path.relative_to(ROOT)}:{doc.lineno}: {match.group(0)}"
             for path in _sources() for doc in _docstrings(ast.parse(path.read_text()))
             for match in ROLE.finditer(doc.value)]
    assert not found, (
        "Sphinx roles show as raw text in mkdocstrings; write [`Name`][package.Name] or ``Name``:\n"
        + ("\n".join(found))
    )


def test_the_role_check_sees_a_role() -> None:
    tree = ast.parse('def f():\n    """See :class:`ResumeConfig` and :func:`~a.load_config`."""\n')
    assert [m.group(0) for doc in _docstrings(tree) for m in ROLE.finditer(doc.value)] == [
        ":class:`",
        ":func:`",
    ]
