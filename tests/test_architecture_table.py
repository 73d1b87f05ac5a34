"""docs/architecture.md's "Modules" table against the tree: every module of the package is
listed once, nothing listed is missing, and each subpackage's layer is the one its imports
give it (scripts/import_floors.py's units, counting the imports functions make)."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hadw_kernels"


def _floors_module():
    spec = importlib.util.spec_from_file_location("import_floors", ROOT / "scripts" / "import_floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows() -> list[tuple[str, list[str]]]:
    section = (ROOT / "docs" / "architecture.md").read_text().split("## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (root|\d+) \| ([^|]+) \|", section, re.MULTILINE)
    return [(layer, re.findall(r"`([\w/]+\.py)`", modules)) for layer, modules in rows]


def test_the_table_lists_every_module_once():
    listed = [module for _, modules in _rows() for module in modules]
    tree = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                  if path.name != "__init__.py" or path.parent == PACKAGE)
    assert sorted(listed) == tree


def test_each_subpackage_sits_on_the_layer_its_imports_give_it():
    floors = _floors_module()
    layers = floors.floors(floors.unit_graph(floors.import_graph(PACKAGE, deferred=True)))
    for layer, modules in _rows():
        for module in modules:
            if "/" in module:
                assert int(layer) == layers[module.split("/")[0]], module
            else:
                assert layer == "root", module
