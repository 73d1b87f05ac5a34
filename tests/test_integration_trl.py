"""hadw_kernels.integrations.trl with TRL 1.16's GRPOTrainer on the CPU: a tiny Llama
built from a config and a word-level tokenizer, both offline, and a toy reward (the
fraction of "7"s in a completion).

With HA-DW off the integration must be TRL: the same logged losses and metrics, and
(plain SGD, so parameters move by the gradient) the same parameters after two steps,
for each loss type. With HA-DW on, the advantages are TRL's times Phi from the anchor
folded once per generation batch, and the anchor survives a save and resume."""

import json
import math
import types

import pytest
import torch

trl = pytest.importorskip("trl", reason="the trl extra is not installed")

from trl_runs import (  # noqa: E402
    PROMPTS,
    RUN,
    STOCK_TRL,
    TOKENIZER,
    assert_masks_do_not_rest_on_rounding,
    logged_steps,
    sevens,
    tiny_model_dir,
    train,
    train_recording_bounds,
)

from hadw_kernels import (  # noqa: E402
    DifficultyAnchor,
    PromptHistory,
    fused_hadw_grpo_loss,
    hadw_advantages,
    hadw_weights,
    prompt_key,
)
from hadw_kernels.advantage.anchor import DEFAULT_RULE  # noqa: E402
from hadw_kernels.integrations.trl import ANCHOR_FILE, HISTORY_FILE, HADWGRPOConfig, HADWGRPOTrainer  # noqa: E402

# Each TRL loss type, with its options set away from their defaults where it has them:
# delta above and below 1 + epsilon_high, CISPO's cap low enough to bind, other SAPO
# temperatures and VESPO shapes; SAPO at sequence level is what Liger's loss refuses.
LOSS_SETTINGS = {
    "dapo+kl+delta": dict(loss_type="dapo", beta=0.05, use_bias_correction_kl=False, delta=1.5),
    "grpo": dict(loss_type="grpo", epsilon_high=0.28),
    "bnpo+delta": dict(loss_type="bnpo", delta=1.1),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "cispo+sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.02),
    # TRL's default epsilon_high (epsilon, 0.2) as CISPO's cap: taken, with a warning; with
    # the old log-probs TRL computes here, with none (each step one generation batch: TRL's
    # ratio is 1), and at sequence level with the bias-corrected KL and the off-policy mask.
    "cispo+default_cap": dict(loss_type="cispo"),
    "cispo+default_cap+on_policy": dict(loss_type="cispo", gradient_accumulation_steps=4),
    "cispo+default_cap+sequence+kl_bias+off_policy_mask": dict(
        loss_type="cispo", importance_sampling_level="sequence", beta=0.05, use_bias_correction_kl=True,
        off_policy_mask_threshold=0.02),
    "sapo+sequence": dict(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=0.8,
                          sapo_temperature_neg=1.5),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    # The token masks and the bias-corrected KL (without vLLM the off-policy mask reads the
    # old log-probs, which the second step's micro-batches hold). The off-policy threshold is
    # above 0: before the first update a response's KL is exactly 0, and a threshold of 0
    # would split those responses by the last bits of each side's log-probs.
    "grpo+entropy_mask": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "grpo+off_policy_mask+kl_bias": dict(loss_type="grpo", beta=0.05, use_bias_correction_kl=True,
                                         off_policy_mask_threshold=0.02),
    # TRL's VESPO weight is per response at either level; at its default level "token" its
    # bias-corrected KL weighs each token by the token's own ratio.
    "vespo+sequence": dict(loss_type="vespo", importance_sampling_level="sequence", vespo_k_pos=1.5,
                           vespo_lambda_pos=2.5, vespo_k_neg=4.0, vespo_lambda_neg=1.5),
    "vespo+kl_bias": dict(loss_type="vespo", beta=0.05, use_bias_correction_kl=True),
}
COMPARED_METRICS = ("loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                    "cispo_clip_ratio")
# The clip fraction TRL logs, which must see clipping in one of the two steps (None: TRL
# logs none; GSPO's range is 4e-4 wide).
CLIP_METRIC = {"gspo": None, "cispo": "cispo_clip_ratio", "cispo+sequence": "cispo_clip_ratio",
               "cispo+default_cap": "cispo_clip_ratio", "cispo+default_cap+on_policy": "cispo_clip_ratio",
               "cispo+default_cap+sequence+kl_bias+off_policy_mask": "cispo_clip_ratio",
               "sapo+sequence": None, "vespo+sequence": None, "vespo+kl_bias": None}
# TRL counts its high clip fraction on the ratio after delta's cap, so with delta below
# 1 + epsilon_high it logs 0 however many ratios pass 1 + epsilon_high; this integration
# counts them (docs/math.md, "Where the hosts differ").
HIGH_CLIP_UNDER_DELTA = ("clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def spread_model_dir(tmp_path_factory) -> str:
    """For the entropy mask: entropies spread over [0.3, 2.3] rather than within 1e-5 of
    log V, so that which tokens pass the quantile does not rest on the last bits each side
    computes them to (test_the_entropy_quantile_is_far_from_every_other_entropy)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-spread"), head_scale=16.0)


@pytest.mark.parametrize("setting", LOSS_SETTINGS)
def test_without_hadw_the_integration_is_trl(setting, model_dir, spread_model_dir, tmp_path):
    options = dict(LOSS_SETTINGS[setting], max_steps=2)
    if options.get("top_entropy_quantile", 1.0) < 1.0:
        model_dir = spread_model_dir
    stock, recorded = train_recording_bounds(model_dir, tmp_path / "stock",
                                             **{k: v for k, v in options.items() if not k.startswith("hadw_")})
    assert_masks_do_not_rest_on_rounding(recorded, options)
    fused = train(HADWGRPOTrainer, HADWGRPOConfig, model_dir, tmp_path / "fused", **STOCK_TRL, **options)
    assert fused.anchor is None
    stock_steps, fused_steps = logged_steps(stock), logged_steps(fused)
    assert len(stock_steps) == len(fused_steps) == 2
    epsilon_high = options.get("epsilon_high", options.get("epsilon", 0.2))
    delta_caps = options.get("delta") is not None and options["delta"] <= 1 + epsilon_high
    for expected, got in zip(stock_steps, fused_steps):
        assert {name for name in COMPARED_METRICS if name in got} == {name for name in COMPARED_METRICS
                                                                       if name in expected}
        for name in COMPARED_METRICS:
            if name in expected and not (delta_caps and name in HIGH_CLIP_UNDER_DELTA):
                assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    if delta_caps:
        assert all(step["clip_ratio/high_mean"] == 0 for step in stock_steps)
        assert any(step["clip_ratio/high_mean"] > 0 for step in fused_steps)
        for expected, got in zip(stock_steps, fused_steps):
            assert got["clip_ratio/region_mean"] == pytest.approx(
                expected["clip_ratio/low_mean"] + got["clip_ratio/high_mean"], rel=1e-5, abs=1e-6)
    assert fused_steps[0]["loss"] == pytest.approx(stock_steps[0]["loss"], rel=0, abs=1e-6)
    clip_metric = CLIP_METRIC.get(setting, "clip_ratio/region_mean")
    if clip_metric is not None:
        assert any(step[clip_metric] > 0 for step in stock_steps)
    for expected, got in zip(stock.model.parameters(), fused.model.parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", ["cispo+sequence", "sapo+sequence", "vespo+sequence"])
def test_what_liger_s_loss_refuses_this_integration_trains(setting):
    """Liger's fused GRPO loss refuses importance_sampling_level='sequence' with cispo, sapo
    and vespo, which TRL's own loss computes; test_without_hadw_the_integration_is_trl
    trains each of them here as stock TRL does."""
    grpo_loss = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss", reason="liger-kernel is not installed")
    options = LOSS_SETTINGS[setting]
    assert options["importance_sampling_level"] == "sequence"
    with pytest.raises(ValueError, match="Sequence-level importance sampling is not supported"):
        grpo_loss.LigerFusedLinearGRPOFunction.ppo_loss_fn(
            torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1), torch.ones(1, 2), loss_type=options["loss_type"],
            importance_sampling_level="sequence",
        )


class RecordingTrainer(HADWGRPOTrainer):
    """Keeps each generation batch's gathered rewards, prompt keys, the anchor's belief
    (None without HA-DW) and the advantages it hands on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generations = []

    def _calculate_rewards(self, *args):
        rewards = super()._calculate_rewards(*args)
        self.generations.append({"rewards": rewards[:, 0].clone()})
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        keys = [prompt_key(ids[mask.bool()]) for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]
        self.generations[-1].update(advantages=output["advantages"].clone(), keys=keys,
                                    belief=None if self.anchor is None else self.anchor.value)
        return output


def test_hadw_scales_trl_advantages_by_phi_for_three_steps(model_dir, tmp_path):
    trainer = train(RecordingTrainer, HADWGRPOConfig, model_dir, tmp_path, max_steps=3, hadw_lambda_scale=1.5,
                    hadw_anchor_rule="soft")
    # Three optimizer steps, a generation batch every two: two anchor updates.
    assert len(trainer.generations) == 2 and trainer.anchor.step == 2
    reference = DifficultyAnchor("soft")
    for generation in trainer.generations:
        rewards = generation["rewards"]
        assert generation["belief"] == reference.update(rewards)
        grouped = rewards.view(-1, 4)
        trl_advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        phi = hadw_weights(rewards, 4, generation["belief"], lambda_scale=1.5)
        torch.testing.assert_close(generation["advantages"], trl_advantages * phi)
    steps = logged_steps(trainer)
    assert len(steps) == 3 and all(math.isfinite(step["loss"]) for step in steps)
    assert "hadw/anchor" in steps[0] and "hadw/phi_mean" in steps[0]


def test_the_kalman_anchor_rule_gets_each_batch_s_reward_count(model_dir, tmp_path):
    """The kalman rule weighs y_t by B_t: the integration hands it the count (and the
    variance) of the gathered rewards, and its beliefs are the library's."""
    trainer = train(RecordingTrainer, HADWGRPOConfig, model_dir, tmp_path, max_steps=3, hadw_anchor_rule="kalman")
    assert len(trainer.generations) == 2 and trainer.anchor.step == 2
    reference = DifficultyAnchor("kalman")
    for generation in trainer.generations:
        assert generation["belief"] == reference.update(generation["rewards"])
    assert trainer.anchor.state_dict() == reference.state_dict()


@pytest.mark.parametrize("estimator, use_hadw", [("rloo", False), ("james_stein", True), ("prompt_history", False)])
def test_the_estimators_advantages_are_the_library_s(estimator, use_hadw, model_dir, tmp_path):
    """Five steps, three generation batches of four prompts (eight in the dataset: the
    third batch's prompts were seen in the first): each batch's advantages are
    hadw_advantages' on its gathered rewards, the history replayed from the batches."""
    history_options = dict(hadw_history_discount=0.5) if estimator == "prompt_history" else {}
    trainer = train(RecordingTrainer, HADWGRPOConfig, model_dir, tmp_path, max_steps=5, use_hadw=use_hadw,
                    hadw_advantage_estimator=estimator, hadw_anchor_rule="soft", save_strategy="steps", save_steps=5,
                    **history_options)
    assert len(trainer.generations) == 3
    history = PromptHistory(discount=0.5)
    for generation in trainer.generations:
        prior = history.update(generation["rewards"], generation["keys"]) if estimator == "prompt_history" else None
        expected = hadw_advantages(generation["rewards"], group_size=4, estimator=estimator,
                                   anchor=generation["belief"], prior=prior)
        torch.testing.assert_close(generation["advantages"], expected.to(generation["advantages"].dtype))
    if estimator == "prompt_history":
        assert len(trainer.history) == 8 and trainer.history.state_dict() == history.state_dict()
        assert json.loads((tmp_path / "checkpoint-5" / HISTORY_FILE).read_text()) == history.state_dict()
        seen_again = trainer.generations[2]["keys"]
        assert set(seen_again) <= set(trainer.generations[0]["keys"] + trainer.generations[1]["keys"])
    steps = logged_steps(trainer)
    assert all(math.isfinite(step["loss"]) for step in steps) and "hadw/advantage_abs_mean" in steps[0]


def _train_scoring(reward_function, model_dir, tmp_path, **options):
    trainer = RecordingTrainer(
        model=model_dir, reward_funcs=reward_function, train_dataset=PROMPTS, processing_class=TOKENIZER,
        args=HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "max_steps": 3, "hadw_anchor_rule": "soft",
                                                         **options}),
    )
    trainer.train()
    return trainer


def first_of_each_group_unscored(completions, **_):
    # TRL hands a process's completions grouped by prompt, 4 a prompt (RUN's num_generations).
    return [None if index % 4 == 0 else score for index, score in enumerate(sevens(completions))]


@pytest.mark.parametrize("estimator, use_hadw", [("grpo", True), ("rloo", False), ("james_stein", True),
                                                 ("prompt_history", False)])
def test_unscored_completions_enter_no_baseline_and_no_history(estimator, use_hadw, model_dir, tmp_path):
    """A completion no reward function scored (NaN) gets advantage 0, and the others' are
    those of the scored completions alone (grouped by their prompt): no value stands in for
    it in a leave-one-out mean, the batch's statistics or the prompt's history."""
    history_options = dict(hadw_history_discount=0.5) if estimator == "prompt_history" else {}
    trainer = _train_scoring(first_of_each_group_unscored, model_dir, tmp_path, use_hadw=use_hadw,
                             hadw_advantage_estimator=estimator, **history_options)
    history = PromptHistory(discount=0.5)
    for generation in trainer.generations:
        rewards = generation["rewards"]
        scored = ~torch.isnan(rewards)
        assert int(scored.sum()) == 12
        keys = [key for key, kept in zip(generation["keys"], scored.tolist()) if kept]
        prior = history.update(rewards[scored], keys) if estimator == "prompt_history" else None
        groups = torch.arange(16)[scored] // 4
        advantages = generation["advantages"]
        assert advantages[~scored].tolist() == [0.0] * 4
        if estimator == "grpo":  # TRL's own advantages, each times the Phi of the scored rewards
            phi = hadw_weights(rewards[scored], 3, generation["belief"])
            grouped = rewards[scored].view(-1, 3)
            trl = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
            torch.testing.assert_close(advantages[scored], trl * phi)
        else:
            expected = hadw_advantages(rewards[scored], group_index=groups, estimator=estimator,
                                       anchor=generation["belief"], prior=prior)
            torch.testing.assert_close(advantages[scored], expected.to(advantages.dtype))
    if estimator == "prompt_history":
        assert trainer.history.state_dict() == history.state_dict()


def prompt_0_unscored(prompts, completions, **_):
    return [None if prompt == "0 1" else score for prompt, score in zip(prompts, sevens(completions))]


@pytest.mark.parametrize("use_hadw", [True, False])
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "james_stein", "prompt_history"])
def test_a_wholly_unscored_group_gets_advantage_0_as_in_stock_trl(estimator, use_hadw, model_dir, tmp_path):
    trainer = _train_scoring(prompt_0_unscored, model_dir, tmp_path, use_hadw=use_hadw,
                             hadw_advantage_estimator=estimator)
    unscored = [generation for generation in trainer.generations if bool(torch.isnan(generation["rewards"]).any())]
    assert unscored, "no generation batch held the unscored prompt"
    for generation in trainer.generations:
        advantages, rewards = generation["advantages"], generation["rewards"]
        assert bool(torch.isfinite(advantages).all())
        assert bool((advantages[torch.isnan(rewards)] == 0).all())
    assert all(math.isfinite(step["loss"]) for step in logged_steps(trainer))
    if estimator == "prompt_history":
        unscored_keys = {key for generation in unscored
                         for key, reward in zip(generation["keys"], generation["rewards"].tolist()) if math.isnan(reward)}
        assert not unscored_keys & {row[0] for row in trainer.history.state_dict()["prompts"]}


class ResumeProbe(HADWGRPOTrainer):
    """Keeps the anchor's state as TRL's resume leaves it, before any new batch."""

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        self.anchor_at_resume = self.anchor.state_dict()


def test_anchor_survives_save_and_resume(model_dir, tmp_path):
    # The soft rule: its next prior is exactly the saved posterior (the kalman rule's is
    # the bank's prediction).
    first = train(HADWGRPOTrainer, HADWGRPOConfig, model_dir, tmp_path, max_steps=2, save_strategy="steps",
                  save_steps=2, hadw_anchor_rule="soft")
    saved = first.anchor.state_dict()
    assert saved["step"] == 1
    assert json.loads((tmp_path / "checkpoint-2" / ANCHOR_FILE).read_text()) == saved

    resumed = ResumeProbe(
        model=model_dir, reward_funcs=sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
        args=HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "max_steps": 3, "hadw_anchor_rule": "soft"}),
    )
    assert resumed.anchor.step == 0
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.anchor_at_resume == saved
    # Step 3 generates a new batch: the belief moves on from the saved one.
    assert resumed.anchor.step == saved["step"] + 1
    assert resumed.anchor.prior == saved["posterior"]


def test_resuming_a_checkpoint_without_the_history_says_it_starts_afresh(model_dir, tmp_path):
    train(HADWGRPOTrainer, HADWGRPOConfig, model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=2,
          hadw_anchor_rule="soft")
    assert not (tmp_path / "checkpoint-2" / HISTORY_FILE).exists()
    resumed = HADWGRPOTrainer(
        model=model_dir, reward_funcs=sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
        args=HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "max_steps": 3, "hadw_anchor_rule": "soft",
                                                         "hadw_advantage_estimator": "prompt_history"}),
    )
    with pytest.warns(UserWarning, match=f"which holds no {HISTORY_FILE}: it starts afresh"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_rewards_outside_the_unit_interval_are_refused(model_dir, tmp_path):
    def plus_minus_one(completions, **_):
        return [2.0 * score - 1.0 for score in sevens(completions)]

    trainer = HADWGRPOTrainer(
        model=model_dir, reward_funcs=plus_minus_one, train_dataset=PROMPTS, processing_class=TOKENIZER,
        args=HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "max_steps": 1}),
    )
    with pytest.raises(ValueError, match=r"accuracies in \[0, 1\].*reward_weights that sum to 1"):
        trainer.train()


def test_the_history_s_need_for_unit_rewards_is_named_without_hadw(model_dir, tmp_path):
    def plus_minus_one(completions, **_):
        return [2.0 * score - 1.0 for score in sevens(completions)]

    trainer = HADWGRPOTrainer(
        model=model_dir, reward_funcs=plus_minus_one, train_dataset=PROMPTS, processing_class=TOKENIZER,
        args=HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "max_steps": 1, "use_hadw": False,
                                                         "hadw_advantage_estimator": "prompt_history"}),
    )
    with pytest.raises(ValueError, match=r"^hadw_advantage_estimator='prompt_history' \(its Beta posterior\) reads "
                                         r"rewards as accuracies in \[0, 1\]") as error:
        trainer.train()
    assert "HA-DW" not in str(error.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # A cap of 0 or below leaves no policy gradient at all.
        (dict(loss_type="cispo", epsilon_high=0.0), r"epsilon_high=0.0 .* trains nothing"),
        # Below 1 the old and vLLM's log-probs are shifted, which the off-policy mask would read.
        (dict(loss_type="cispo", off_policy_mask_threshold=0.1, use_vllm=True),
         r"epsilon_high=0.2 below 1, off_policy_mask_threshold and vllm_importance_sampling_correction"),
        (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be a finite positive number"),
        (dict(loss_type="vespo", vespo_k_pos=-1.0), "vespo_k_pos must be finite and non-negative"),
        (dict(loss_type="dapo", entropy_coef=0.01), "entropy_coef != 0 or use_adaptive_entropy"),
        (dict(loss_type="dapo", use_adaptive_entropy=True), "entropy_coef != 0 or use_adaptive_entropy"),
        (dict(loss_type="dapo", multi_objective_aggregation="normalize_then_sum"), "sum_then_normalize"),
    ],
)
def test_options_the_fused_loss_lacks_are_refused(options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, **options})


def test_cispo_at_trl_s_default_epsilon_high_is_taken_with_a_warning(tmp_path):
    """Stock TRL runs CISPO with epsilon_high left at epsilon (0.2), which caps every weight
    at 0.2; the drop-in takes what its host takes (the equality with stock TRL is
    test_without_hadw_the_integration_is_trl's "cispo+default_cap" runs) and says what it
    means, naming TRL's recommended cap."""
    with pytest.warns(UserWarning, match=r"epsilon_high=0.2 caps every weight .* epsilon_high=5.0"):
        HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "loss_type": "cispo"})


def test_trl_s_default_bf16_trains_on_the_cpu(model_dir, tmp_path):
    """docs/integrations/trl.md said TRL's bf16=True default fails on a CPU: with use_cpu
    it trains (under CPU autocast); without use_cpu TRL refuses it on a machine without a
    GPU, which is what the example's comment now says."""
    trainer = train(HADWGRPOTrainer, HADWGRPOConfig, model_dir, tmp_path, max_steps=1, bf16=None)  # TRL's default
    assert trainer.args.bf16 is True and trainer.args.use_cpu is True
    assert math.isfinite(logged_steps(trainer)[0]["loss"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(hadw_lambda_scale=-1.0), "hadw_lambda_scale must be a finite positive number"),
        (dict(hadw_lambda_scale=0.0), "hadw_lambda_scale must be a finite positive number"),
        (dict(hadw_lambda_scale="1.3"), "hadw_lambda_scale must be a finite positive number"),
        (dict(hadw_backend="cuda-fast"), "unknown hadw_backend 'cuda-fast'"),
        (dict(hadw_block_rows=0), "hadw_block_rows must be a positive int"),
        (dict(hadw_linear_path="fast"), "unknown hadw_linear_path 'fast'"),
        (dict(hadw_anchor_rule="median"), "hadw_anchor_\\*: unknown rule 'median'"),
        (dict(hadw_anchor_initial=1.5), "hadw_anchor_\\*: initial must lie in"),
        (dict(hadw_advantage_estimator="median"), "^hadw_advantage_estimator must be one of"),
        (dict(hadw_history_discount=1.5), "hadw_history_discount must be in"),
        (dict(hadw_history_prior_strength=0.0), "hadw_history_prior_strength must be"),
        # A history option with an estimator that reads no history.
        (dict(hadw_history_discount=0.5), "^hadw_history_discount is read by hadw_advantage_estimator='prompt_history' "
                                          "alone, not 'grpo'"),
        (dict(hadw_advantage_estimator="rloo", hadw_history_prior_strength=4.0),
         "^hadw_history_prior_strength is read by hadw_advantage_estimator='prompt_history' alone, not 'rloo'"),
        (dict(hadw_advantage_estimator="rloo", use_hadw=False, multi_objective_aggregation="normalize_then_sum"),
         "needs multi_objective_aggregation='sum_then_normalize'"),
        # What the first step would otherwise raise, after generating.
        (dict(hadw_linear_path="gradients_in_forward", top_entropy_quantile=0.5),
         "hadw_linear_path='gradients_in_forward' forms each token's gradient before"),
        (dict(hadw_linear_path="gradients_in_forward", off_policy_mask_threshold=0.1),
         "hadw_linear_path='gradients_in_forward' forms each token's gradient before"),
        (dict(hadw_linear_path="gradients_in_forward", beta=0.05, use_bias_correction_kl=True),
         "hadw_linear_path='gradients_in_forward' forms each token's gradient before"),
        (dict(hadw_linear_path="gradients_in_forward", importance_sampling_level="sequence"),
         "hadw_linear_path='gradients_in_forward' needs a token ratio"),
        (dict(loss_type="gspo"), "TRL's GSPO is loss_type='grpo' with importance_sampling_level='sequence'"),
        (dict(loss_type="vespo", beta=0.05, use_bias_correction_kl=True, use_vllm=True),
         "'vespo' with vllm_importance_sampling_correction and use_bias_correction_kl"),
    ],
)
def test_bad_hadw_fields_are_refused_when_the_config_is_built(options, message, tmp_path):
    # Checked in __post_init__ with the library's own checks, not at the first loss.
    with pytest.raises(ValueError, match=message):
        HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "loss_type": "dapo", **options})


def test_a_backend_that_cannot_serve_the_device_is_refused_when_the_trainer_is_built(model_dir, tmp_path,
                                                                                    monkeypatch):
    """hadw_backend='triton' on the CPU without Triton's interpreter: refused when the
    trainer is built, not at the first loss after a generation."""
    import hadw_kernels.integrations.trl as integration
    from hadw_kernels.ops import BackendUnavailable

    def unavailable(name, device):
        raise BackendUnavailable(f"backend {name!r} cannot serve {device}: its kernels run on CUDA")

    monkeypatch.setattr(integration, "resolve_backend", unavailable)
    with pytest.raises(ValueError, match=r"hadw_backend='triton': backend 'triton' cannot serve cpu"):
        HADWGRPOTrainer(model=model_dir, reward_funcs=sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
                        args=HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "hadw_backend": "triton"}))


def test_the_default_anchor_rule_is_the_library_s(tmp_path):
    assert HADWGRPOConfig(output_dir=str(tmp_path), **RUN).anchor().rule == DEFAULT_RULE


def test_every_anchor_rule_builds(tmp_path):
    for rule in ("soft", "hard", "kalman"):
        assert HADWGRPOConfig(output_dir=str(tmp_path), **RUN, hadw_anchor_rule=rule).anchor().rule == rule


@pytest.mark.parametrize("delta", [1.28, 2.0, 3.0])
def test_trl_delta_is_the_dual_clip(delta):
    """TRL's delta caps the unclipped ratio (loss -min(min(r, delta) A, clip(r) A));
    from delta >= 1 + epsilon_high on it is the dual clip c = delta: same loss, same
    gradient, for ratios from 0.05 to 20 and both signs of A."""
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 6, generator=generator, dtype=torch.float64)
    log_ratio = torch.empty(64, 6, dtype=torch.float64).uniform_(-3.0, 3.0, generator=generator)
    advantages = torch.randn(64, generator=generator, dtype=torch.float64)
    mask = torch.ones(64, 6, dtype=torch.bool)
    results = []
    for dual_clip in (None, delta):
        logprobs = (old + log_ratio).requires_grad_()
        if dual_clip is None:
            ratio = torch.exp(logprobs - old)
            capped = torch.clamp(ratio, max=delta) * advantages[:, None]
            clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * advantages[:, None]
            loss = -torch.min(capped, clipped).mean()
        else:
            loss = fused_hadw_grpo_loss(logprobs, old, None, mask, advantages=advantages, loss_type="dapo",
                                        dual_clip=dual_clip)
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_vllm_s_log_probs_reach_the_loss_as_trl_corrects_them(mode):
    """With vLLM, the trainer hands the loss vLLM's log-probs and TRL's mode and bounds (a
    token vLLM did not score, NaN, weighs 1); the loss then equals TRL's given the ratio
    TRL forms (tests/trl_host.py), here through the log-prob loss on the same tensors."""
    from trl_host import TrlLoss, trl_config, trl_importance_ratio

    generator = torch.Generator().manual_seed(0)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 0])[:, None]
    old = -2 * torch.rand(4, 6, generator=generator, dtype=torch.float64) - 0.1
    sampling = (old + 0.2 * torch.randn(4, 6, generator=generator, dtype=torch.float64)).clamp(max=0.0)
    sampling[0, 3] = math.nan
    logprobs = (old + 0.2 * torch.randn(4, 6, generator=generator, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(4, generator=generator, dtype=torch.float64)
    args = trl_config("grpo", vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.9,
                      vllm_importance_sampling_clip_max=1.2)
    trainer = types.SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.2, loss_type="grpo",
        off_policy_mask_threshold=None)
    inputs = {"old_per_token_logps": old, "sampling_per_token_logps": sampling}
    old_logprobs, behaviour = HADWGRPOTrainer._behaviour(trainer, inputs)
    got = fused_hadw_grpo_loss(logprobs, old_logprobs, None, mask, advantages=advantages, **behaviour)
    (got_grad,) = torch.autograd.grad(got, logprobs)
    ratio = trl_importance_ratio(mode, old, sampling, mask, 0.9, 1.2)
    expected = TrlLoss(args)(logprobs, old, advantages, mask, importance_sampling_ratio=ratio)
    (expected_grad,) = torch.autograd.grad(expected, logprobs)
    torch.testing.assert_close((got, got_grad), (expected, expected_grad), rtol=1e-10, atol=1e-12)


def test_under_zero3_the_options_that_read_the_policy_first_are_refused(model_dir, tmp_path, monkeypatch):
    """Under ZeRO-3 the loss forms its gradients in the forward; TRL's default
    use_bias_correction_kl (with beta) reads the batch's log-probs first: a clear error
    naming it, not the linear path's own."""
    import hadw_kernels.integrations.trl as integration

    monkeypatch.setattr(integration, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match=r"ZeRO-3 .* use_bias_correction_kl"):
        train(HADWGRPOTrainer, HADWGRPOConfig, model_dir, tmp_path, loss_type="grpo", beta=0.05,
              use_bias_correction_kl=True, max_steps=1)


def test_the_entropy_mask_reads_the_entropies_in_float32_as_trl(tmp_path):
    """TRL's trainer forms its entropies in float32 whatever the model's dtype (its fused LM
    head accumulates in float32) and masks by their float32 quantile; the drop-in's loss
    forms them in the head's dtype and reads them in float32 for the mask
    (test_rollout_correction.py, test_trl_entropy_mask_reads_the_entropies_in_float32)."""
    args = HADWGRPOConfig(output_dir=str(tmp_path), **{**RUN, "loss_type": "grpo", "top_entropy_quantile": 0.2})
    trainer = types.SimpleNamespace(
        args=args, loss_type=args.loss_type, current_gradient_accumulation_steps=1, off_policy_mask_threshold=None,
        top_entropy_quantile=args.top_entropy_quantile, max_completion_length=args.max_completion_length)
    options = HADWGRPOTrainer._loss_options(trainer, {}, torch.ones(2, 3, dtype=torch.bool), "train")
    assert options["top_entropy_quantile"] == 0.2 and options["entropy_mask_dtype"] == "float32"
