"""Import circles among the project's modules (issue 34's house measures).

    python scripts/import_cycles.py [DIR ...]      # default: radixserve services kernels

Every ``import`` / ``from ... import`` of a project module counts, those under
``if TYPE_CHECKING:`` and inside functions too (a circle that only typing closes still
makes two modules that cannot be read apart). A package's ``__init__`` counts as the
package. Prints each circle (a strongly connected group of two or more modules) and
exits 1 if there is one. Standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (``from pkg import mod`` counts as pkg.mod)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = {f"{base}.{a.name}" for a in node.names} & known
            found.update(subs or {base})
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path("radixserve"), Path("services"), Path("kernels")]
    paths = [p for r in roots for p in sorted(r.rglob("*.py")) if "_pb2" not in p.name]
    names = {p: module_name(p) for p in paths}
    known = set(names.values())
    graph = {names[p]: imports(p, names[p], known) for p in paths}
    # A package's __init__ importing its own submodules is not a circle a reader trips over.
    for pkg in known:
        graph[pkg] = {m for m in graph[pkg] if not m.startswith(pkg + ".")}
    found = circles(graph)
    print(f"{len(found)} import circle(s) among {len(known)} modules")
    for group in found:
        print("  " + " <-> ".join(group))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
