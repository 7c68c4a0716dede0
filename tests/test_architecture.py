"""The codebase's own rules, kept by a test: no module of ours reaches into another module's private
names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [ROOT / "core" / "loader_resume", ROOT / "lightning_resume", ROOT / "accelerate_resume",
            ROOT / "transformers_resume", ROOT / "ray_resume", ROOT / "torchft_resume"]
OURS = {
    "loader_resume",
    "lightning_resume",
    "accelerate_resume",
    "transformers_resume",
    "ray_resume",
    "torchft_resume",
}


def _modules() -> dict[Path, ast.Module]:
    paths = [path for package in PACKAGES for path in sorted(package.rglob("*.py"))]
    return {path: ast.parse(path.read_text(), str(path)) for path in paths}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assignments, and attributes it sets
    (``x._a = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__slots__" for t in node.targets
        ):
            names |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
        elif (name := _by_name(node, "setattr")) is not None:
            names.add(name)
    return {name for name in names if _private(name)}


def _by_name(node: ast.AST, *functions: str) -> str | None:
    """The attribute name of a ``getattr``/``setattr``/``hasattr`` call with a literal name, else
    None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in functions
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def test_no_module_reads_or_writes_another_modules_private_names() -> None:
    modules = _modules()
    defined = {path: _defined(tree) for path, tree in modules.items()}
    found = []
    for path, tree in modules.items():
        elsewhere = (
            set().union(*(names for other, names in defined.items() if other != path))
            - defined[path]
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in elsewhere:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
            name = _by_name(node, "getattr", "hasattr")
            if name is not None and _private(name) and name in elsewhere:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: getattr {name!r}")
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] in OURS
            ):
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}"
                          for alias in node.names if _private(alias.name)]
    assert not found, (
        "private names used across modules (give them a small documented API):\n" + "\n".join(found)
    )


def test_the_rule_finds_a_reach_in() -> None:
    """The scan itself: a module reading a private attribute that only another module defines is
    reported."""
    owner = ast.parse("class A:\n    def __init__(self):\n        self._secret = 1\n")
    reader = ast.parse("def peek(a):\n    return a._secret\n")
    assert "_secret" in _defined(owner) and "_secret" not in _defined(reader)
    reads = [n.attr for n in ast.walk(reader) if isinstance(n, ast.Attribute) and _private(n.attr)]
    assert reads == ["_secret"]
    by_string = ast.parse("def peek(a):\n    return getattr(a, '_secret', None)\n")
    assert [_by_name(n, "getattr") for n in ast.walk(by_string) if _by_name(n, "getattr")] == [
        "_secret"
    ]
    # a string is not a definition (unless in __slots__ or setattr)
    assert "_secret" not in _defined(by_string)


def test_no_test_module_imports_another() -> None:
    """Shared datasets and launchers live in tests/support; test modules, conftest and child scripts
    are leaves."""
    tests = ROOT / "tests"
    leaves = {
        path.stem for path in tests.rglob("*.py") if not path.is_relative_to(tests / "support")
    }
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0] in leaves]
    assert not found, (
        "test modules importing each other (move what they share to tests/support):\n"
        + "\n".join(found)
    )


def _torch_private_names() -> set[str]:
    """The private names of torch's DataLoader, its iterators, samplers, datasets and
    ``WorkerInfo``: class attributes and the attributes a built loader and iterator carry."""
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        Dataset,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        Sampler,
        SequentialSampler,
    )
    from torch.utils.data import dataloader as torch_dataloader
    from torch.utils.data._utils.worker import WorkerInfo

    classes = [
        DataLoader,
        torch_dataloader._BaseDataLoaderIter,
        torch_dataloader._SingleProcessDataLoaderIter,
        torch_dataloader._MultiProcessingDataLoaderIter,
        WorkerInfo,
        RandomSampler,
        Sampler,
        BatchSampler,
        SequentialSampler,
        DistributedSampler,
        Dataset,
        IterableDataset,
    ]
    from torch.distributed import distributed_c10d

    loader = DataLoader(list(range(4)), batch_size=2)
    workers = iter(DataLoader(list(range(4)), batch_size=2, num_workers=1))
    names = (
        {name for kind in classes for name in dir(kind)}
        | set(vars(loader))
        | set(vars(iter(loader)))
    )
    names |= (
        set(vars(workers))
        | set(vars(RandomSampler(range(4))))
        | set(vars(SequentialSampler(range(4))))
    )
    names |= set(vars(DistributedSampler(range(4), num_replicas=1, rank=0)))
    # their module-level private functions
    names |= set(dir(distributed_c10d)) | set(dir(torch_dataloader))
    del workers  # its worker process ends
    return {name for name in names if _private(name)}


def _torch_reach_ins(tree: ast.Module, torch_names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in torch_names:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and (
                any(_private(part) for part in (node.module or "").split("."))
                or any(_private(alias.name) for alias in node.names)):
            found.append(
                (node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}")
            )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__setattr__"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "object"
        ):
            found.append((node.lineno, "object.__setattr__ (a write past a guard)"))
    return found


def test_torch_private_names_are_used_in_torch_internals_only() -> None:
    torch_names = _torch_private_names()
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path, tree in _modules().items()
        if path.name != "torch_internals.py"
        for line, what in _torch_reach_ins(tree, torch_names)
    ]
    assert not found, (
        "torch's private names outside torch_internals.py (name them there):\n" + "\n".join(found)
    )


def test_the_torch_rule_finds_each_kind_of_reach_in() -> None:
    torch_names = _torch_private_names()
    assert {
        "_index_sampler",
        "_auto_collation",
        "_iterator",
        "_dataset_kind",
        "_task_info",
        "_num_samples",
        "_get_default_store",
    } <= torch_names
    source = (
        "from torch.utils.data.dataloader import _DatasetKind\nfrom torch.utils.data._utils import "
        "collate\n"
        "def f(loader, info):\n    loader._iterator = None\n    object.__setattr__(info, 'id', 1)\n"
    )
    assert [line for line, _ in _torch_reach_ins(ast.parse(source), torch_names)] == [1, 2, 4, 5]


def test_no_module_is_longer_than_500_lines() -> None:
    """A module ends where its idea ends; one this long holds more than one (split it where an idea
    ends)."""
    long = {str(path.relative_to(ROOT)): length for path in _modules()
            if (length := len(path.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines (split them by what they do): {long}"


ROOMS = {"order", "streams", "keyed", "workers", "job", "audit", "tools"}


def test_every_module_of_the_core_is_in_a_room_or_is_the_loader_itself() -> None:
    """The core's folders are its ideas (docs/architecture.md); the top holds the loader and its
    state, the errors, the public helpers, and nothing else: a new module goes into the room of its
    idea."""
    core = ROOT / "core" / "loader_resume"
    rooms = {
        path.name for path in core.iterdir() if path.is_dir() and (path / "__init__.py").exists()
    }
    assert rooms == ROOMS
    top = {path.stem for path in core.glob("*.py")}
    assert top == {
        "__init__",
        "errors",
        "state",
        "loader",
        "settings",
        "position",
        "identity",
        "load_warnings",
        "pass_notes",
        "thirdparty",
        "convert",
        "distributed",
        "testing",
        "round_trips",
    }


CORE = ROOT / "core" / "loader_resume"
# What each room of the core may import from the core (besides itself): the rooms below it. A test
# module's ``import`` at the top of a module counts; the tools' lazy imports inside functions count
# too.
MAY_IMPORT = {
    "workers": {"errors"},
    "keyed": {"workers"},
    "audit": {"errors", "job.storage", "state"},
    "tools": {"*"},
}


def _core_imports() -> dict[str, set[str]]:
    """Each core module (dotted) -> the core modules it imports, anywhere in it."""
    found: dict[str, set[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        name = ".".join(["loader_resume", *[part for part in parts if part != "__init__"]])
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("loader_resume")
            ):
                imported.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.level:  # the tools' own relative imports
                base = name.rsplit(".", node.level)[0]
                imported.add(f"{base}.{node.module}" if node.module else base)
        found[name] = imported
    return found


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _upward(imports: dict[str, set[str]]) -> list[str]:
    """The imports a lower room may not make (``MAY_IMPORT``), and any of the tools or test helpers
    from outside."""
    wrong = []
    for module, imported in imports.items():
        room = _room(module)
        for target in sorted(imported - {module}):
            inside = _room(target)
            allowed = MAY_IMPORT.get(room)
            if allowed is not None and inside != room and "*" not in allowed and not any(
                    target == f"loader_resume.{name}" or target.startswith(f"loader_resume.{name}.")
                    for name in allowed):
                wrong.append(f"{module} imports {target}")
            if inside in {"tools", "testing", "round_trips"} and room not in {"tools", "testing"}:
                wrong.append(f"{module} imports {target}")
    return wrong


def _circle(imports: dict[str, set[str]]) -> list[str]:
    """An import circle between the modules (the first found), else []."""
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> list[str]:
        state[module] = 1
        for target in sorted(imports.get(module, set()) & set(imports) - {module}):
            if state.get(target) == 1:
                return [*path, module, target]
            if not state.get(target) and (found := visit(target, [*path, module])):
                return found
        state[module] = 2
        return []

    for module in sorted(imports):
        if not state.get(module) and (found := visit(module, [])):
            return found
    return []


def test_the_core_imports_downward_and_in_no_circle() -> None:
    """No import circle between the core's modules, and the lower rooms import only the rooms below
    them: torch's internals and the workers need nothing of the loader; keyed randomness needs only
    the workers; the audit reads and writes through the storage helpers alone; nothing imports the
    tools or the test helpers."""
    imports = _core_imports()
    assert "loader_resume.job.storage" in imports["loader_resume.audit.read"], (
        "the check reads real imports"
    )
    wrong = _upward(imports)
    assert not wrong, "imports upward (move the shared part down, or the module up):\n" + "\n".join(
        wrong
    )
    lazy_tools = {
        module: imported for module, imported in imports.items() if _room(module) != "tools"
    }
    assert not (circle := _circle(lazy_tools)), "import circle: " + " -> ".join(circle)


def test_the_import_check_sees_an_upward_import_and_a_circle() -> None:
    imports = {"loader_resume.keyed.keyed_rng": {"loader_resume.loader"},
               "loader_resume.loader": {"loader_resume.audit.log"},
               "loader_resume.audit.log": {"loader_resume.loader", "loader_resume.job.storage"}}
    assert _upward(imports) == ["loader_resume.keyed.keyed_rng imports loader_resume.loader",
                                "loader_resume.audit.log imports loader_resume.loader"]
    assert _circle(imports) == [
        "loader_resume.audit.log",
        "loader_resume.loader",
        "loader_resume.audit.log",
    ]


def _written_keys(tree: ast.Module, keys: set[str]) -> list[int]:
    """Lines where ``tree`` writes one of ``keys`` itself: a dict literal's key, ``x[key] = ...``,
    or ``x.pop(key)``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            lines += [
                key.lineno
                for key in node.keys
                if isinstance(key, ast.Constant) and key.value in keys
            ]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.slice, ast.Constant) and node.slice.value in keys:
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "pop"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in keys
        ):
            lines.append(node.lineno)
    return lines


# Who alone writes a key of what is saved: a front door's checkpoint entry (its format) and a
# loader's state's "ending" mark. The manifest of a sealed directory has a "format" of its own (its
# module's).
WRITERS = {"format": {"loader_resume.job.checkpoint_entry", "loader_resume.job.checkpoint"},
           "ending": {"loader_resume.loader"}}


def _dotted(path: Path) -> str:
    parts = (
        path.relative_to(ROOT / "core" if path.is_relative_to(ROOT / "core") else ROOT)
        .with_suffix("")
        .parts
    )
    return ".".join(parts)


def _writers(modules: dict[Path, ast.Module]) -> list[str]:
    wrong = []
    for path, tree in modules.items():
        for key, allowed in WRITERS.items():
            if _dotted(path) not in allowed:
                wrong += [
                    f"{_dotted(path)}:{line} writes {key!r}" for line in _written_keys(tree, {key})
                ]
    return wrong


def test_one_writer_for_the_checkpoint_entry_and_for_the_ending_mark() -> None:
    """Every front door writes its entry through ``new_entry`` and asks the loader for its
    ``"ending"`` mark."""
    assert _writers(_modules()) == []


def test_the_writer_rule_sees_a_front_door_writing_the_format_or_popping_ending() -> None:
    made = {
        ROOT / "ray_resume" / "made.py": ast.parse(
            'state = {"format": 1}\nposition.pop("ending", None)\n'
        ),
        ROOT / "lightning_resume" / "made.py": ast.parse('state["ending"] = True\n'),
    }
    assert _writers(made) == [
        "ray_resume.made:1 writes 'format'",
        "ray_resume.made:2 writes 'ending'",
        "lightning_resume.made:1 writes 'ending'",
    ]
