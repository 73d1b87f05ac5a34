"""The import graph of hadw_kernels (and the trainer's) (docs/architecture.md, "Import
floors"). A module that imports no other module of the package is on floor 1, any other
one floor above the highest it imports, counted from the imports a module runs when it is
imported (its top-level ones, ``if TYPE_CHECKING:`` blocks left out). The cycle and the
layer checks count a function's own imports too: an import deferred to call time is still
an arrow, and a pair that import each other that way is a cycle. Imports of the package's
root (``hadw_kernels``, the public API) are left out. Each subpackage and each module at
the root is a unit; the units' graph must have no cycle, so that no import runs back up.
Prints the floors, the number of arrows, the longest chain and the units' layers:

    python scripts/import_floors.py [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hadw_kernels"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """hadw_kernels/ops/routing.py -> ``hadw_kernels.ops.routing``; a package's
    ``__init__.py`` is the package."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _statements(tree: ast.Module, deferred: bool):
    """The statements a module runs on import: its body, into ``if``/``try`` blocks, but
    not an ``if TYPE_CHECKING:`` block; with ``deferred``, also every statement of its
    functions and classes (what runs when they are called)."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.If):
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                pending[:0] = node.orelse
                continue
            pending[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending[:0] = node.body + [n for h in node.handlers for n in h.body] + node.orelse + node.finalbody
        elif deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With,
                                            ast.For, ast.While)):
            pending[:0] = node.body + getattr(node, "orelse", [])
        else:
            yield node


def imports_of(path: Path, modules: set[str], package: Path = PACKAGE, deferred: bool = False) -> set[str]:
    """The package's modules that ``path`` imports on import (absolute or relative); with
    ``deferred``, also those its functions import."""
    name = module_name(path, package)
    own_package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in _statements(ast.parse(path.read_text()), deferred):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [f"{module}.{alias.name}" for alias in node.names]
            found.update(c for c in candidates if c in modules)
            if not any(c in modules for c in candidates):
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    root = package.name
    return {m for m in found if m in modules and m != root and m != name}


def import_graph(package: Path = PACKAGE, deferred: bool = False) -> dict[str, set[str]]:
    """Each module of ``package`` -> the package's modules it imports on import (with
    ``deferred``, or at any time)."""
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(path, package) for path in paths}
    return {module_name(path, package): imports_of(path, modules, package, deferred) for path in paths}


def unit(module: str) -> str:
    """The unit a module belongs to: its subpackage, or itself at the package's root
    (``hadw_kernels.tables.bounds`` -> ``tables``, ``hadw_kernels.loss`` -> ``loss``)."""
    return module.split(".")[1] if "." in module else module


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each unit -> the other units its modules import (the root's own module left out)."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if "." not in module:
            continue
        units.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    return units


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 + the highest floor it imports (1 for none). An import cycle
    raises: a cycle has no floors."""
    floor: dict[str, int] = {}
    visiting: set[str] = set()

    def visit(module: str) -> int:
        if module in floor:
            return floor[module]
        if module in visiting:
            raise ValueError(f"import cycle through {module}")
        visiting.add(module)
        floor[module] = 1 + max((visit(m) for m in graph[module]), default=0)
        visiting.discard(module)
        return floor[module]

    for module in graph:
        visit(module)
    return floor


def longest_chain(graph: dict[str, set[str]], floor: dict[str, int]) -> list[str]:
    """One chain of imports as long as the floors: the top module down to floor 1."""
    module = max(floor, key=lambda m: (floor[m], m))
    chain = [module]
    while graph[module]:
        module = max(graph[module], key=lambda m: (floor[m], m))
        chain.append(module)
    return chain


def main(argv: list[str]) -> None:
    package = Path(argv[0]).resolve() if argv else PACKAGE
    prefix = package.name + "."
    graph = import_graph(package)
    floor = floors(graph)
    arrows = sum(len(targets) for targets in graph.values())
    everything = import_graph(package, deferred=True)
    floors(everything)  # raises on a cycle through a deferred import
    deferred = sum(len(targets) for targets in everything.values()) - arrows
    print(f"{len(graph)} modules, {arrows} arrows on import (+{deferred} deferred), {max(floor.values())} floors")
    for level in range(max(floor.values()), 0, -1):
        print(f"{level:2d}: " + ", ".join(sorted(m.removeprefix(prefix) for m in floor if floor[m] == level)))
    print("longest chain: " + " -> ".join(m.removeprefix(prefix) for m in longest_chain(graph, floor)))
    units = unit_graph(everything)
    layer = floors(units)
    print(f"{len(units)} units, {sum(len(t) for t in units.values())} arrows between them, no cycle; layers:")
    for level in range(max(layer.values()), 0, -1):
        print(f"{level:2d}: " + ", ".join(sorted(u for u in layer if layer[u] == level)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
