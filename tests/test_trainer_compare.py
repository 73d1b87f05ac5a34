"""compare.py's outputs from given run logs: the markdown table and the side-by-side plot
(the runs themselves are trainer/run.py, tested end to end elsewhere)."""

from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

REPO = Path(__file__).resolve().parents[1]

from trainer.tools.compare import LR_SCALED, VARIANTS, collapsed, main, mean_phi, results_table, run_name
from trainer.engine.plotting import plot_comparison


def _seed(start, end, reward, entropy=0.3, lr=1e-3):
    metrics = [{"step": s, "reward/mean": reward, "acc/copy": reward + 0.1, "acc/add": None if s == 10 else s / 10,
                "entropy_mean": entropy, "phi_mean": 1.2 + s / 100, "lr": lr, "time/step": 30.0}
               for s in range(1, 11)]
    evaluations = [{"step": s, "eval/easy": start + (end - start) * s / 10, "eval/hard": start / 2,
                    "eval/mean": start, "time/eval": 60.0} for s in (0, 5, 10)]
    return {"metrics": metrics, "eval": evaluations}


def test_table_and_plot_of_three_variants(tmp_path):
    runs = {label: [_seed(0.5, 0.7 + 0.1 * i, 0.2 * (i + 1)), _seed(0.5, 0.9, 0.4)] for i, label in enumerate(VARIANTS)}
    table = results_table(runs, steps=10).splitlines()
    assert table[0] == ("| variant | learning rate | held-out easy: start -> end | held-out hard: start -> end | "
                        "held-out mean: start -> end | train reward, last 2 steps | train copy | train add | entropy | "
                        "collapsed (entropy < 0.2, reward < 0.5) | steps + evals a run |")
    # acc/add over the last 2 steps: step 9's 0.9 (step 10 drew no add prompt, logged None)
    assert table[2] == ("| GRPO | 0.001 | 0.50 -> 0.80 (0.70, 0.90) | 0.25 -> 0.25 (0.25, 0.25) | 0.50 -> 0.50 (0.50, 0.50) "
                        "| 0.300 ± 0.141 (0.20-0.40) | 0.400 ± 0.141 (0.30-0.50) | 0.900 ± 0.000 (0.90-0.90) "
                        "| 0.300 ± 0.000 (0.30-0.30) | 0 of 2 | 480 s |")
    assert len(table) == 2 + len(VARIANTS)
    plot_comparison(runs, tmp_path / "comparison.png", "test")
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_a_run_s_curves_are_drawn_from_its_metrics(tmp_path):
    """A killed run has no curves.png (a run draws it at its end), and nothing redrew it:
    `python -m trainer.tools.plot <run>` draws it from metrics.jsonl with the run's title."""
    from trainer.config import load_config, save_config
    from trainer.engine.metrics_log import MetricsLog
    from trainer.tools.plot import main as plot

    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    config = load_config(None, ["run.name=killed", "rollout.engine=hf"])
    save_config(config, run_dir / "config.yaml")
    log = MetricsLog(run_dir / "metrics.jsonl", total_steps=10, first_step=0, enabled=True, progress=False)
    for row in _seed(0.5, 0.7, 0.3)["metrics"][:6]:
        log.write(row)
    log.close()
    assert plot([str(run_dir)]) == 0
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert plot([str(run_dir), "--out", str(tmp_path / "elsewhere.png")]) == 0
    assert (tmp_path / "elsewhere.png").stat().st_size > 10_000


def test_run_times_read_in_seconds_under_ten_minutes():
    """A 70-second run reads "70 s", not "minutes a run 0.1"."""
    from trainer.tools.compare import duration

    assert [duration(70.4), duration(599.0), duration(600.0), duration(6600.0)] == [
        "70 s", "599 s", "10.0 min", "110.0 min"]


def test_collapse_needs_both_low_entropy_and_low_reward_over_the_last_fifth():
    assert collapsed(_seed(0.5, 0.5, reward=0.45, entropy=0.1)["metrics"], steps=10)
    assert not collapsed(_seed(0.5, 0.5, reward=0.8, entropy=0.1)["metrics"], steps=10)  # sure and right
    assert not collapsed(_seed(0.5, 0.5, reward=0.45, entropy=0.5)["metrics"], steps=10)  # still exploring
    rows = _seed(0.5, 0.5, reward=0.45, entropy=0.1)["metrics"]
    for row in rows[:8]:
        row["entropy_mean"] = 2.0  # only the last 2 of 10 steps count
    assert collapsed(rows, steps=10)
    rows[-1]["entropy_mean"] = 0.5
    assert not collapsed(rows, steps=10)  # window mean 0.3


def test_collapses_are_counted_per_variant():
    runs = {"GRPO": [_seed(0.5, 0.5, 0.7), _seed(0.5, 0.5, 0.7)],
            "HA-DW": [_seed(0.5, 0.5, 0.7), _seed(0.5, 0.5, 0.4, entropy=0.1), _seed(0.5, 0.5, 0.45, entropy=0.15)]}
    table = results_table(runs, steps=10).splitlines()
    assert [line.split(" | ")[-2] for line in table[2:]] == ["0 of 2", "2 of 3"]


def test_mean_phi_is_over_every_step_then_the_seeds():
    seeds = [_seed(0.5, 0.5, 0.5), _seed(0.5, 0.5, 0.5)]
    seeds[1]["metrics"] = [{**row, "phi_mean": 1.4} for row in seeds[1]["metrics"]]
    seeds[1]["metrics"][0].pop("phi_mean")  # a skipped update logs no Phi
    assert mean_phi(seeds) == pytest.approx(((1.2 + 0.055) + 1.4) / 2)


def test_scaled_variant_is_not_reused_at_another_learning_rate(tmp_path):
    run_dir = tmp_path / "compare" / run_name("compare", LR_SCALED, 0).split("/", 1)[1]
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train:\n  learning_rate: 0.0013\n")
    with pytest.raises(SystemExit, match="ran at learning rate 0.0013, this call asks for 0.0012"):
        main(["--variants", LR_SCALED, "--lr-scale", "1.2", "--seeds", "0", "--set", f"run.output_dir={tmp_path}",
              "--set", "train.learning_rate=1e-3"])  # the base rate given, so the default can move


def test_scaled_variant_needs_a_factor_or_the_kalman_runs():
    with pytest.raises(SystemExit):
        main(["--variants", LR_SCALED, "--seeds", "0"])


def test_run_names_are_plain_paths():
    assert [run_name("compare", label, 1) for label in VARIANTS] == [
        "compare/grpo-seed1", "compare/grpo-lr-x-mean-phi-seed1", "compare/grpo-ha-dw-kalman-seed1",
        "compare/grpo-ha-dw-authors-seed1"]
