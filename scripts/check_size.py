"""Size check run by scripts/test: no module over 600 lines, no function over 60.

A module or function that outgrows its one job gets split in the change that grew it.
Prints the largest of each, so the trend is visible in every CI log, and exits 1 when a
limit is crossed (naming every offender).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
ROOTS = ("client/tokenfeed", "server/tokenfeed_server")


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, path) of every module and (lines, path:qualname) of every function."""
    modules: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    for sub in ROOTS:
        for path in sorted((root / sub).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = str(path.relative_to(root))
            modules.append((len(text.splitlines()), rel))
            functions.extend(_functions(ast.parse(text), rel))
    return modules, functions


def _functions(tree: ast.Module, rel: str) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                length = (child.end_lineno or child.lineno) - start + 1
                found.append((length, f"{rel}:{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    modules, functions = sizes(root)
    modules.sort(reverse=True)
    functions.sort(reverse=True)
    print("[size] largest modules:", ", ".join(f"{p} {n}" for n, p in modules[:5]))
    print("[size] longest functions:", ", ".join(f"{p} {n}" for n, p in functions[:5]))
    over = [
        f"module {p}: {n} lines (max {MAX_MODULE_LINES})"
        for n, p in modules
        if n > MAX_MODULE_LINES
    ]
    over += [
        f"function {p}: {n} lines (max {MAX_FUNCTION_LINES})"
        for n, p in functions
        if n > MAX_FUNCTION_LINES
    ]
    for line in over:
        print(f"[size] too large: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
