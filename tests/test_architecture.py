"""The import graph of ``tokenfeed`` and ``tokenfeed_server`` stays a clean one-way graph.

Every ``.py`` file of both packages is parsed (never imported) with :mod:`ast`; every
``import`` and ``from ... import`` counts, wherever it is (module level, inside a function
or a class, under ``try``), with relative imports resolved against the importing module.

Two rules:

- **No import cycles between modules.** An edge ``a -> b`` means module ``a`` imports
  module ``b`` (``from pkg import name`` is an edge to ``pkg.name`` when that is a module
  of ours, else to ``pkg``). A cycle is named module by module, with the file and line of
  each import. Imports under ``if TYPE_CHECKING:`` never run, so they make no edge
  (:data:`TYPE_CHECKING_MAKES_EDGES`); an import of a package does not count as an
  import of its ``__init__``'s own imports (only edges written in the code count).
- **No underscore-private names from another module.** ``from x import _y`` fails (a
  private name is its module's business), for any ``x`` other than the importing module
  itself, ours or third-party; dunders such as ``__version__`` are public.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tokenfeed": ROOT / "client" / "tokenfeed",
    "tokenfeed_server": ROOT / "server" / "tokenfeed_server",
}
#: imports guarded by ``if TYPE_CHECKING:`` (annotations only) are not runtime edges
TYPE_CHECKING_MAKES_EDGES = False


@dataclass(frozen=True)
class Import:
    """One imported name: ``from module import name`` (name None for ``import module``)."""

    importer: str
    module: str
    name: str | None
    file: Path
    line: int
    type_checking: bool

    @property
    def where(self) -> str:
        try:
            shown = self.file.relative_to(ROOT)
        except ValueError:
            shown = self.file
        return f"{shown}:{self.line}"


def module_name(root: Path, package: str, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def discover(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the packages."""
    modules = {}
    for package, root in packages.items():
        for file in sorted(root.rglob("*.py")):
            if "__pycache__" in file.parts:
                continue
            modules[module_name(root, package, file)] = file
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node, and whether it sits in the body of an ``if TYPE_CHECKING:``."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, guarded = stack.pop()
        yield node, guarded
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True) for child in node.body)
            stack.extend((child, guarded) for child in node.orelse)
            stack.append((node.test, guarded))
            continue
        stack.extend((child, guarded) for child in ast.iter_child_nodes(node))


def resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute module a (possibly relative) ``from`` import names."""
    if level == 0:
        assert module is not None
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"relative import beyond the top-level package in {importer}")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(importer: str, file: Path) -> list[Import]:
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    is_package = file.name == "__init__.py"
    found = []
    for node, guarded in _nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, alias.name, None, file, node.lineno, guarded))
        elif isinstance(node, ast.ImportFrom):
            target = resolve(importer, is_package, node.level, node.module)
            for alias in node.names:
                found.append(Import(importer, target, alias.name, file, node.lineno, guarded))
    return found


def all_imports(packages: dict[str, Path]) -> tuple[dict[str, Path], list[Import]]:
    modules = discover(packages)
    found = []
    for name, file in modules.items():
        found += imports_of(name, file)
    return modules, found


# ---------------------------------------------------------------------------- the graph


def edges(modules: dict[str, Path], found: Iterable[Import]) -> dict[str, dict[str, Import]]:
    """``graph[a][b]``: the first import in ``a`` that makes it import ``b`` (ours only)."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in found:
        if imp.type_checking and not TYPE_CHECKING_MAKES_EDGES:
            continue
        target = imp.module
        if imp.name is not None and imp.name != "*" and f"{target}.{imp.name}" in modules:
            target = f"{target}.{imp.name}"  # from pkg import submodule
        if target not in modules or target == imp.importer:
            continue
        graph[imp.importer].setdefault(target, imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a closed list of names."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in its own component")


def cycles(modules: dict[str, Path], found: Iterable[Import]) -> list[str]:
    """One line per import cycle: the modules in order, each import's file and line."""
    graph = edges(modules, found)
    out = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component)
        steps = [f"{a} -> {b} ({graph[a][b].where})" for a, b in itertools.pairwise(cycle)]
        more = f" (one cycle of {len(component)} modules tangled together: {', '.join(component)})"
        out.append("import cycle: " + "; ".join(steps) + (more if len(component) > 2 else ""))
    return out


def private_imports(found: Iterable[Import]) -> list[str]:
    out = []
    for imp in sorted(found, key=lambda i: (str(i.file), i.line)):
        name = imp.name
        if name is None or not name.startswith("_"):
            continue
        if name.startswith("__") and name.endswith("__"):
            continue  # __version__, __all__, ...: public by convention
        if imp.module == imp.importer:
            continue
        out.append(f"{imp.where}: {imp.importer} imports private {name!r} from {imp.module}")
    return out


# ---------------------------------------------------------------------------- the real packages


def test_the_packages_are_found() -> None:
    modules, found = all_imports(PACKAGES)
    for package in PACKAGES:
        assert package in modules, f"{package}/__init__.py not found"
    assert len(modules) > 20 and found


def test_no_import_cycles() -> None:
    modules, found = all_imports(PACKAGES)
    problems = cycles(modules, found)
    assert not problems, f"{len(problems)} import cycle(s):\n" + "\n".join(problems)


def test_no_private_names_imported_from_other_modules() -> None:
    _, found = all_imports(PACKAGES)
    problems = private_imports(found)
    assert not problems, f"{len(problems)} private import(s):\n" + "\n".join(problems)


# ---------------------------------------------------------------------------- the checker itself


def write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"pkg": root / "pkg"}


def test_checker_names_a_cycle_through_function_level_and_relative_imports(
    tmp_path: Path,
) -> None:
    packages = write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .sub import b\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "def f():\n    from ..c import thing\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/d.py": "from pkg import c\n",  # into the cycle, not part of it
        },
    )
    modules, found = all_imports(packages)
    problems = cycles(modules, found)
    assert len(problems) == 1, problems
    assert problems[0].startswith("import cycle: pkg.a -> pkg.sub.b (")
    assert "pkg.sub.b -> pkg.c (" in problems[0] and "pkg.c -> pkg.a (" in problems[0]
    assert "pkg/sub/b.py:2" in problems[0]
    assert "pkg.d" not in problems[0]


def test_checker_resolves_relative_imports_in_packages_and_modules() -> None:
    assert resolve("pkg.sub", True, 1, "x") == "pkg.sub.x"
    assert resolve("pkg.sub.m", False, 1, "x") == "pkg.sub.x"
    assert resolve("pkg.sub.m", False, 2, None) == "pkg"
    assert resolve("pkg.sub", True, 2, "y") == "pkg.y"
    with pytest.raises(ValueError):
        resolve("pkg.m", False, 3, "z")


def test_checker_ignores_type_checking_imports_and_acyclic_graphs(tmp_path: Path) -> None:
    packages = write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg.b import B\nclass A: ...\n",
            "pkg/b.py": "from pkg.a import A\nclass B(A): ...\n",
        },
    )
    modules, found = all_imports(packages)
    assert cycles(modules, found) == []


def test_checker_flags_private_names_but_not_dunders(tmp_path: Path) -> None:
    packages = write(
        tmp_path,
        {
            "pkg/__init__.py": "__version__ = '1'\n_hidden = 1\n",
            "pkg/a.py": "from pkg import __version__\nfrom . import _hidden\n"
            "def f():\n    from os import _exit\n",
        },
    )
    _, found = all_imports(packages)
    problems = private_imports(found)
    assert len(problems) == 2, problems
    assert "pkg/a.py:2: pkg.a imports private '_hidden' from pkg" in problems[0]
    assert "'_exit' from os" in problems[1]
