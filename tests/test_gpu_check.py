"""The GPU check command cannot rot: its dry run (CPU, Triton's interpreter, tiny shapes)
runs every section and writes a report; a failing correctness test makes it exit 1."""

import re
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
    assert "uninterrupted: micro-batches: prefix-tree (train.layout='auto', the segment attention over sdpa" in text
    assert "bench: tiny" in result.stdout and "paper scale G=4" in result.stdout
    # Two sequences of 4 + 16 tokens a micro-batch, the prompt shared: at most 4 + 2 x 15 fed
    # in the prefix tree (less what the two random responses share).
    assert re.search(r"\| G=4 x 16 tokens and the largest budget, fused \| fused \| prefix_tree \| 40 \((3[0-4])\) \| "
                     r"yes \|", text)
    assert "largest budget, eager FAILED" not in result.stdout


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


def test_the_peers_are_the_rows_of_loss_impls(monkeypatch):
    """The GPU check's peer rows are loss_impls.PEERS's with a GPU label, in their order; the
    CPU benchmark takes those that do not need CUDA; every row names an implementation
    build_step knows."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_loss_step
    import loss_impls
    import matrix

    shape = loss_impls.Shape(1, 2, 16, 32, 300)
    rows = gpu_loss_step.implementations(gpu_loss_step.Case("tiny", shape, "float32"))
    peers = [peer for peer in loss_impls.PEERS if peer.gpu_label is not None]
    assert list(rows)[-len(peers):] == [peer.gpu_label for peer in peers]
    assert [rows[peer.gpu_label][0] for peer in peers] == [peer.impl for peer in peers]
    assert {"liger_triton", "cce_kernel"} <= {peer.impl for peer in peers if peer.cuda_only}
    cpu_rows = matrix.implementations("hidden", ("torch",))
    assert [impl for impl in cpu_rows if impl in {peer.impl for peer in loss_impls.PEERS}] == [
        peer.impl for peer in loss_impls.PEERS if not peer.cuda_only]
    for peer in loss_impls.PEERS:  # known by name: refused for log-probs, not as unknown
        with pytest.raises(ValueError, match="takes hidden states only"):
            loss_impls.build_step(peer.impl, "logprobs", shape)


def test_a_report_path_without_its_folder_is_refused_before_any_stage(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--report", str(tmp_path / "no" / "r.md")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "argument --report: no folder" in result.stderr and "r.md" in result.stderr
