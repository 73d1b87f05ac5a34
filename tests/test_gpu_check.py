"""The GPU check command cannot rot: its dry run (CPU, Triton's interpreter, tiny shapes)
runs every section and writes a report; a failing correctness test makes it exit 1."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each test runs the check in a subprocess


def test_dry_run_writes_a_report(tmp_path):
    report = tmp_path / "gpu-report.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--report", str(report)],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert "DRY RUN" in text and "0 failed" in text
    for section in ("## Loss step", "## The surrogate alone", "## The paper's scale",
                    "## Train steps through the trainer", "## The trainer on this device"):
        assert section in text, section
    # The run killed inside a step and resumed lands on the uninterrupted curve.
    assert "Resumed run: steps [1, 2, 3]" in text and "reward/mean 0.00e+00" in text
    # The trainer's own log reaches the report: the layout of its micro-batches and why.
    assert "uninterrupted: micro-batches: shared-prompt (the segment attention over sdpa" in text
    assert "bench: tiny" in result.stdout and "paper scale G=4" in result.stdout
    assert "| G=4 x 16 tokens and the largest budget, fused | fused | shared_prompt | 40 (35) | yes |" in text


def test_the_shell_entry_point_passes_its_flags(tmp_path):
    """Every section skipped (the dry run above runs them): the flags reach the check,
    which then writes a report without them."""
    report = tmp_path / "report.md"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--skip-bench", "--skip-tests",
         "--skip-trainer", "--skip-probe", "--report", str(report)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert "DRY RUN" in text
    for section in ("## Loss step", "## Train steps through the trainer", "## The trainer on this device"):
        assert section not in text, section
