"""compare.py's outputs from given run logs: the markdown table and the side-by-side plot
(the runs themselves are trainer/run.py, tested end to end elsewhere)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.compare import VARIANTS, results_table, run_name  # noqa: E402
from trainer.plotting import plot_comparison  # noqa: E402


def _seed(start, end, reward):
    metrics = [{"step": s, "reward/mean": reward, "time/step": 30.0} for s in range(1, 11)]
    evaluations = [{"step": s, "eval/easy": start + (end - start) * s / 10, "eval/hard": start / 2,
                    "eval/mean": start, "time/eval": 60.0} for s in (0, 5, 10)]
    return {"metrics": metrics, "eval": evaluations}


def test_table_and_plot_of_three_variants(tmp_path):
    runs = {label: [_seed(0.5, 0.7 + 0.1 * i, 0.2 * (i + 1)), _seed(0.5, 0.9, 0.4)] for i, label in enumerate(VARIANTS)}
    table = results_table(runs, steps=10).splitlines()
    assert table[0] == ("| variant | held-out easy: start -> end | held-out hard: start -> end | "
                        "held-out mean: start -> end | train reward, last 2 steps | minutes a run |")
    assert table[2] == "| GRPO | 0.50 -> 0.80 (0.70, 0.90) | 0.25 -> 0.25 (0.25, 0.25) | 0.50 -> 0.50 (0.50, 0.50) | 0.300 (0.200, 0.400) | 8.0 |"
    assert len(table) == 2 + len(VARIANTS)
    plot_comparison(runs, tmp_path / "comparison.png", "test")
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_run_names_are_plain_paths():
    assert [run_name("compare", label, 1) for label in VARIANTS] == [
        "compare/grpo-seed1", "compare/grpo-ha-dw-kalman-seed1", "compare/grpo-ha-dw-authors-seed1"]
