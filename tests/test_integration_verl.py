"""hadw_kernels.integrations.verl through verl 0.9.1's own registries, on CPU tensors:
the registered losses equal verl's twelve policy losses but bypass_mode (loss, gradient
and metrics, at verl's own aggregation; clip_cov's random draw under the same generator
state),
the estimator equals verl's GRPO advantage with HA-DW off and trains with each of verl's
losses (and their fused versions) through verl's actor loss, and the anchor round-trips
through verl's checkpoint folder and its checkpoint-callback hook."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="the verl extra is not installed")
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from hadw_kernels import DifficultyAnchor, hadw_advantages  # noqa: E402
from hadw_kernels.advantage.anchor import DEFAULT_RULE  # noqa: E402
from hadw_kernels.integrations import verl as hadw_verl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
# What verl's workers put in global_batch_info: none (one process), or a rank of two
# data-parallel ranks with the global counts and a constant Dr.GRPO length.
BATCH_INFOS = {
    "local": {},
    "global": {"dp_size": 2, "batch_num_tokens": 41, "global_batch_size": 14, "loss_scale_factor": 16},
}


# The policy_loss options of verl's dro, clip_cov and kl_cov, their shares of tokens wide
# enough that the small batches select several.
POLICY_LOSS_OPTIONS = dict(dro_beta=0.3, clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=3.0, kl_cov_ratio=0.15,
                           ppo_kl_coef=0.7)


@pytest.fixture(autouse=True)
def _fresh_driver_anchor():
    hadw_verl.reset_driver_anchor()
    yield
    hadw_verl.reset_driver_anchor()


def actor_config(batch_info: dict, loss_mode: str = "vanilla", loss_agg_mode: str = "token-mean",
                 clip_ratio_low: float = 0.2) -> ActorConfig:
    config = ActorConfig(
        strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2, clip_ratio_low=clip_ratio_low,
        clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.2, tau_neg=1.6, loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **POLICY_LOSS_OPTIONS),
    )
    config.global_batch_info.update(batch_info)
    return config


def policy_batch(with_is_weights: bool, per_token_advantages: bool = False, empty_response: bool = True):
    """fp64 [B, T] tensors with padding, an empty response, ratios wide enough to hit both
    clips and the dual clip, one advantage per response broadcast over its tokens (an
    outcome estimator's) or one per token (gae's), and rollout weights per token."""
    generator = torch.Generator().manual_seed(3)
    batch, width = 7, 9
    lengths = torch.tensor([9, 1, 5, 0 if empty_response else 2, 7, 3, 8])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    old = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3
    logprob = (old + 0.8 * torch.randn(batch, width, generator=generator, dtype=torch.float64)).requires_grad_()
    if per_token_advantages:
        advantages = torch.randn(batch, width, generator=generator, dtype=torch.float64) * mask
    else:
        advantages = torch.randn(batch, generator=generator, dtype=torch.float64)[:, None] * mask
    weights = torch.rand(batch, width, generator=generator, dtype=torch.float64) + 0.5 if with_is_weights else None
    return old, logprob, advantages, mask, weights


def run_loss(function, old, logprob, advantages, mask, mode, config, weights):
    logprob.grad = None
    torch.manual_seed(5)  # clip_cov draws from the global generator, in verl and here
    loss, metrics = function(old, logprob, advantages, mask, loss_agg_mode=mode, config=config,
                             rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), logprob.grad.clone(), metrics


def test_registries_return_the_integration():
    for name, function in hadw_verl.POLICY_LOSS_FUNCTIONS.items():
        assert core_algos.get_policy_loss_fn(name) is function
    assert core_algos.get_policy_loss_fn("hadw") is core_algos.get_policy_loss_fn("hadw_vanilla")
    assert {loss.loss_mode for loss in hadw_verl.VERL_POLICY_LOSSES.values()} == set(VERL_LOSSES)
    assert core_algos.get_adv_estimator_fn("hadw") is hadw_verl.compute_hadw_outcome_advantage
    for name, function in hadw_verl.ESTIMATOR_FUNCTIONS.items():
        assert core_algos.get_adv_estimator_fn(name) is function
    assert sorted(hadw_verl.ADVANTAGE_ESTIMATORS) == ["hadw", "hadw_james_stein", "hadw_rloo"]


# verl's losses the integration fuses, each under hadw_<name>.
VERL_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov")


def assert_same_loss(got, expected):
    # verl's seq-mean-token-mean divides by (tokens + 1e-8): a relative 1e-9 here.
    torch.testing.assert_close(got[0], expected[0], rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-8, atol=1e-12)
    # Every metric verl reports, and no other (its gpg reports none).
    assert got[2].keys() == expected[2].keys()
    for name, value in expected[2].items():
        assert got[2][name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


# Every loss at every mode the actor may pass, as verl computes it: sapo and geo_mean
# ignore the mode (and geo_mean the global counts), as verl's functions do.
@pytest.mark.parametrize("batch_info", BATCH_INFOS, ids=str)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("theirs", VERL_LOSSES)
@pytest.mark.parametrize(("with_is_weights", "per_token_advantages"), [(False, False), (True, True)],
                         ids=["A[B]", "A[B,T]+rollout-is"])
def test_policy_loss_equals_verl(theirs, mode, batch_info, with_is_weights, per_token_advantages):
    old, logprob, advantages, mask, weights = policy_batch(with_is_weights, per_token_advantages)
    config = actor_config(BATCH_INFOS[batch_info])
    expected = run_loss(core_algos.get_policy_loss_fn(theirs), old, logprob, advantages, mask, mode, config, weights)
    got = run_loss(core_algos.get_policy_loss_fn(f"hadw_{theirs}"), old, logprob, advantages, mask, mode, config,
                   weights)
    assert_same_loss(got, expected)
    # The batch reaches the metrics' cases: clipped tokens wherever verl counts them.
    if theirs in ("vanilla", "gspo", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "clip_cov"):
        assert expected[2]["actor/pg_clipfrac"] > 0
    if theirs in ("vanilla", "geo_mean", "dppo_tv", "dppo_kl"):
        assert 0 < expected[2]["actor/pg_clipfrac_lower"]


@pytest.mark.parametrize("clip_ratio_low", [1.0, 10.0])
@pytest.mark.parametrize("theirs", VERL_LOSSES)
def test_policy_loss_equals_verl_without_a_lower_clip(theirs, clip_ratio_low):
    """verl takes clip_ratio_low >= 1 (its CISPO's lower bound 1 - 10 clips nothing; DPPO's
    is a probability or KL threshold, GMPO's a log-ratio bound) and every loss computes
    with it: so do the drop-ins, which refused it ("epsilon_low must be below 1")."""
    old, logprob, advantages, mask, weights = policy_batch(True, True)
    config = actor_config({}, clip_ratio_low=clip_ratio_low)
    expected = run_loss(core_algos.get_policy_loss_fn(theirs), old, logprob, advantages, mask, "token-mean", config,
                        weights)
    got = run_loss(core_algos.get_policy_loss_fn(f"hadw_{theirs}"), old, logprob, advantages, mask, "token-mean",
                   config, weights)
    assert_same_loss(got, expected)


@pytest.mark.parametrize("theirs", ["clip_cov", "kl_cov"])
def test_clip_cov_and_kl_cov_differ_from_verl_past_the_ratio_clamp_as_documented(theirs):
    """verl's clip_cov and kl_cov exponentiate the log-ratio unclamped, the library clamps
    it at 20: equal below, different past it, and the docs say so among the deliberate
    differences (verl.md once said a swap changed nothing a run records): math.md's list
    of where the hosts differ, to which verl.md's points."""
    old, logprob, advantages, mask, weights = policy_batch(False, True)
    config = actor_config({})
    for shift, same in ((0.0, True), (25.0, False)):
        moved = (logprob.detach() + shift * mask).requires_grad_()
        expected = run_loss(core_algos.get_policy_loss_fn(theirs), old, moved, advantages, mask, "token-mean",
                            config, None)
        got = run_loss(core_algos.get_policy_loss_fn(f"hadw_{theirs}"), old, moved, advantages, mask, "token-mean",
                       config, None)
        assert torch.allclose(got[0], expected[0]) == same, (shift, got[0], expected[0])
    differences = (ROOT / "docs" / "math.md").read_text().split("### Where the hosts differ")[1].split("\n## ")[0]
    assert "verl's clip_cov, kl_cov and dro do not clamp" in differences and "unclamped" in differences
    verl_s = (ROOT / "docs" / "integrations" / "verl.md").read_text().split(
        "## Where it differs from verl, on purpose")[1].split("\n## ")[0]
    assert "clip_cov, kl_cov" in verl_s and "(../math.md#where-the-hosts-differ)" in verl_s


def _cispo_case(function, with_is_weights: bool):
    """verl's own CPU cases of CISPO, with no lower clip (clip_ratio_low=10): three
    tokens whose ratios are above, below and (masked) above the range."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                         clip_ratio_low=10.0, clip_ratio_high=0.2, policy_loss=PolicyLossConfig(loss_mode="cispo"))
    old = torch.tensor([[-2.0, -2.0, -2.0]])
    logprob = torch.tensor([[-1.5, -3.0, -1.0]], requires_grad=True)
    advantages = torch.tensor([[2.0, -3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = torch.tensor([[0.5, 2.0, 1.0]]) if with_is_weights else None
    loss, metrics = function(old, logprob, advantages, mask, loss_agg_mode="token-mean", config=config,
                             rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), logprob.grad, metrics, logprob.detach(), advantages, mask, weights


@pytest.mark.parametrize("with_is_weights", [False, True])
@pytest.mark.parametrize("name", ["cispo", "hadw_cispo"])
def test_cispo_without_a_lower_clip_as_verl_s_own_cases(name, with_is_weights):
    """The below-range ratio e^-1 keeps its value (no lower floor), the others are capped
    at 1 + 0.2, and the gradient flows through the log-prob; half the counted tokens
    clipped."""
    loss, grad, metrics, logprob, advantages, mask, weights = _cispo_case(core_algos.get_policy_loss_fn(name),
                                                                          with_is_weights)
    clipped_ratio = torch.tensor([[1.2, math.exp(-1.0), 1.2]])
    weight = clipped_ratio * (1.0 if weights is None else weights)
    torch.testing.assert_close(loss, (-weight * advantages * logprob * mask).sum() / mask.sum())
    torch.testing.assert_close(grad, -weight * advantages * mask / mask.sum())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


@pytest.mark.parametrize("batch_info", BATCH_INFOS, ids=str)
@pytest.mark.parametrize(("with_is_weights", "per_token_advantages"), [(False, False), (True, True)],
                         ids=["A[B]", "A[B,T]+rollout-is"])
def test_sapo_by_agg_mode_follows_the_actor_s_mode(batch_info, with_is_weights, per_token_advantages):
    """verl's sapo aggregates seq-mean-token-mean whatever loss_agg_mode says;
    hadw_sapo_by_agg_mode follows loss_agg_mode, so it is verl's at that mode and differs
    at token-mean (verl's default actor mode)."""
    old, logprob, advantages, mask, weights = policy_batch(with_is_weights, per_token_advantages)
    config = actor_config(BATCH_INFOS[batch_info])
    mode = "seq-mean-token-mean"
    expected = run_loss(core_algos.get_policy_loss_fn("sapo"), old, logprob, advantages, mask, mode, config, weights)
    by_mode = core_algos.get_policy_loss_fn("hadw_sapo_by_agg_mode")
    assert_same_loss(run_loss(by_mode, old, logprob, advantages, mask, mode, config, weights), expected)
    token_mean = run_loss(by_mode, old, logprob, advantages, mask, "token-mean", config, weights)
    assert not torch.allclose(token_mean[0], expected[0], rtol=1e-3)
    theirs_token_mean = run_loss(core_algos.get_policy_loss_fn("sapo"), old, logprob, advantages, mask, "token-mean",
                                 config, weights)
    torch.testing.assert_close(theirs_token_mean[0], expected[0], rtol=0, atol=0)


@pytest.mark.parametrize(("with_is_weights", "per_token_advantages"), [(False, False), (True, True)],
                         ids=["A[B]", "A[B,T]+rollout-is"])
def test_geo_mean_by_agg_mode_follows_the_actor_s_mode_and_counts(with_is_weights, per_token_advantages):
    """verl's geo_mean is the mean over the micro-batch's rows whatever loss_agg_mode and
    global_batch_info say; hadw_geo_mean_by_agg_mode aggregates as verl's other losses:
    verl's geo_mean at seq-mean-token-mean in one process where no response is empty
    (agg_loss leaves empty responses out of the count, geo_mean's mean does not), a rank's
    share of the global count otherwise."""
    old, logprob, advantages, mask, weights = policy_batch(with_is_weights, per_token_advantages,
                                                           empty_response=False)
    mode = "seq-mean-token-mean"
    by_mode = core_algos.get_policy_loss_fn("hadw_geo_mean_by_agg_mode")
    expected = run_loss(core_algos.get_policy_loss_fn("geo_mean"), old, logprob, advantages, mask, mode,
                        actor_config({}), weights)
    assert_same_loss(run_loss(by_mode, old, logprob, advantages, mask, mode, actor_config({}), weights), expected)
    rank_share = run_loss(by_mode, old, logprob, advantages, mask, mode, actor_config(BATCH_INFOS["global"]), weights)
    scale = mask.shape[0] / (BATCH_INFOS["global"]["global_batch_size"] / BATCH_INFOS["global"]["dp_size"])
    torch.testing.assert_close(rank_share[0], expected[0] * scale, rtol=1e-8, atol=1e-12)


def test_a_plain_mapping_config_takes_verl_s_actor_defaults():
    """verl's vanilla reads clip_ratio_c with a default of 3.0 and sapo tau_pos/tau_neg
    from ActorConfig's defaults; a config given as a plain mapping gets the same."""
    old, logprob, advantages, mask, _ = policy_batch(False)
    full = actor_config({})
    for theirs, absent in (("vanilla", ("clip_ratio_c",)), ("sapo", ("tau_pos", "tau_neg"))):
        defaults = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                               clip_ratio_low=0.2, clip_ratio_high=0.28)
        expected = run_loss(core_algos.get_policy_loss_fn(theirs), old, logprob, advantages, mask, "token-mean",
                            defaults, None)
        plain = {key: full.get(key) for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")}
        assert not set(absent) & set(plain)
        got = run_loss(hadw_verl.POLICY_LOSS_FUNCTIONS[f"hadw_{theirs}"], old, logprob, advantages, mask,
                       "token-mean", plain, None)
        assert_same_loss(got, expected)


def test_dppo_reads_verl_s_own_truncation_default_where_the_key_is_absent():
    """verl's dppo reads clip_ratio_c with a default of 20 (ActorConfig's is 3): a config
    without the key (an OmegaConf mapping, as verl's own would be) gets 20 here too."""
    old, logprob, advantages, mask, _ = policy_batch(False)
    logprob = (old + 3.0 * (logprob.detach() - old)).requires_grad_()  # ratios past 3
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                               "global_batch_info": {}})
    for theirs in ("dppo_tv", "dppo_kl"):
        expected = run_loss(core_algos.get_policy_loss_fn(theirs), old, logprob, advantages, mask, "token-mean",
                            config, None)
        got = run_loss(hadw_verl.POLICY_LOSS_FUNCTIONS[f"hadw_{theirs}"], old, logprob, advantages, mask,
                       "token-mean", config, None)
        assert_same_loss(got, expected)
        capped_at_3 = run_loss(core_algos.get_policy_loss_fn(theirs), old, logprob, advantages, mask, "token-mean",
                               OmegaConf.merge(config, {"clip_ratio_c": 3.0}), None)
        assert not torch.allclose(capped_at_3[1], expected[1])


def test_policy_loss_needs_global_counts_under_data_parallelism():
    old, logprob, advantages, mask, _ = policy_batch(False)
    with pytest.raises(ValueError, match="global_batch_size"):
        hadw_verl.POLICY_LOSS_FUNCTIONS["hadw_vanilla"](old, logprob, advantages, mask,
                                                        loss_agg_mode="seq-mean-token-mean",
                                                        config=actor_config({"dp_size": 2}))


def outcome_batch(seed: int, groups: int = 5, group_size: int = 4):
    """Binary rewards on each response's last valid token, rows shuffled, string uids."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = groups * group_size, 6
    order = torch.randperm(batch, generator=generator)
    uids = np.array([f"prompt-{i // group_size}" for i in range(batch)], dtype=object)[order.numpy()]
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.bernoulli(torch.full((batch,), 0.4), generator=generator)
    token_level_rewards = torch.zeros(batch, width).scatter(1, (lengths - 1)[:, None], rewards[:, None])
    return token_level_rewards, mask, uids, rewards


class BigramLM(torch.nn.Module):
    """A language model small enough for a test: each next token's log-probs from the
    current token's embedding."""

    def __init__(self, vocab: int = 12, hidden: int = 8):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.embedding = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) / 3)

    def sequence_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """The log-prob of each token given the one before it, aligned as verl's models
        output them: position j holds token j + 1's (the last position, 0, is unread)."""
        logprobs = (self.embedding[tokens[:-1]] @ self.head.T).log_softmax(-1)
        return torch.cat([logprobs.gather(1, tokens[1:, None]).squeeze(1), logprobs.new_zeros(1)])


def rollout(model: BigramLM):
    """A rollout batch as verl's trainer hands it to the actor: 3 prompts x 4 responses,
    rows shuffled, left-padded prompts and right-padded responses, a binary reward on each
    response's last token, uids; old log-probs from a stale behaviour policy (the model's
    plus noise), so ratios leave 1 and the clips act."""
    generator = torch.Generator().manual_seed(8)
    prompts_n, group, prompt_width, width = 3, 4, 3, 6
    batch = prompts_n * group
    order = torch.randperm(batch, generator=generator)
    uids = np.array([f"prompt-{i // group}" for i in range(batch)], dtype=object)[order.numpy()]
    prompts = torch.randint(1, 12, (prompts_n, prompt_width), generator=generator).repeat_interleave(group, 0)[order]
    prompt_mask = torch.ones(batch, prompt_width, dtype=torch.long)
    prompt_mask[order >= 2 * group, 0] = 0  # the third prompt is one token shorter: left padding
    responses = torch.randint(1, 12, (batch, width), generator=generator)
    lengths = torch.randint(2, width + 1, (batch,), generator=generator)
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1], dtype=torch.float64)[order]
    token_level_rewards = torch.zeros(batch, width, dtype=torch.float64).scatter(1, (lengths - 1)[:, None],
                                                                                   rewards[:, None])
    data = dict(prompts=prompts, responses=responses, attention_mask=torch.cat([prompt_mask, response_mask], 1),
                response_mask=response_mask)
    with torch.no_grad():
        current = response_logprobs(model, data)
    data["old_log_probs"] = (current + 0.3 * torch.randn(current.shape, generator=generator,
                                                         dtype=torch.float64)) * response_mask
    return data, token_level_rewards, uids


def flat_sequence_logprobs(model: BigramLM, data: dict) -> torch.Tensor:
    """The model's output over the batch's valid tokens, sequence after sequence, as verl's
    padding-free models give it to the actor's loss."""
    sequences = torch.cat([data["prompts"], data["responses"]], 1)
    valid = data["attention_mask"].bool()
    return torch.cat([model.sequence_logprobs(sequence[keep]) for sequence, keep in zip(sequences, valid)])


def response_logprobs(model: BigramLM, data: dict) -> torch.Tensor:
    flat = flat_sequence_logprobs(model, data)
    return no_padding_2_padding(flat, TensorDict(dict(data), batch_size=len(data["prompts"])))


def actor_update(loss_mode: str, data: dict, advantages: torch.Tensor, micro_batches: int = 2) -> dict:
    """One verl actor update from a fresh model: per micro-batch, verl's actor loss
    (``workers.utils.losses.ppo_loss``, which calls the policy loss registered under
    ``loss_mode``) with the global counts verl's engine assigns, then one SGD step."""
    model = BigramLM()
    torch.manual_seed(6)  # clip_cov's draws, the same for verl's loss and its fused version
    config = actor_config({}, loss_mode, loss_agg_mode="seq-mean-token-mean")
    rows = len(data["prompts"])
    batch = TensorDict({**data, "advantages": advantages}, batch_size=rows)
    for micro in batch.split(rows // micro_batches):
        tu.assign_non_tensor(micro, dp_size=1, batch_num_tokens=int(data["response_mask"].sum()),
                             global_batch_size=rows)
        loss, _ = ppo_loss(config, {"log_probs": flat_sequence_logprobs(model, micro)}, micro)
        loss.backward()
    with torch.no_grad():
        return {name: parameter - 1.0 * parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("loss_mode", sorted({loss.loss_mode for loss in hadw_verl.VERL_POLICY_LOSSES.values()}))
def test_the_hadw_estimator_trains_with_each_verl_loss_and_its_fused_version(loss_mode):
    """A verl step: the hadw estimator over the rollout batch, called as verl's
    compute_advantage calls it, then one actor update through verl's actor loss
    (seq-mean-token-mean, two micro-batches) with verl's own loss and with its hadw_
    version, from the same model: the same parameters after the step."""
    data, token_level_rewards, uids = rollout(BigramLM())
    advantages, _ = core_algos.get_adv_estimator_fn("hadw")(
        token_level_rewards=token_level_rewards, response_mask=data["response_mask"],
        config=OmegaConf.create({"hadw": {"anchor": {"rule": "soft"}}}), index=uids,
    )
    assert hadw_verl._driver_anchor.step == 1 and advantages.abs().sum() > 0
    start = dict(BigramLM().named_parameters())
    theirs = actor_update(loss_mode, data, advantages)
    ours = actor_update(f"hadw_{loss_mode}", data, advantages)
    for name, parameter in start.items():
        their_step, our_step = theirs[name] - parameter, ours[name] - parameter
        assert their_step.abs().max() > 1e-3
        torch.testing.assert_close(their_step, our_step, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_estimator_without_hadw_equals_verl_grpo(normalize_std):
    token_level_rewards, mask, uids, _ = outcome_batch(seed=1)
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": normalize_std, "hadw": {"enable": False}})
    estimator = core_algos.get_adv_estimator_fn("hadw")
    advantages, returns = estimator(token_level_rewards=token_level_rewards, response_mask=mask, index=uids,
                                    config=config)
    expected, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards, mask, uids, norm_adv_by_std_in_grpo=normalize_std
    )
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(returns, advantages)
    assert hadw_verl._driver_anchor is None


@pytest.mark.parametrize("anchor", [{"rule": "soft", "window": 3}, {"rule": "kalman"}], ids=["soft", "kalman"])
def test_estimator_with_hadw_folds_each_step_into_the_anchor_once(anchor):
    config = OmegaConf.create({"hadw": {"lambda_scale": 1.5, "anchor": anchor}})
    reference = DifficultyAnchor(**anchor)
    for step in range(4):
        token_level_rewards, mask, uids, rewards = outcome_batch(seed=10 + step)
        advantages, _ = core_algos.get_adv_estimator_fn("hadw")(
            token_level_rewards=token_level_rewards, response_mask=mask, index=uids, config=config
        )
        belief = reference.update(rewards)
        group_index = torch.as_tensor(np.unique(uids, return_inverse=True)[1])
        expected = hadw_advantages(rewards, group_index=group_index, anchor=belief, lambda_scale=1.5)
        torch.testing.assert_close(advantages, expected[:, None] * mask)
    assert hadw_verl._driver_anchor.state_dict() == reference.state_dict()


def test_rloo_without_hadw_equals_verl_rloo():
    token_level_rewards, mask, uids, _ = outcome_batch(seed=2)
    config = OmegaConf.create({"hadw": {"enable": False}})
    advantages, _ = core_algos.get_adv_estimator_fn("hadw_rloo")(
        token_level_rewards=token_level_rewards, response_mask=mask, index=uids, config=config)
    expected, _ = core_algos.get_adv_estimator_fn("rloo")(
        token_level_rewards=token_level_rewards, response_mask=mask, index=uids, config=config)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)


def test_james_stein_with_hadw_is_the_library_s():
    config = OmegaConf.create({"hadw": {"anchor": {"rule": "soft"}}})
    token_level_rewards, mask, uids, rewards = outcome_batch(seed=3)
    advantages, _ = core_algos.get_adv_estimator_fn("hadw_james_stein")(
        token_level_rewards=token_level_rewards, response_mask=mask, index=uids, config=config)
    belief = DifficultyAnchor("soft").update(rewards)
    group_index = torch.as_tensor(np.unique(uids, return_inverse=True)[1])
    expected = hadw_advantages(rewards, group_index=group_index, anchor=belief, estimator="james_stein")
    torch.testing.assert_close(advantages, expected[:, None].to(advantages.dtype) * mask)


def test_an_anchor_changed_within_a_run_is_refused_naming_the_way_out():
    """The driver keeps one anchor per process; a second run there with other anchor
    options must call reset_driver_anchor() first, and the error says so."""
    estimator = core_algos.get_adv_estimator_fn("hadw")
    token_level_rewards, mask, uids, _ = outcome_batch(seed=4)
    batch = dict(token_level_rewards=token_level_rewards, response_mask=mask, index=uids)
    estimator(**batch, config=OmegaConf.create({"hadw": {"anchor": {"rule": "soft"}}}))
    other = OmegaConf.create({"hadw": {"anchor": {"rule": "hard"}}})
    way_out = r"changed within a run.*hadw_kernels\.integrations\.verl\.reset_driver_anchor\(\)"
    with pytest.raises(ValueError, match=way_out):
        estimator(**batch, config=other)
    hadw_verl.reset_driver_anchor()
    estimator(**batch, config=other)
    assert hadw_verl._driver_anchor.rule == "hard"


def test_the_default_anchor_is_the_library_s_default_rule():
    token_level_rewards, mask, uids, _ = outcome_batch(seed=5)
    core_algos.get_adv_estimator_fn("hadw")(token_level_rewards=token_level_rewards, response_mask=mask, index=uids,
                                            config=OmegaConf.create({}))
    assert hadw_verl._driver_anchor.rule == DEFAULT_RULE


def test_estimator_refuses_rewards_outside_the_unit_interval():
    token_level_rewards, mask, uids, _ = outcome_batch(seed=2)
    with pytest.raises(ValueError, match=r"rewards in \[0, 3\].*compute_score"):
        core_algos.get_adv_estimator_fn("hadw")(
            token_level_rewards=3 * token_level_rewards, response_mask=mask, index=uids,
            config=OmegaConf.create({}),
        )
    with pytest.raises(ValueError, match="unknown keys"):
        core_algos.get_adv_estimator_fn("hadw")(
            token_level_rewards=token_level_rewards, response_mask=mask, index=uids,
            config=OmegaConf.create({"hadw": {"lamda_scale": 1.0}}),
        )


@pytest.mark.parametrize(
    ("hadw", "message"),
    [
        ({"lambda_scale": -1.0}, "algorithm.hadw.lambda_scale must be a finite positive number"),
        ({"lambda_scale": 0}, "algorithm.hadw.lambda_scale must be a finite positive number"),
        # A quoted YAML value: refused with the key named, not a TypeError deep inside.
        ({"lambda_scale": "1.3"}, "algorithm.hadw.lambda_scale must be a number, got the string '1.3'"),
        ({"std_eps": "1e-6"}, "algorithm.hadw.std_eps must be a number"),
        ({"enable": "false"}, "algorithm.hadw.enable must be true or false"),
        ({"anchor": {"window": "10"}}, "algorithm.hadw.anchor.window must be a number"),
        ({"anchor": {"rule": "median"}}, "algorithm.hadw.anchor: unknown rule 'median'"),
        ({"anchor": {"eta": -1.0}}, "algorithm.hadw.anchor: eta must be"),
    ],
)
def test_estimator_refuses_bad_options_naming_the_key(hadw, message):
    token_level_rewards, mask, uids, _ = outcome_batch(seed=2)
    with pytest.raises(ValueError, match=message):
        core_algos.get_adv_estimator_fn("hadw")(
            token_level_rewards=token_level_rewards, response_mask=mask, index=uids,
            config=OmegaConf.create({"hadw": hadw}),
        )


@pytest.mark.parametrize("enable", [True, False])
def test_estimator_refuses_a_mask_of_another_shape(enable):
    # verl's GRPO estimator broadcasts a [B, 3] mask against [B, 5] rewards; this one refuses.
    rewards = torch.zeros(4, 5)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"token_level_rewards has shape \(4, 5\) and response_mask \(4, 3\)"):
        core_algos.get_adv_estimator_fn("hadw")(
            token_level_rewards=rewards, response_mask=torch.ones(4, 3), index=np.array(["a", "a", "b", "b"]),
            config=OmegaConf.create({"hadw": {"enable": enable}}),
        )


def trainer_config(checkpoints: Path, resume_mode: str = "auto") -> dict:
    return OmegaConf.create({
        "algorithm": {"adv_estimator": "hadw", "hadw": {"anchor": {"rule": "soft", "window": 2}}},
        "trainer": {"resume_mode": resume_mode, "default_local_dir": str(checkpoints), "resume_from_path": None},
    })


def test_anchor_round_trips_through_a_verl_checkpoint(tmp_path):
    config = trainer_config(tmp_path)
    callback = hadw_verl.HADWCheckpointCallback(config)  # nothing to resume from yet
    estimator = core_algos.get_adv_estimator_fn("hadw")
    for step in range(3):
        token_level_rewards, mask, uids, _ = outcome_batch(seed=20 + step)
        estimator(token_level_rewards=token_level_rewards, response_mask=mask, index=uids, config=config.algorithm)
    # What verl's trainer does at a save: its own files, the tracker, then the callback.
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    callback.on_save(trainer=None, global_step=3, checkpoint_dir=str(folder))
    saved = hadw_verl._driver_anchor.state_dict()
    assert json.loads((folder / hadw_verl.ANCHOR_FILE).read_text()) == saved

    hadw_verl.reset_driver_anchor()  # a new driver process
    hadw_verl.HADWCheckpointCallback(trainer_config(tmp_path))
    assert hadw_verl._driver_anchor.state_dict() == saved

    hadw_verl.reset_driver_anchor()
    hadw_verl.HADWCheckpointCallback(trainer_config(tmp_path, resume_mode="disable"))
    assert hadw_verl._driver_anchor is None


@pytest.mark.slow
def test_entry_point_registers_the_names_when_verl_is_imported(tmp_path):
    """verl imports its "verl.plugins" entry points in every process of a run: declare
    pyproject.toml's in a bare distribution on the path and import only verl."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        plugins = tomllib.load(handle)["project"]["entry-points"]["verl.plugins"]
    dist_info = tmp_path / "hadw_kernels_plugin_probe-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: hadw-kernels-plugin-probe\nVersion: 0\n")
    entries = "".join(f"{name} = {target}\n" for name, target in plugins.items())
    (dist_info / "entry_points.txt").write_text(f"[verl.plugins]\n{entries}")
    probe = (
        "import verl\n"
        "from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn\n"
        "print(get_policy_loss_fn('hadw').__module__, get_policy_loss_fn('hadw_gspo').__module__,"
        " get_adv_estimator_fn('hadw').__module__)\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["hadw_kernels.integrations.verl"] * 3


def test_verl_s_rollout_correction_reaches_the_registered_loss():
    """verl's trainer forms the rollout weights and the rejected mask from its
    algorithm.rollout_correction (rollout_corr_helper) and hands them to the policy loss: the
    registered loss applies them in its kernels as verl's vanilla does; and the loss given
    them equals the loss forming them itself from the rollout log-probs
    (rollout_correction_from_verl)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    from hadw_kernels import fused_hadw_grpo_loss
    from hadw_kernels.integrations.verl_rollout_correction import rollout_correction_from_verl

    old, logprob, advantages, mask, _ = policy_batch(with_is_weights=False)
    generator = torch.Generator().manual_seed(5)
    rollout = (old + 0.3 * torch.randn(old.shape, generator=generator, dtype=torch.float64)).clamp(max=0.0)
    options = dict(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=False,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold="0.05")
    weights, filtered, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask.long(), **options)
    weights = weights.batch["rollout_is_weights"]
    assert 0 < int(filtered.sum()) < int(mask.sum())  # the filter removes some responses
    config = actor_config({})
    expected = run_loss(core_algos.get_policy_loss_fn("vanilla"), old, logprob, advantages, filtered.bool(),
                        "token-mean", config, weights)
    got = run_loss(core_algos.get_policy_loss_fn("hadw_vanilla"), old, logprob, advantages, filtered.bool(),
                   "token-mean", config, weights)
    assert_same_loss(got, expected)
    runs = []
    for kwargs in (dict(response_mask=filtered.bool(), importance_weights=weights),
                   dict(response_mask=mask, rollout_logprobs=rollout,
                        rollout_correction=rollout_correction_from_verl(**options))):
        logprob.grad = None
        loss = fused_hadw_grpo_loss(logprob, old, None, advantages=advantages, loss_type="dapo", dual_clip=3.0,
                                    **kwargs)
        loss.backward()
        runs.append((loss.detach(), logprob.grad.clone()))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-8, atol=1e-12)
