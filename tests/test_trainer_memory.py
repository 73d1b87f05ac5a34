"""Memory set by the token budget, not by G: the train step's peak above what the model and
optimizer hold before it, measured by ``trainer.tools.probe`` (the trainer's own Policy, DeepSpeed
and loss; the kernel's resident-set high-water mark) on the tiny model. Under one budget
G = 8 and G = 64 peak within 15% of each other; with whole groups per micro-batch (what the
trainer needed before advantages were formed once per rollout batch) G = 64 peaks several
times higher, which is what makes this test able to fail."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the trainer extra is not installed (scripts/setup_venv.sh)")
pytestmark = pytest.mark.slow  # trainer runs in subprocesses

REPO = Path(__file__).resolve().parents[1]
PROMPT, RESPONSE = 16, 128
SEQUENCE = PROMPT + RESPONSE


def _peak_above_baseline(tmp_path, group_size: int, budget: int) -> dict:
    out = tmp_path / f"probe-{group_size}-{budget}.json"
    command = [sys.executable, "-m", "trainer.tools.probe", "--preset", "tiny", "-G", str(group_size),
               "-P", str(PROMPT), "-L", str(RESPONSE), "--micro-batch-tokens", str(budget), "--steps", "2",
               "--threads", "1", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's VmHWM is Linux's")
def test_train_step_memory_is_set_by_the_budget_not_by_the_group_size(tmp_path):
    budget = 8 * SEQUENCE  # one group of 8
    small = _peak_above_baseline(tmp_path, 8, budget)
    large = _peak_above_baseline(tmp_path, 64, budget)
    whole_groups = _peak_above_baseline(tmp_path, 64, 64 * SEQUENCE)
    assert "VmHWM" in small["memory_method"]  # exact, not sampled
    assert (small["micro_batches_per_step"], large["micro_batches_per_step"]) == (1, 8)
    flat = large["peak_above_baseline_bytes"] / small["peak_above_baseline_bytes"]
    grown = whole_groups["peak_above_baseline_bytes"] / small["peak_above_baseline_bytes"]
    assert flat < 1.15, f"G=64 peaks {flat:.2f}x G=8 under the same budget"
    assert grown > 3, f"whole groups of 64 peak only {grown:.2f}x one group of 8"
