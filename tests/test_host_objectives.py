"""Every objective against its host's own code, on the same float64 tensors, loss and
gradient, on every backend that runs here:

- TRL 1.16's eight loss types, through TRL's own ``GRPOTrainer._compute_loss``
  (tests/trl_host.py), at token and sequence level, with TRL's options (delta, the SAPO
  temperatures, VESPO's k and lambda, epsilon_high as CISPO's cap, beta), per-response and
  per-token advantages, with and without vLLM's importance-sampling ratio;
- verl 0.9.1's registered policy losses vanilla, gspo, sapo, gpg, geo_mean, cispo, dppo_tv,
  dppo_kl, dro, clip_cov and kl_cov
  (``get_policy_loss_fn``), with verl's ActorConfig options, every aggregation mode, its
  global-batch counts and per-token rollout weights.

Each test states how the host's options map onto LossConfig (docs/options.md has the
table). Where a host departs from its own documented intent, a test shows what the host
does and what this library does instead (docs/math.md, "Where the hosts differ")."""

import math

import pytest
import torch

from hadw_kernels import LOSS_PRESETS, LossConfig, available_backends, fused_hadw_grpo_loss
from hadw_kernels.objectives.table import OBJECTIVES
from hadw_kernels.tables.aggregations import AGGREGATIONS

pytest.importorskip("trl", reason="the trl extra is not installed")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="the verl extra is not installed")
from trl_host import TrlLoss, trl_config  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

from hadw_kernels.integrations.trl import vespo_behaviour_logprobs  # noqa: E402

BACKENDS = available_backends("cpu")
AGG_MODES = tuple(AGGREGATIONS)
EXACT = dict(rtol=1e-10, atol=1e-12)
# verl divides each response's token sum by (tokens + 1e-8): a relative 1e-9 at most.
VERL = dict(rtol=1e-8, atol=1e-12)


def batch(per_token_advantages: bool, seed: int = 0):
    """[B, T] float64 tensors with padding and an empty response, log-ratios wide enough
    (sd 0.4 a token) to cross every clip bound; reference log-probs and an importance ratio
    per token as TRL forms vLLM's (1 at padding)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 0, 6, 3, 7, 5])
    batch_size, width = len(lengths), int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    old = -3 * torch.rand(batch_size, width, generator=generator, dtype=torch.float64) - 0.05
    logprobs = old + 0.4 * normal(batch_size, width)
    advantages = normal(batch_size, width) if per_token_advantages else normal(batch_size)
    return dict(logprobs=logprobs, old=old, advantages=advantages, mask=mask,
                ref=logprobs + 0.3 * normal(batch_size, width),
                importance_ratio=torch.exp(0.3 * normal(batch_size, width) * mask))  # 1 at padding, as TRL's


def library_loss(data, backend, importance_weights=None, old=None, **options):
    logprobs = data["logprobs"].clone().requires_grad_()
    loss = fused_hadw_grpo_loss(
        logprobs, data["old"] if old is None else old, None, data["mask"], advantages=data["advantages"],
        importance_weights=importance_weights, backend=backend, **options,
    )
    loss.backward()
    return loss.detach(), logprobs.grad


def host_loss(function, data, *args, **kwargs):
    logprobs = data["logprobs"].clone().requires_grad_()
    loss = function(logprobs, *args, **kwargs)
    if isinstance(loss, tuple):  # verl's (loss, metrics)
        loss = loss[0]
    loss.backward()
    return loss.detach(), logprobs.grad


def assert_equal(got, expected, tolerance):
    torch.testing.assert_close(got[0], expected[0], **tolerance)
    torch.testing.assert_close(got[1], expected[1], **tolerance)


# --- TRL -------------------------------------------------------------------------------------

# TRL's options per loss type, each beside its defaults: delta below and above
# 1 + epsilon_high, CISPO's cap low enough to bind, other temperatures and gamma shapes.
TRL_CASES = {
    "grpo": {},
    "grpo+delta": dict(epsilon_high=0.28, delta=1.25),
    "bnpo+delta": dict(delta=1.1),
    "dr_grpo": dict(max_completion_length=12),
    "dapo+kl": dict(epsilon_high=0.28, beta=0.05),
    "cispo": dict(epsilon_high=5.0),
    "cispo+cap": dict(epsilon_high=1.3),
    "sapo": {},
    "sapo+temperatures+kl": dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.6, beta=0.05),
    "luspo": {},
    "vespo": {},
    "vespo+shapes": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0, vespo_lambda_neg=1.0),
    # TRL's bias-corrected KL weighs each token's KL by the ratio at importance_sampling_level:
    # at "token" the token's own, though VESPO's ratio is per response.
    "vespo+kl_bias": dict(beta=0.05, use_bias_correction_kl=True),
}
# TRL's loss types that divide a micro-batch's sum by num_items_in_batch (the generation
# batch's valid tokens, every process): this library's loss_normalizer.
TRL_ITEMS_NORMALIZED = ("dapo", "cispo", "vespo")
NUM_ITEMS = 97  # more tokens than the micro-batch holds, as in a generation batch


def trl_as_library(args) -> dict:
    """TRL's config as this library's options. A TRL loss type is the preset of the same
    name; importance_sampling_level "sequence" is the ratio form whose gradient reaches
    each token through s_i (VESPO's weight is a sequence quantity at either level);
    epsilon_high is CISPO's cap; an option of another objective is not passed; the
    bias-corrected KL weighs by the ratio at TRL's level."""
    preset = LOSS_PRESETS[args.loss_type]
    objective_options = OBJECTIVES[preset.objective].options
    host_options = dict(delta=args.delta, ratio_cap=args.epsilon_high, sapo_temperature_pos=args.sapo_temperature_pos,
                        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
                        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
                        vespo_lambda_neg=args.vespo_lambda_neg)
    # TRL forms the SAPO temperatures with torch.where of two Python floats, a float32 tensor:
    # in float64 its tau is the float32 nearest to the option (a relative 6e-8 at most).
    host_options.update({name: float(torch.tensor(host_options[name], dtype=torch.float32))
                         for name in ("sapo_temperature_pos", "sapo_temperature_neg")})
    ratio_level = "sequence" if args.importance_sampling_level == "sequence" else "token"
    kl_bias_correction = args.beta != 0 and args.use_bias_correction_kl
    return dict(
        kl_bias_correction=kl_bias_correction,
        kl_bias_ratio="token" if kl_bias_correction and ratio_level == "token" else "objective",
        loss_type=args.loss_type,
        ratio_level=ratio_level if ratio_level in OBJECTIVES[preset.objective].ratio_levels else None,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        beta=args.beta,
        kl_estimator="k3",
        loss_normalizer=NUM_ITEMS if args.loss_type in TRL_ITEMS_NORMALIZED else None,
        max_response_length=args.max_completion_length if preset.loss_agg_mode == "seq-mean-token-sum-norm" else None,
        **{name: value for name, value in host_options.items() if name in objective_options},
    )


# Per-response advantages alone, and per-token advantages (which TRL takes from subclasses)
# with vLLM's per-token importance-sampling ratio.
INPUTS = {"A[B]": (False, False), "A[B,T]+is": (True, True)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("case", TRL_CASES)
def test_trl_loss_types(case, level, inputs, backend):
    loss_type = case.split("+")[0]
    args = trl_config(loss_type, importance_sampling_level=level, **TRL_CASES[case])
    per_token_advantages, vllm_ratio = INPUTS[inputs]
    data = batch(per_token_advantages)
    ratio = data["importance_ratio"] if vllm_ratio else None
    expected = host_loss(
        lambda logprobs: TrlLoss(args)(logprobs, data["old"], data["advantages"], data["mask"],
                                       num_items_in_batch=NUM_ITEMS, ref_logprobs=data["ref"],
                                       importance_sampling_ratio=ratio), data)
    options = trl_as_library(args)
    if ratio is not None and loss_type == "vespo" and options["kl_bias_correction"]:
        # The behaviour log-probs below carry vLLM's ratio into VESPO's weight, and TRL's KL
        # weight reads the old ones: the TRL integration refuses the combination
        # (test_integration_trl.py, test_bad_hadw_fields_are_refused_when_the_config_is_built).
        pytest.skip("VESPO's vLLM correction with the bias-corrected KL is refused by the TRL integration")
    if ratio is not None and loss_type == "vespo":
        # TRL's VESPO puts the ratio into its sequence weight instead of multiplying the loss.
        got = library_loss(data, backend, old=vespo_behaviour_logprobs(data["old"], ratio),
                           ref_logprobs=data["ref"] if args.beta else None, **options)
    else:
        got = library_loss(data, backend, importance_weights=ratio, ref_logprobs=data["ref"] if args.beta else None,
                           **options)
    assert_equal(got, expected, EXACT)


def test_trl_cispo_at_its_default_epsilon_high_caps_every_weight():
    """TRL reads epsilon_high as CISPO's cap and leaves it at epsilon (0.2) unless set: every
    weight min(r, 0.2) is then 0.2, so the loss is 0.2 times the ratio-free policy gradient,
    never the importance-weighted one the ScaleRL paper's cap of 5 gives. This library's
    loss refuses a cap below 1 (LossConfig's ratio_cap); the TRL integration takes TRL's
    with a warning, as min(r, c) = c min(r / c, 1) (HADWGRPOConfig.cap_below_one)."""
    data = batch(per_token_advantages=False)
    assert (data["logprobs"] - data["old"])[data["mask"]].exp().min() > 0.2
    expected = host_loss(lambda logprobs: TrlLoss(trl_config("cispo"))(
        logprobs, data["old"], data["advantages"], data["mask"], num_items_in_batch=NUM_ITEMS), data)
    ratio_free = library_loss(data, "torch", loss_type="gpg", loss_agg_mode="token-mean", loss_normalizer=NUM_ITEMS)
    assert_equal(expected, (0.2 * ratio_free[0], 0.2 * ratio_free[1]), EXACT)
    with pytest.raises(ValueError, match=r"ratio_cap .* at least 1 \(TRL recommends 5\), got 0.2"):
        LossConfig.build("cispo", ratio_cap=0.2)


# --- verl ------------------------------------------------------------------------------------

# verl's loss modes as this library's choices, and the ActorConfig keys their options read
# (clip_ratio_low / clip_ratio_high are every loss's epsilon_low / epsilon_high).
VERL_LOSSES = {
    "vanilla": (dict(objective="clip", ratio_level="token"), {"dual_clip": "clip_ratio_c"}),
    "gspo": (dict(objective="clip", ratio_level="gspo_token"), {}),
    "sapo": (dict(objective="sapo", ratio_level="token"),
             {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"}),
    "gpg": (dict(objective="gpg", ratio_level="token"), {}),
    "geo_mean": (dict(objective="gmpo", ratio_level="sequence"), {}),
    "cispo": (dict(objective="cispo_clip", ratio_level="token"), {}),
    "dppo_tv": (dict(objective="dppo_tv", ratio_level="token"), {"ratio_cap": "clip_ratio_c"}),
    "dppo_kl": (dict(objective="dppo_kl", ratio_level="token"), {"ratio_cap": "clip_ratio_c"}),
    "dro": (dict(objective="dro", ratio_level="token"), {"dro_beta": "policy_loss.dro_beta"}),
    "clip_cov": (dict(objective="clip_cov", ratio_level="token"),
                 {"clip_cov_ratio": "policy_loss.clip_cov_ratio", "clip_cov_lb": "policy_loss.clip_cov_lb",
                  "clip_cov_ub": "policy_loss.clip_cov_ub"}),
    "kl_cov": (dict(objective="kl_cov", ratio_level="token"),
               {"kl_cov_ratio": "policy_loss.kl_cov_ratio", "ppo_kl_coef": "policy_loss.ppo_kl_coef"}),
}
# What verl's workers put in global_batch_info for one of two data-parallel ranks.
GLOBAL_BATCH = {"dp_size": 2, "batch_num_tokens": 41, "global_batch_size": 14, "loss_scale_factor": 16}


def verl_config(batch_info: dict) -> ActorConfig:
    # dro's beta (verl has none) and shares of tokens wide enough that clip_cov and kl_cov
    # select several of the batch's.
    policy_loss = PolicyLossConfig(dro_beta=0.3, clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=3.0,
                                   kl_cov_ratio=0.15, ppo_kl_coef=0.7)
    config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                         clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.2, tau_neg=1.6,
                         policy_loss=policy_loss)
    config.global_batch_info.update(batch_info)
    return config


def verl_as_library(loss_mode: str, config: ActorConfig, loss_agg_mode: str) -> dict:
    """verl's loss mode and ActorConfig as this library's options: the global batch's count
    over dp_size is the loss_normalizer (data-parallel ranks average their gradients), and
    loss_scale_factor Dr.GRPO's constant length."""
    choices, keys = VERL_LOSSES[loss_mode]
    info = config.global_batch_info
    count = {"tokens": info["batch_num_tokens"], "responses": info["global_batch_size"], "one": 1}
    return dict(
        **choices, loss_agg_mode=loss_agg_mode, epsilon_low=config.clip_ratio_low,
        epsilon_high=config.clip_ratio_high, loss_normalizer=count[AGGREGATIONS[loss_agg_mode].count] / info["dp_size"],
        max_response_length=info["loss_scale_factor"],
        **{name: config.policy_loss.get(key.split(".")[1]) if key.startswith("policy_loss.") else config.get(key)
           for name, key in keys.items()},
    )


def verl_loss(loss_mode, data, loss_agg_mode, config, rollout_is_weights=None):
    advantages = data["advantages"]
    if advantages.dim() == 1:  # verl's outcome estimators broadcast one advantage over the tokens
        advantages = advantages[:, None].expand_as(data["mask"])
    advantages = advantages * data["mask"]
    function = core_algos.get_policy_loss_fn(loss_mode)
    return host_loss(lambda logprobs: function(data["old"], logprobs, advantages, data["mask"],
                                               loss_agg_mode=loss_agg_mode, config=config,
                                               rollout_is_weights=rollout_is_weights), data)


def geometric_mean_per_response(weights, mask):
    """verl's geo_mean weighs a response by the geometric mean of its tokens' rollout weights."""
    log_weights = torch.where(mask, weights.log(), torch.zeros_like(weights))
    return torch.exp(log_weights.sum(dim=1) / mask.sum(dim=1).clamp(min=1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro", "clip_cov",
                                       "kl_cov"])
def test_verl_policy_losses(loss_mode, loss_agg_mode, inputs, backend):
    per_token_advantages, with_is_weights = INPUTS[inputs]
    data = batch(per_token_advantages)
    weights = data["importance_ratio"] if with_is_weights else None
    config = verl_config(GLOBAL_BATCH)
    torch.manual_seed(4)  # clip_cov draws from the global generator, in verl and here
    expected = verl_loss(loss_mode, data, loss_agg_mode, config, weights)
    torch.manual_seed(4)
    got = library_loss(data, backend, importance_weights=weights, **verl_as_library(loss_mode, config, loss_agg_mode))
    assert_equal(got, expected, VERL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inputs", INPUTS)
def test_verl_sapo_at_the_aggregation_it_applies(inputs, backend):
    """verl's sapo aggregates seq-mean-token-mean whatever loss_agg_mode says
    (test_verl_sapo_ignores_loss_agg_mode); there it is this library's sapo."""
    per_token_advantages, with_is_weights = INPUTS[inputs]
    data = batch(per_token_advantages)
    weights = data["importance_ratio"] if with_is_weights else None
    config = verl_config(GLOBAL_BATCH)
    expected = verl_loss("sapo", data, "seq-mean-token-mean", config, weights)
    got = library_loss(data, backend, importance_weights=weights,
                       **verl_as_library("sapo", config, "seq-mean-token-mean"))
    assert_equal(got, expected, VERL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inputs", INPUTS)
def test_verl_geo_mean_at_the_aggregation_it_applies(inputs, backend):
    """verl's geo_mean is the mean over the micro-batch's rows of -A_i s_i (A_i the mean of the
    response's advantages), whatever loss_agg_mode and global_batch_info say
    (test_verl_geo_mean_ignores_the_aggregation): this library's gmpo at
    seq-mean-token-mean over the call's rows, its rollout weight the geometric mean of the
    tokens' per response."""
    per_token_advantages, with_is_weights = INPUTS[inputs]
    data = batch(per_token_advantages)
    weights = data["importance_ratio"] if with_is_weights else None
    config = verl_config({})
    expected = verl_loss("geo_mean", data, "seq-mean-token-mean", config, weights)
    per_response = None if weights is None else geometric_mean_per_response(weights, data["mask"])
    got = library_loss(data, backend, loss_agg_mode="seq-mean-token-mean", epsilon_low=config.clip_ratio_low,
                       epsilon_high=config.clip_ratio_high, importance_weights=per_response,
                       **VERL_LOSSES["geo_mean"][0])
    assert_equal(got, expected, VERL)


def test_verl_geo_mean_ignores_the_aggregation():
    """verl's geo_mean takes loss_agg_mode and global_batch_info and uses neither: every
    mode, and a rank's share of a global batch, give the micro-batch's own mean over its
    rows. Under gradient accumulation each micro-batch then weighs as much as the whole
    batch should (k micro-batches: k times the gradient), unlike verl's other losses and its
    KL and entropy terms. This library's gmpo aggregates as every other objective does."""
    data = batch(per_token_advantages=False)
    local = verl_loss("geo_mean", data, "seq-mean-token-mean", verl_config({}))
    for mode in AGG_MODES:
        assert_equal(verl_loss("geo_mean", data, mode, verl_config(GLOBAL_BATCH)), local, EXACT)
    choices = dict(**VERL_LOSSES["geo_mean"][0], epsilon_low=0.2, epsilon_high=0.28)
    ours_local = library_loss(data, "torch", loss_agg_mode="seq-mean-token-mean", **choices)
    assert_equal(ours_local, local, VERL)
    rows, share = data["mask"].shape[0], GLOBAL_BATCH["global_batch_size"] / GLOBAL_BATCH["dp_size"]
    ours_global = library_loss(data, "torch", loss_agg_mode="seq-mean-token-mean", loss_normalizer=share, **choices)
    assert_equal(ours_global, (local[0] * rows / share, local[1] * rows / share), VERL)
    ours_token_mean = library_loss(data, "torch", loss_agg_mode="token-mean", **choices)
    assert not torch.allclose(ours_token_mean[0], local[0], rtol=1e-3)


def test_verl_sapo_ignores_loss_agg_mode():
    """verl's sapo documents loss_agg_mode as its aggregation (recommending
    seq-mean-token-mean) but always applies seq-mean-token-mean; verl's default actor mode is
    token-mean. This library's sapo aggregates by the mode it is given."""
    data = batch(per_token_advantages=False)
    config = verl_config({})
    seq_mean = verl_loss("sapo", data, "seq-mean-token-mean", config)
    verl_token_mean = verl_loss("sapo", data, "token-mean", config)
    assert_equal(verl_token_mean, seq_mean, EXACT)
    choices = dict(**VERL_LOSSES["sapo"][0], epsilon_low=0.2, epsilon_high=0.28, sapo_temperature_pos=1.2,
                   sapo_temperature_neg=1.6)
    ours_token_mean = library_loss(data, "torch", loss_agg_mode="token-mean", **choices)
    assert not torch.allclose(ours_token_mean[0], seq_mean[0], rtol=1e-3)
    tokens = data["mask"].sum()
    per_token = library_loss(data, "torch", loss_agg_mode="token-sum", **choices)
    assert_equal(ours_token_mean, (per_token[0] / tokens, per_token[1] / tokens), EXACT)


def test_verl_gspo_clamps_the_sequence_log_ratio_above_at_10():
    """verl's gspo clamps the carried log-ratio log s_i above at 10 (no bound below), this
    library every log-ratio to [-20, 20]. A response whose mean log-ratio is 12 with A < 0
    is on the unclipped branch: verl's loss there is |A| e^10 a token with no gradient, this
    library's |A| e^12 with the gradient |A| e^12 (the clamp passes it)."""
    data = batch(per_token_advantages=False)
    row, tokens = 0, int(data["mask"][0].sum())
    data["logprobs"][row] = data["old"][row] + 12.0
    data["advantages"][row] = -1.0
    data["advantages"][1:] = 0.0
    theirs = verl_loss("gspo", data, "token-sum", verl_config({}))
    ours = library_loss(data, "torch", loss_agg_mode="token-sum", epsilon_low=0.2, epsilon_high=0.28,
                        **VERL_LOSSES["gspo"][0])
    assert theirs[0].item() == pytest.approx(tokens * math.exp(10.0), rel=1e-12)
    assert ours[0].item() == pytest.approx(tokens * math.exp(12.0), rel=1e-12)
    assert torch.equal(theirs[1], torch.zeros_like(theirs[1]))
    torch.testing.assert_close(ours[1][row, :tokens], torch.full((tokens,), math.exp(12.0), dtype=torch.float64))
