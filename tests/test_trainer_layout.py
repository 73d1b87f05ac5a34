"""The trainer's floors (docs/trainer.md, "Install"): a module imports its own package and
the floors below it, never one above, so that each concern can be read without those
that use it."""

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "trainer"
# The first part of a module's name under trainer/ -> its floor. The config composes the
# parts' sections, the engine's among them, so it sits above the engine.
FLOORS = {"run": 4, "tools": 3, "config": 2, "engine": 1, "tasks": 0, "models": 0, "checkpoint_files": -1,
          "section": -1}


def _part(module: str) -> str:
    """``trainer.engine.loop`` -> ``engine``."""
    return module.split(".")[1]


def _module(path: Path, root: Path) -> str:
    """trainer/engine/loop.py under ``root`` -> ``trainer.engine.loop``."""
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _imported_parts(path: Path, root: Path = TRAINER.parent) -> set[str]:
    """The trainer parts ``path`` (a file of trainer/ under ``root``) imports, absolute or
    relative, at any depth of the file."""
    package = _module(path, root).rsplit(".", 1)[0]
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] if node.module else [f"{module}.{alias.name}" for alias in node.names]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        parts.update(_part(name) for name in names if name.startswith("trainer.") and name != "trainer")
    return parts


def test_every_module_imports_only_its_own_package_and_the_floors_below():
    modules = [path for path in TRAINER.rglob("*.py") if path.name != "__init__.py"]
    assert {_part(_module(path, TRAINER.parent)) for path in modules} == set(FLOORS)
    upward = []
    for path in modules:
        own = _part(_module(path, TRAINER.parent))
        for part in _imported_parts(path) - {own}:
            if FLOORS[part] >= FLOORS[own]:
                upward.append(f"{path.relative_to(TRAINER.parent)} imports trainer.{part}")
    assert not upward, upward


def test_the_floor_check_sees_relative_and_absolute_imports(tmp_path):
    """The check above can fail: an upward import in any form is found."""
    source = (TRAINER / "tasks" / "problem.py").read_text()
    assert "engine" not in _imported_parts(TRAINER / "tasks" / "problem.py")
    copy = tmp_path / "trainer" / "tasks" / "problem.py"
    copy.parent.mkdir(parents=True)
    for line in ("from ..engine.loop import Trainer\n", "from .. import engine\n", "from trainer.engine import loop\n",
                 "import trainer.engine.policy\n"):
        copy.write_text(line + source)
        assert "engine" in _imported_parts(copy, tmp_path), line
