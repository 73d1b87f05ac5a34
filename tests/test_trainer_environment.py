"""Where the trainer keeps DeepSpeed's compiled op, and the command that builds it ahead
of the first run (scripts/setup_venv.sh runs it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

from trainer.engine import environment  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_each_python_environment_has_its_own_extensions_folder(monkeypatch):
    here = environment.extensions_dir()
    assert environment.extensions_dir() == here
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    elsewhere = environment.extensions_dir()
    assert elsewhere != here and elsewhere.parent == here.parent


@pytest.mark.slow
def test_the_command_builds_the_op_where_the_trainer_reads_it():
    """Setup has built it already (or this builds it once, as a first run would)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "PYTHONPATH")}
    completed = subprocess.run([sys.executable, "-m", "trainer.engine.environment"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    folder = environment.extensions_dir()
    assert completed.stdout.strip().splitlines()[-1].endswith(f"is built in {folder}")
    assert list(folder.glob("*/*.so")), sorted(folder.rglob("*"))
