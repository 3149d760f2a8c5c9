"""The package's import graph, checked: no circle between modules or between folders,
and no module importing from a layer above its own.

Every import counts, wherever it stands (module level, inside a function, under
TYPE_CHECKING); a package's own __init__ counts only where it is imported by
name.  Layers, lowest first, are LAYERS below.  Prints the layers and the
edges between folders; exits 1 on a circle or an arrow up.
Run: `python3 tools/import_graph.py`.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "portable_kv"
PACKAGE = "portable_kv"
# Lowest first; an entry is a top-level module or a folder of the package.
LAYERS = (
    ("core", ("config", "log", "stats", "cache", "layout", "indices", "transfer")),
    ("io paths", ("io",)),
    ("backends", ("backends",)),
    ("host pool", ("numa", "allocator", "device_pool", "host_memory", "validation", "pages", "plan", "pool", "mla")),
    ("integrations", ("storage", "engines", "sglang")),
    ("commands", ("testing", "check", "bench", "cli", "__init__", "__main__")),
)


def module_name(path: Path) -> str:
    parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, resolved to the most specific known module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")}
    return {t for t in found if t in known and t != name}


def unit(name: str) -> str:
    """A module's folder, or the module itself at the top level."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(name: str) -> int:
    return next(i for i, (_, members) in enumerate(LAYERS) if unit(name) in members)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    known = modules()
    edges = {name: imports(name, path, known) for name, path in known.items()}
    between: dict[str, set[str]] = defaultdict(set)
    for src, targets in edges.items():
        between[unit(src)] |= {unit(t) for t in targets if unit(t) != unit(src)}
    problems = [f"circle between modules: {' <-> '.join(c)}" for c in circles(edges)]
    problems += [f"circle between folders: {' <-> '.join(c)}" for c in circles(between)]
    problems += [f"arrow up: {src} ({LAYERS[layer(src)][0]}) imports {t} ({LAYERS[layer(t)][0]})"
                 for src, targets in sorted(edges.items()) for t in sorted(targets) if layer(t) > layer(src)]
    for i, (title, members) in enumerate(LAYERS):
        print(f"{i} {title}: {', '.join(members)}")
    for src in sorted(between, key=lambda u: (layer(f"{PACKAGE}.{u}"), u)):
        if between[src]:
            print(f"  {src} -> {', '.join(sorted(between[src]))}")
    print(f"{len(known)} modules, {sum(map(len, edges.values()))} imports: " + ("; ".join(problems) if problems else "no circle, no arrow up"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
