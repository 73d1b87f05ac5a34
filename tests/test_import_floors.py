"""The library's import graph (docs/architecture.md, "Import floors"): no cycle among its
modules or its units (subpackages and root modules), counting the imports functions make,
at most MAX_FLOORS floors, so that a module can be read with those below it alone, and at
most MAX_ROOT_MODULES modules at the package's root. The trainer's graph has no cycle
either. scripts/import_floors.py prints the floors and the units' layers."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FLOORS = 10
MAX_ROOT_MODULES = 10


def _floors_module():
    spec = importlib.util.spec_from_file_location("import_floors", ROOT / "scripts" / "import_floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOORS = _floors_module()


def test_the_library_has_at_most_ten_floors():
    floor = FLOORS.floors(FLOORS.import_graph())
    top = max(floor.values())
    chain = FLOORS.longest_chain(FLOORS.import_graph(), floor)
    assert top <= MAX_FLOORS, f"{top} floors: " + " -> ".join(chain)


@pytest.mark.parametrize("package", ["hadw_kernels", "trainer"])
def test_no_cycle_counting_the_imports_functions_make(package):
    graph = FLOORS.import_graph(ROOT / package, deferred=True)
    FLOORS.floors(graph)  # raises, naming a module of the cycle
    FLOORS.floors(FLOORS.unit_graph(graph))


def test_at_most_ten_modules_at_the_root():
    root = sorted(path.name for path in (ROOT / "hadw_kernels").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_a_function_import_is_an_arrow_and_units_see_a_cycle(tmp_path):
    package = tmp_path / "trial"
    for sub in ("low", "high"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from ..high import b\n")
    (package / "high" / "b.py").write_text("from ..low import c\n")
    (package / "low" / "c.py").write_text("import math\n")
    on_import = FLOORS.import_graph(package)
    everything = FLOORS.import_graph(package, deferred=True)
    assert on_import["trial.low.a"] == set() and everything["trial.low.a"] == {"trial.high.b"}
    FLOORS.floors(everything)  # modules: a -> b -> c, no cycle
    with pytest.raises(ValueError, match="import cycle"):  # units: low -> high -> low
        FLOORS.floors(FLOORS.unit_graph(everything))


def test_the_floors_count_relative_and_absolute_imports_and_refuse_a_cycle(tmp_path):
    package = tmp_path / "trial"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .top import run\n")
    (package / "base.py").write_text("import math\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "middle.py").write_text("from .. import base\n")
    (package / "top.py").write_text("from typing import TYPE_CHECKING\nfrom trial.sub.middle import x\n"
                                    "if TYPE_CHECKING:\n    from . import later\n"
                                    "def run():\n    from . import later\n")
    (package / "later.py").write_text("from .top import run\n")
    graph = FLOORS.import_graph(package)
    assert graph["trial.top"] == {"trial.sub.middle"}  # neither the TYPE_CHECKING nor the function's import
    assert graph["trial.sub.middle"] == {"trial.base"}
    floor = FLOORS.floors(graph)
    assert (floor["trial.base"], floor["trial.sub.middle"], floor["trial.top"], floor["trial"]) == (1, 2, 3, 4)
    (package / "base.py").write_text("from .top import run\n")
    with pytest.raises(ValueError, match="import cycle"):
        FLOORS.floors(FLOORS.import_graph(package))
