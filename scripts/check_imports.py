"""Import cycles and oversized files among the product packages, found by reading the source (nothing runs).

    python scripts/check_imports.py          # prints every cycle and every file over the line limit

Every `import X` / `from X import Y` anywhere in a module counts, inside functions and under TYPE_CHECKING
too: a deferred import hides a loop from the interpreter, not from the reader. `from pkg import mod` counts
as an import of `pkg.mod` when that is a module. Exits 1 when it finds a cycle or an oversized file;
tests/test_imports.py asserts the same with the allow-lists below.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "scheduler", "worker", "common", "kernels", "client", "pagedserve")
MAX_LINES = 450
FOLDER_PARTS = [[name] for name in PACKAGES if name != "pagedserve"]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py"))


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The product modules that `path` imports (absolute and relative imports, at any depth)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # `pagedserve.common.x` is the folder common/x: the one import name is no module of the graph
            target = target.removeprefix("pagedserve.") if target.split(".")[1:2] in FOLDER_PARTS else target
            # `import a.b.c` imports a, a.b and a.b.c; the package __init__s are modules too.
            parts = target.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = product_files(root)
    modules = {module_name(p, root) for p in files}
    graph = {module_name(p, root): imports_of(p, modules, root) for p in files}
    # A package's __init__ runs before any of its modules: importing a.b imports a. That edge is not a
    # design choice, so it is left out (else every `a/__init__.py` that imports a submodule is a cycle).
    return {m: {t for t in deps if not m.startswith(t + ".")} for m, deps in graph.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The groups of modules that import each other, directly or through others (each a sorted tuple)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        reach[start] = seen
    groups = {
        tuple(sorted({v} | {w for w in reach[v] if v in reach.get(w, ())})) for v in graph if v in reach[v]
    }
    return sorted(groups)


def oversized_files(root: Path = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    """Product files over `limit` lines, by path relative to `root`."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in product_files(root)}
    return {path: n for path, n in counts.items() if n > limit}


def main() -> int:
    cycles = find_cycles(import_graph())
    big = oversized_files()
    for cycle in cycles:
        print("import cycle: " + " <-> ".join(cycle))
    for path, n in sorted(big.items()):
        print(f"{path}: {n} lines (limit {MAX_LINES})")
    return 1 if cycles or big else 0


if __name__ == "__main__":
    sys.exit(main())
