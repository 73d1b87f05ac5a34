"""compare.py's outputs from given run logs: the markdown table and the side-by-side plot
(the runs themselves are trainer/run.py, tested end to end elsewhere)."""

from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

REPO = Path(__file__).resolve().parents[1]

from trainer.engine.plotting import plot_comparison
from trainer.tools.compare import KALMAN, LR_SCALED, VARIANTS, collapsed, main, mean_phi, results_table, run_name


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
        "compare/grpo-ha-dw-authors-seed1", "compare/dr.grpo-seed1", "compare/rloo-seed1",
        "compare/james-stein-seed1", "compare/prompt-history-seed1", "compare/prompt-history-phi-seed1"]


def test_the_arms_differ_from_grpo_in_what_their_names_say():
    """Dr.GRPO is GRPO without the std and nothing else (its loss type's aggregation kept);
    the history arm with Phi is the history arm with HA-DW's kalman Phi."""
    from trainer.config import load_config
    from trainer.tools.compare import fingerprint

    def settings(label):
        return fingerprint(load_config(None, VARIANTS[label]))["settings"]

    def differing(first, second):
        return {key for key in settings(first) if settings(first)[key] != settings(second)[key]}

    assert differing("Dr.GRPO", "GRPO") == {"algorithm.normalize_std"}
    assert settings("Dr.GRPO")["algorithm.normalize_std"] is False
    assert settings("Dr.GRPO")["algorithm.loss_type"] == "grpo"
    assert differing("prompt history+Phi", "prompt history") == {"algorithm.hadw"}
    assert differing("prompt history+Phi", KALMAN) == {"algorithm.advantage_estimator"}


def test_dr_grpo_s_advantage_is_grpo_s_without_the_std():
    import torch

    from trainer.config import load_config
    from trainer.engine.loop import batch_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    grpo = batch_advantages(rewards, 4, load_config(None, VARIANTS["GRPO"]).algorithm, 1.3, belief=0.5)[0]
    dr_grpo = batch_advantages(rewards, 4, load_config(None, VARIANTS["Dr.GRPO"]).algorithm, 1.3, belief=0.5)[0]
    assert torch.allclose(dr_grpo, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(grpo[:4], dr_grpo[:4] / rewards[:4].std(), atol=1e-4)


def _finished(run_dir: Path, overrides: list[str], steps: int = 10) -> None:
    """A finished run as the trainer leaves it: its resolved config.yaml and its metrics."""
    from trainer.config import load_config, save_config

    _write_run(run_dir, 0, 0.5, 0.3)
    save_config(load_config(None, overrides + [f"train.steps={steps}"]), run_dir / "config.yaml")


def test_a_finished_run_is_reused_only_with_the_settings_it_ran(tmp_path, capsys):
    """A run is named by its variant and seed, not by the rest of its config: a call that
    asks for another G, task setting or estimator under the same name is refused, naming
    each differing key, rather than read back."""
    output = tmp_path / "runs"
    run_dir = output / run_name("compare", "GRPO", 0)
    _finished(run_dir, ["algorithm.hadw=false", "rollout.group_size=2", "train.seed=0"])
    call = ["--variants", "GRPO", "--seeds", "0", "--steps", "10", "--set", f"run.output_dir={output}"]
    assert main(call + ["--set", "rollout.group_size=2", "--set", "run.threads=1"]) == 0  # reused: threads do not count
    assert (run_dir / "fingerprint.json").exists()
    with pytest.raises(SystemExit, match=r"ran with other settings than this call asks \(rollout.group_size 2 -> 4\)"):
        main(call + ["--set", "rollout.group_size=4"])
    with pytest.raises(SystemExit, match=r"data.prompt_pool 0 -> 100, rollout.group_size 2 -> 8\)"):
        main(call + ["--set", "rollout.group_size=8", "--set", "data.prompt_pool=100"])
    with pytest.raises(SystemExit, match="ran 10 steps, this call asks for 5"):
        main(call[:4] + ["--steps", "5", "--set", f"run.output_dir={output}", "--set", "rollout.group_size=2"])


def test_the_fingerprint_leaves_out_what_does_not_change_a_run(tmp_path):
    from trainer.config import load_config, save_config
    from trainer.tools.compare import fingerprint, saved_fingerprint

    base = fingerprint(load_config(None, []))
    moved = fingerprint(load_config(None, ["run.name=elsewhere", "run.output_dir=/tmp/x", "run.threads=2",
                                           "run.plot=false", "run.progress=false", "run.keep_checkpoints=4",
                                           "train.steps=50"]))
    assert moved["sha256"] == base["sha256"]
    for changed in ("train.seed=1", "algorithm.advantage_estimator=rloo", "data.prompt_pool=10", "eval.every=5",
                    "train.learning_rate=1e-3", "run.log_samples=8"):
        assert fingerprint(load_config(None, [changed]))["sha256"] != base["sha256"], changed
    # A config.yaml an older trainer wrote, without a key added since, reads as its default.
    run_dir = tmp_path / "older"
    run_dir.mkdir()
    save_config(load_config(None, []), run_dir / "config.yaml")
    text = (run_dir / "config.yaml").read_text().replace("  prompt_pool: 0\n", "")
    assert "prompt_pool" not in text
    (run_dir / "config.yaml").write_text(text)
    assert saved_fingerprint(run_dir)["sha256"] == base["sha256"]
    (run_dir / "config.yaml").write_text(text + "train:\n  retired_key: 1\n")
    with pytest.raises(SystemExit, match="does not read as this trainer's config .*retired_key"):
        saved_fingerprint(run_dir)


def _write_run(directory: Path, seed: int, reward: float, add: float) -> None:
    """A finished 10-step run's metrics, which compare.py reads back instead of running."""
    import json

    directory.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": reward, "acc/copy": reward + 0.1, "acc/add": add, "entropy_mean": 0.5,
             "phi_mean": 1.3, "lr": 4e-4, "time/step": 0.5, "anchor/belief": 0.1} for s in range(1, 11)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    samples = [{"step": s, "group_rewards": rewards} for s in range(1, 11) for rewards in ([1.0, 0.0], [0.0, 0.0])]
    (directory / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in samples))


def test_a_sweep_tables_each_value_and_the_paired_differences(tmp_path):
    """Over G = 2, 4 with two seeds: HA-DW's reward is GRPO's + 0.02 on seed 0 and + 0.04
    on seed 1 at each G, so the paired difference is 0.03 with the interval of two values
    (t at 1 degree of freedom, 12.706, times the sd 0.01414 over sqrt 2: 0.127)."""
    output = tmp_path / "runs"
    for value in (2, 4):
        for seed in (0, 1):
            grpo = 0.5 + 0.1 * seed + 0.1 * (value == 4)
            _write_run(output / run_name(f"sweep/group_size-{value}", "GRPO", seed), seed, grpo, 0.3)
            _write_run(output / run_name(f"sweep/group_size-{value}", KALMAN, seed), seed, grpo + 0.02 * (seed + 1), 0.4)
    table_path = tmp_path / "sweep.md"
    main(["--sweep", "rollout.group_size=2,4", "--seeds", "0", "1", "--steps", "10", "--variants", "GRPO", KALMAN,
          "--name", "sweep", "--set", f"run.output_dir={output}", "--table", str(table_path)])
    text = table_path.read_text()
    assert "| rollout.group_size | variant | seeds | reward | copy | add |" in text
    assert "| 2 | GRPO | 2 | 0.550 [-0.085, 1.185] | 0.650 [0.015, 1.285] | 0.300 [0.300, 0.300] |" in text
    assert f"| 2 | {KALMAN} - GRPO | +0.030 [-0.097, +0.157] | +0.030 [-0.097, +0.157] | +0.100 [+0.100, +0.100] |" in text
    # HA-DW at G = 2 against GRPO at G = 4: 0.52 - 0.6 and 0.64 - 0.7
    assert f"| {KALMAN} at 2 - GRPO at 4 | -0.070 [-0.197, +0.057] |" in text
    # a group (1, 0) against the belief 0.1: Phi = lambda exp(-0.4) on the right answer, lambda exp(+0.4)
    # on the wrong one, so the wrong one weighs exp(0.8) = 2.23 times as much; the (0, 0) groups do not count
    assert f"| 2 | {KALMAN} | 0.100 [0.100, 0.100] | 2.23 [2.23, 2.23] |" in text
    assert "Machine time: 0 s over 0 run processes" in text
    assert (output / "sweep" / "sweep.png").stat().st_size > 10_000
    assert (output / "sweep" / "group_size-4" / "comparison.png").exists()


@pytest.mark.parametrize("sweep, message", [
    ("rollout.group_size", "expected SECTION.KEY=V1,V2"),
    ("rollout.group_size=2,,4", "expected SECTION.KEY=V1,V2"),
    ("rollout.group_size=2,2", "given twice"),
    ("train.seed=0,1", "cannot be swept"),
    ("rollout.group_size=1,4", "rollout.group_size=1: rollout.group_size must be at least 2"),
    ("rollout.group_sise=2,4", "rollout.group_sise"),
])
def test_a_bad_sweep_is_refused_naming_the_flag(sweep, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--sweep", sweep, "--variants", "GRPO"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "argument --sweep" in error and message in error


def test_the_swept_setting_cannot_also_be_set(capsys):
    with pytest.raises(SystemExit):
        main(["--sweep", "rollout.group_size=2,4", "--set", "rollout.group_size=8", "--variants", "GRPO"])
    assert "rollout.group_size is also given by --set" in capsys.readouterr().err
