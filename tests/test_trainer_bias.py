"""trainer/tools/bias.py: the figures from given draws (exact cases and the bias a
Monte Carlo of Bernoulli groups must show), and the command on a tiny run's checkpoints."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hadw_kernels import DifficultyAnchor
from trainer.tools.bias import Draws, analyse, anchor_beliefs, main, summary_table

REPO = Path(__file__).resolve().parents[1]


def _cell(result, size, scale, band, outcome):
    return result["sizes"][size]["bands"][f"{scale}|{band}"][outcome]


def test_an_unbiased_group_has_no_grpo_error_and_phi_s_error_is_its_own():
    """A prompt of true accuracy 1/4 and groups of 4 with one correct response: the
    baseline is exact, so GRPO's centred error is 0; HA-DW's Phi at anchor 0.5 is
    lambda * exp(+0.25) on the correct response (a group harder than C) and
    lambda * exp(-0.25) on the wrong ones."""
    draws = Draws(levels=["add"] * 3, reference_correct=[32] * 3, reference=128,
                  groups={4: [[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]]},
                  beliefs={4: [0.5]})
    result = analyse(draws, lambda_scale=1.3)
    correct = _cell(result, 4, "centred", "[0.1, 0.3)", "correct")
    wrong = _cell(result, 4, "centred", "[0.1, 0.3)", "wrong")
    assert correct["prompts"] == 3 and correct["responses"] == 3 and wrong["responses"] == 9
    assert correct["truth"][0] == pytest.approx(0.75) and wrong["truth"][0] == pytest.approx(-0.25)
    assert correct["GRPO"]["signed"][0] == pytest.approx(0.0, abs=1e-12)
    assert wrong["GRPO"]["absolute"][0] == pytest.approx(0.0, abs=1e-12)
    assert correct["HA-DW"]["signed"][0] == pytest.approx(0.75 * (1.3 * math.exp(0.25) - 1))
    assert wrong["HA-DW"]["signed"][0] == pytest.approx(-0.25 * (1.3 * math.exp(-0.25) - 1))
    assert correct["HA-DW / lambda"]["signed"][0] == pytest.approx(0.75 * (math.exp(0.25) - 1))
    # std-normalised: (1 - 1/4) / (s + 1e-6), s the unbiased std of (1, 0, 0, 0) = 1/2;
    # the truth (1 - 1/4) / sqrt(p (1 - p)) with p = 32.5 / 129
    p = 32.5 / 129
    normalised = _cell(result, 4, "std-normalised", "[0.1, 0.3)", "correct")
    assert normalised["GRPO"]["signed"][0] == pytest.approx(0.75 / (0.5 + 1e-6) - 0.75 / math.sqrt(p * (1 - p)))
    spread = result["sizes"][4]["spread"]
    assert spread["one_correct"]["groups"] == 3 and spread["one_correct"]["counts"][3] == 3  # p in [0.2, 0.3)
    assert spread["one_correct"]["baseline_above_p"] == 0.0  # p = 1/4 is not below 1/G
    assert result["sizes"][4]["updating_share"] == 1.0
    # the hard prompts' row is this band's; "any" pools both outcomes' responses
    assert _cell(result, 4, "centred", "p < 0.3", "correct") == correct
    both = _cell(result, 4, "centred", "all", "any")
    assert both["responses"] == 12 and both["GRPO"]["absolute"][0] == pytest.approx(0.0, abs=1e-12)
    assert both["HA-DW"]["signed"][0] == pytest.approx(
        (3 * 0.75 * (1.3 * math.exp(0.25) - 1) + 9 * -0.25 * (1.3 * math.exp(-0.25) - 1)) / 12)
    summary = summary_table({40: result}).splitlines()
    assert summary[0] == "Centred scale:"
    assert summary[2].startswith("| step | G | C | abs error, all: GRPO | HA-DW | HA-DW / λ | correct, p < 0.3: GRPO |")
    assert summary[4].startswith("| 40 | 4 | 0.50 | 0.00 ± 0.00 | ")
    assert summary[4].endswith(" | - | - | - |")  # no easy prompt


def test_groups_that_do_not_update_are_left_out():
    draws = Draws(levels=["copy", "copy"], reference_correct=[0, 128], reference=128,
                  groups={2: [[[0.0, 0.0], [1.0, 1.0]]]}, beliefs={2: [0.5]})
    result = analyse(draws, lambda_scale=1.3)
    assert result["sizes"][2]["updating_share"] == 0.0
    row = result["sizes"][2]["bands"]["centred|all"]
    assert row["correct"]["prompts"] == 0 and row["wrong"]["prompts"] == 0 and row["prompts"] == 2


def test_bernoulli_groups_show_the_paper_s_bias_on_hard_prompts():
    """400 prompts of accuracy 0.05, 10 groups of 8 each, drawn as Bernoulli: a correct
    response in a group that updates gets E[1 - p_hat | r = 1, S] = 1 - (1 + E[X | X < 7]) / 8
    (X ~ Binomial(7, 0.05)), 0.831, against the true 0.95: GRPO under-rewards it by 0.119,
    and the interval holds that value. One-correct groups sit on prompts with p < 1/8."""
    rng = np.random.default_rng(0)
    p, size, prompts, repeats = 0.05, 8, 400, 10
    groups = [(rng.random((prompts, size)) < p).astype(float).tolist() for _ in range(repeats)]
    draws = Draws(levels=["add"] * prompts, reference_correct=[round(p * 1280)] * prompts, reference=1280,
                  groups={size: groups}, beliefs={size: [0.5] * repeats})
    result = analyse(draws, lambda_scale=1.3)
    x = np.arange(7)
    weights = np.array([math.comb(7, k) * p ** k * (1 - p) ** (7 - k) for k in x])
    expected = 1 - (1 + (x * weights).sum() / weights.sum()) / 8 - (1 - p)
    mean, half = _cell(result, size, "centred", "[0, 0.1)", "correct")["GRPO"]["signed"]
    assert expected == pytest.approx(-0.119, abs=1e-3)
    assert abs(mean - expected) < half < 0.02
    assert result["sizes"][size]["spread"]["one_correct"]["baseline_above_p"] == 1.0


def test_the_anchor_gives_each_batch_the_belief_the_run_would():
    """A copy of the checkpointed anchor folds each drawn batch in; the anchor itself is
    left as it was (the posterior of a one-batch hard rule is the batch's mean)."""
    anchor = DifficultyAnchor("hard", window=1, belief="posterior")
    anchor.update([0.0, 0.0])
    beliefs = anchor_beliefs(anchor, {2: [[[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 1.0]]]})
    assert beliefs == {2: [0.75, 0.25]}
    assert anchor.value == 0.0


def test_a_reward_that_is_not_right_or_wrong_is_refused():
    """p is a count of right answers: a reward of 0.5 would be counted as neither."""
    from types import SimpleNamespace

    from trainer.config import load_config
    from trainer.tools.bias import draw

    engine = SimpleNamespace(generate=lambda ids, seeds: ([[1]] * (2 * len(ids)), None))
    tokenizer = SimpleNamespace(batch_decode=lambda responses, skip_special_tokens: ["x"] * len(responses))
    reward = lambda texts, problems: SimpleNamespace(rewards=[1.0, 0.5] * (len(texts) // 2))  # noqa: E731
    with pytest.raises(ValueError, match="needs rewards of 0 or 1; this run's reward gave 0.5"):
        draw(engine, load_config().rollout, [[1], [2]], 2, [0], reward, ["a", "b"], tokenizer, chunk=2, label="test")


@pytest.mark.parametrize("argv, message", [
    (["{run}", "--groups", "0"], "argument --groups: must be at least 1"),
    (["{run}", "--reference", "1"], "argument --reference: must be at least 2"),
    (["{run}", "--group-sizes", "1"], "argument --group-sizes: must be at least 2"),
    (["{run}", "--steps", "7"], "argument --steps: no checkpoint at step(s) [7]"),
    (["{empty}"], "argument run: "),
])
def test_bad_arguments_are_refused_naming_the_flag(tmp_path, argv, message, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  steps: 2\n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exited:
        main([arg.format(run=run, empty=tmp_path / "empty") for arg in argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_on_a_tiny_run_s_checkpoints(tmp_path):
    """A 4-step run of the tiny model (checkpoints at 2 and 4), then the tool at both, as
    a module: tables, JSON draws and one plot per checkpoint; the reference accuracy of
    each prompt is its correct count over the reference draws."""
    pytest.importorskip("deepspeed", reason="the trainer extra is not installed (scripts/setup_venv.sh)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "trainer" / "run.py")] + [arg for setting in (
            "train.steps=4", "train.prompts_per_step=8", "train.mini_batch_prompts=4", "train.micro_batch_prompts=2",
            "rollout.group_size=4", "run.checkpoint_every=2", "run.progress=false", "run.export_hf=false",
            "run.plot=false", f"run.output_dir={tmp_path}", "run.name=tiny") for arg in ("--set", setting)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "bias"
    result = subprocess.run(
        [sys.executable, "-m", "trainer.tools.bias", str(tmp_path / "tiny"), "--steps", "2", "4",
         "--group-sizes", "2", "4", "--groups", "2", "--reference", "16", "--prompts-per-level", "4", "--chunk", "8",
         "--history-discounts", "0.9", "0.5", "--output", f"{out}.md", "--json", f"{out}.json", "--plot", f"{out}.png"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 4: draw 5/5: 16 reference responses a prompt" in result.stderr
    assert "step 4: draw 5: 8/16 prompts" in result.stderr  # progress after each chunk of 8
    text = (tmp_path / "bias.md").read_text()
    assert text.count("## Step ") == 2 and text.count("### G = 4") == 2
    saved = json.loads((tmp_path / "bias.json").read_text())
    draws = saved["draws"]["4"]
    assert len(draws["prompts"]) == 16 and draws["reference"] == 16  # 4 levels x 4 distinct problems
    assert [len(batch) for batch in draws["groups"]["2"]] == [16, 16]
    assert all(0 <= k <= 16 for k in draws["reference_correct"])
    assert (tmp_path / "bias-step2.png").exists() and (tmp_path / "bias-step4.png").exists()
    # The history rebuilt from outcomes.jsonl at the run's discount is the one it checkpointed.
    flat = {name: [value for pair in priors for value in pair] for name, priors in draws["priors"].items()}
    assert flat["run's, rho 0.9"] == pytest.approx(flat["rho 0.9"], abs=1e-12)
    assert draws["priors"]["rho 0.5"] != draws["priors"]["rho 0.9"]
    assert "| 4 | 2 | james_stein | " in text and "| 4 | 4 | prompt_history (rho 0.5) | " in text
    assert "| all | 4 | rloo | " in text  # the per-band tables


def test_estimator_scores_by_hand():
    """Two prompts of true accuracy 1/2 and 0, one batch: the group {1, 0} and the group
    {0, 0}. GRPO's and RLOO's baselines for the all-wrong group are 0 (exact: no error);
    James-Stein shrinks it toward the other prompt's mean (lambda = 1 with one other
    group of variance 1/2 and no spread): b = 1/2, an error of 1/4 squared."""
    draws = Draws(levels=["add", "copy"], reference_correct=[64, 0], reference=128,
                  groups={2: [[[1.0, 0.0], [0.0, 0.0]]]}, beliefs={2: [0.5]}, batch_prompts=2,
                  priors={"flat": [[1.0, 1.0], [1.0, 1.0]]})
    scores = analyse(draws, lambda_scale=1.0)["estimators"][2]["all"]
    # GRPO: baselines 1/2 (both responses of the first group, exact) and 0 (exact).
    assert scores["grpo"]["squared|all"][0] == pytest.approx(0.0)
    # RLOO: the first group's baselines are 0 and 1, each 1/2 off: (1/4 + 1/4 + 0 + 0) / 4.
    assert scores["rloo"]["squared|all"][0] == pytest.approx(0.125)
    assert scores["rloo"]["squared|updating"][0] == pytest.approx(0.25)
    # James-Stein: the first group's other group {0, 0} has variance 0, so lambda 0 (RLOO's
    # 1/4 twice); the second group's b = 1/2 (error 1/4 twice): (2/4 + 2/4) / 4.
    assert scores["james_stein"]["squared|all"][0] == pytest.approx(0.25)
    # The flat prior (1, 1) with one other response: b = (1 + r_other) / 3.
    expected = ((1 / 3 - 0.5) ** 2 + (2 / 3 - 0.5) ** 2 + 2 * (1 / 3) ** 2) / 4
    assert scores["prompt_history (flat)"]["squared|all"][0] == pytest.approx(expected)
    # The advantage's error is the baseline's, negated: A - (r - p) = p - b.
    assert scores["rloo"]["signed|all"][0] == pytest.approx(0.0)
    assert scores["james_stein"]["signed|all"][0] == pytest.approx(-0.25)


def test_estimator_scores_over_the_updating_groups_leave_the_all_equal_ones_out():
    draws = Draws(levels=["add", "copy"], reference_correct=[64, 0], reference=128,
                  groups={2: [[[1.0, 0.0], [0.0, 0.0]]]}, beliefs={2: [0.5]}, batch_prompts=2)
    scores = analyse(draws, lambda_scale=1.0)["estimators"][2]["all"]
    # James-Stein's updating group {1, 0} is RLOO's (lambda 0): errors 1/2 and -1/2.
    assert scores["james_stein"]["signed|updating"][0] == pytest.approx(0.0)
    assert scores["james_stein"]["absolute|updating"][0] == pytest.approx(0.5)
    # Over all groups the all-wrong group adds two errors of -1/2 (b = 1/2, p = 0).
    assert scores["james_stein"]["absolute|all"][0] == pytest.approx(0.5)
    assert scores["james_stein"]["signed|all"][0] == pytest.approx(-0.25)
