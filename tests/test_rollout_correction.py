"""Rollout correction and token masks against their hosts' own code on the same float64
tensors, on every backend that runs here:

- verl 0.9.1's ``compute_rollout_correction_weights`` (TIS, IcePop, batch normalisation, at
  token and sequence level) and ``compute_rollout_rejection_mask`` (each of its eleven
  filters, and several together): the weights and the mask it hands its policy loss, and
  the loss given them;
- TRL 1.16's ``GRPOTrainer._compute_loss`` (tests/trl_host.py) with its off-policy sequence
  mask, ``top_entropy_quantile`` and ``use_bias_correction_kl``, and with vLLM's
  importance-sampling ratio in each of its four modes, formed as TRL's
  ``_generate_and_score_completions`` forms it (docs/math.md, section 5d);

then the edges: bounds met exactly, a batch whose every token is filtered out, the loss's
checks of bad input, and the linear loss's path choice."""

import math

import pytest
import torch

from hadw_kernels import RolloutCorrection, available_backends, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss
from hadw_kernels.batch.inputs import SurrogateBatch
from hadw_kernels.batch.token_layout import TokenLayout
from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.formulas.correction import correct
from hadw_kernels.integrations.verl_rollout_correction import rollout_correction_from_verl
from hadw_kernels.tables.corrections import REJECTION_FILTERS, RejectionFilter

pytest.importorskip("trl", reason="the trl extra is not installed")
rollout_corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="the verl extra is not installed")

from trl_host import TrlLoss, trl_config, trl_importance_ratio  # noqa: E402

BACKENDS = available_backends("cpu")
EXACT = dict(rtol=1e-10, atol=1e-12)
# verl's masked means divide by (count + 1e-8): a relative 1e-9 at most.
VERL = dict(rtol=1e-8, atol=1e-12)


def batch(seed: int = 0, rollout_noise: float = 0.15):
    """[B, T] float64 tensors with padding and an empty response; rollout log-probs off
    the behaviour ones by a noise whose sums cross the bounds below."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 0, 6, 3, 7, 5])
    size, width = len(lengths), int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    old = -3 * torch.rand(size, width, generator=generator, dtype=torch.float64) - 0.05
    logprobs = old + 0.3 * normal(size, width)
    rollout = (old + rollout_noise * normal(size, width)).clamp(max=0.0)
    return dict(logprobs=logprobs, old=old, rollout=rollout, mask=mask, advantages=normal(size),
                ref=logprobs + 0.3 * normal(size, width),
                entropy=2 * torch.rand(size, width, generator=generator, dtype=torch.float64))


def corrected(data, **options):
    """correct() on a padded batch: (weights [B, T] or None, kept mask [B, T], metrics)."""
    config = LossConfig.build("grpo", **options)
    layout = TokenLayout.padded(*data["mask"].shape, data["mask"].device)
    advantage = data["advantages"][:, None].expand_as(data["mask"])
    batch = SurrogateBatch(layout, config, data["logprobs"].reshape(-1), data["old"].reshape(-1),
                           data["mask"].reshape(-1), rollout_logprobs=data["rollout"].reshape(-1),
                           mask_entropy=data["entropy"].reshape(-1))
    result = correct(batch, token_advantage=advantage.reshape(-1))
    weights = None if result.weights is None else result.weights.view_as(data["old"])
    kept = data["mask"] if result.keep is None else result.keep.view_as(data["mask"])
    return weights, kept, result.metrics


def library_loss(data, backend, *, mask=None, **options):
    logprobs = data["logprobs"].clone().requires_grad_()
    loss = fused_hadw_grpo_loss(logprobs, data["old"], None, data["mask"] if mask is None else mask,
                                advantages=data["advantages"], backend=backend, **options)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.detach(), grad


# --- verl ----------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", ["1.2", "0.7_1.3"], ids=["tis", "icepop"])
@pytest.mark.parametrize("batch_normalize", [False, True])
def test_verl_rollout_weights(level, threshold, batch_normalize):
    data = batch()
    log_ratio = data["old"] - data["rollout"]
    expected, _ = rollout_corr.compute_rollout_correction_weights(
        log_ratio, data["mask"].double(), rollout_is=level, rollout_is_threshold=threshold,
        rollout_is_batch_normalize=batch_normalize)
    correction = rollout_correction_from_verl(level, threshold, batch_normalize)
    weights, kept, metrics = corrected(data, rollout_correction=correction)
    mask = data["mask"]
    torch.testing.assert_close(weights[mask], expected[mask], **VERL)
    assert torch.equal(kept, mask)
    assert 0 < float(metrics["rollout_is_corrected_frac"]) < 1  # the bounds bind somewhere, not everywhere


@pytest.mark.parametrize("name", REJECTION_FILTERS)
def test_verl_rejection_filter(name):
    """Each filter at a bound that keeps some of the batch and rejects some."""
    data = batch(seed=1, rollout_noise=0.3)
    threshold = {"k1": "0.85_1.15" if name.startswith("seq_mean") else "0.6_1.6", "k2": "0.04", "k3": "0.05"}[name[-2:]]
    if name.startswith("seq_sum") and not name.endswith("k1"):
        threshold = "0.2"
    log_ratio = data["old"] - data["rollout"]
    expected, _ = rollout_corr.compute_rollout_rejection_mask(log_ratio, data["mask"].long(), rollout_rs=name,
                                                              rollout_rs_threshold=threshold)
    _, kept, metrics = corrected(data, rollout_correction=rollout_correction_from_verl(
        rollout_rs=name, rollout_rs_threshold=threshold))
    assert torch.equal(kept, expected.bool())
    assert 0 < float(metrics["rollout_rejected_frac"]) < 1, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_verl_weights_and_filters_in_the_loss(backend):
    """verl's rollout weights and rejected mask handed to the loss, against the loss
    forming them from the rollout log-probs."""
    data = batch(seed=2, rollout_noise=0.3)
    log_ratio = data["old"] - data["rollout"]
    options = dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
                   rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.6_1.6,0.05")
    weights, _ = rollout_corr.compute_rollout_correction_weights(
        log_ratio, data["mask"].double(), rollout_is=options["rollout_is"],
        rollout_is_threshold=options["rollout_is_threshold"],
        rollout_is_batch_normalize=options["rollout_is_batch_normalize"])
    filtered, _ = rollout_corr.compute_rollout_rejection_mask(
        log_ratio, data["mask"].long(), rollout_rs=options["rollout_rs"],
        rollout_rs_threshold=options["rollout_rs_threshold"])
    expected = library_loss(data, backend, mask=filtered.bool(), importance_weights=weights)
    got = library_loss(data, backend, rollout_correction=rollout_correction_from_verl(**options),
                       rollout_logprobs=data["rollout"])
    torch.testing.assert_close(got, expected, **VERL)


# --- TRL -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.8, 1.25)], ids=["trl_default_bounds", "two_bounds"])
def test_trl_vllm_importance_sampling_modes(backend, mode, bounds):
    data = batch(seed=3)
    clip_min, clip_max = bounds
    ratio = trl_importance_ratio(mode, data["old"], data["rollout"], data["mask"], clip_min, clip_max)
    args = trl_config("grpo", vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                      vllm_importance_sampling_clip_max=clip_max)
    logprobs = data["logprobs"].clone().requires_grad_()
    expected_loss = TrlLoss(args)(logprobs, data["old"], data["advantages"], data["mask"],
                                  importance_sampling_ratio=ratio)
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    got = library_loss(data, backend, rollout_correction=RolloutCorrection.from_trl(mode, clip_min, clip_max),
                       rollout_logprobs=data["rollout"])
    torch.testing.assert_close(got, (expected_loss.detach(), expected_grad), **EXACT)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampler", ["rollout", "old"])
def test_trl_off_policy_sequence_mask(backend, sampler):
    """OPSM against the sampler's log-probs, or the old ones when there is no sampler."""
    data = batch(seed=4, rollout_noise=0.4)
    args = trl_config("grpo", off_policy_mask_threshold=0.05)
    logprobs = data["logprobs"].clone().requires_grad_()
    sampling = data["rollout"] if sampler == "rollout" else None
    expected_loss = TrlLoss(args)(logprobs, data["old"], data["advantages"], data["mask"], sampling_logprobs=sampling)
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    got = library_loss(data, backend, off_policy_mask_threshold=0.05, rollout_logprobs=sampling)
    torch.testing.assert_close(got, (expected_loss.detach(), expected_grad), **EXACT)
    _, _, metrics = corrected(data if sampler == "rollout" else dict(data, rollout=data["old"]),
                              off_policy_mask_threshold=0.05)
    assert 0 < float(metrics["off_policy_masked_frac"]) < 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.9])
def test_trl_top_entropy_quantile(backend, quantile):
    data = batch(seed=5)
    args = trl_config("bnpo", top_entropy_quantile=quantile)
    logprobs = data["logprobs"].clone().requires_grad_()
    expected_loss = TrlLoss(args)(logprobs, data["old"], data["advantages"], data["mask"], entropies=data["entropy"])
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    got = library_loss(data, backend, loss_type="bnpo", top_entropy_quantile=quantile, entropy=data["entropy"])
    torch.testing.assert_close(got, (expected_loss.detach(), expected_grad), **EXACT)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8])
def test_trl_entropy_mask_reads_the_entropies_in_float32(backend, quantile):
    """TRL's trainer forms float32 entropies (its fused LM head accumulates them in float32,
    a float64 model's too) and takes their quantile and its mask in float32. Entropies closer
    together than float32 resolves (within 1e-6 of log 13) share values there: with
    entropy_mask_dtype="float32" (the TRL drop-in's) the loss of float64 entropies masks
    TRL's tokens; read in float64, as the library's default, it masks others."""
    data = batch(seed=5)
    generator = torch.Generator().manual_seed(1)
    entropy = math.log(13) + 1e-6 * torch.randn(data["mask"].shape, generator=generator, dtype=torch.float64)
    args = trl_config("bnpo", top_entropy_quantile=quantile)
    logprobs = data["logprobs"].clone().requires_grad_()
    expected_loss = TrlLoss(args)(logprobs, data["old"], data["advantages"], data["mask"], entropies=entropy.float())
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    got = library_loss(data, backend, loss_type="bnpo", top_entropy_quantile=quantile, entropy=entropy,
                       entropy_mask_dtype="float32")
    torch.testing.assert_close(got, (expected_loss.detach(), expected_grad), **EXACT)
    own = library_loss(data, backend, loss_type="bnpo", top_entropy_quantile=quantile, entropy=entropy)
    assert not torch.allclose(own[0], expected_loss.detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_entropies_meet_the_quantile_in_float32(backend):
    """The quantile of bfloat16 entropies falls between two bfloat16 values: compared in
    bfloat16 it was rounded down onto the lower one, which was kept; compared in float32,
    as TRL compares, that token is masked."""
    data = batch(seed=5)
    mask = torch.zeros_like(data["mask"])
    mask[0, :4] = True
    entropy = torch.ones(mask.shape, dtype=torch.bfloat16)
    entropy[0, :4] = torch.tensor([1.0, 1.0078125, 1.015625, 1.0234375])  # consecutive bfloat16 values
    args = trl_config("bnpo", top_entropy_quantile=0.9)  # quantile 1 + 0.3 x 2^-7
    logprobs = data["logprobs"].clone().requires_grad_()
    expected_loss = TrlLoss(args)(logprobs, data["old"], data["advantages"], mask, entropies=entropy)
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    got = library_loss(data, backend, mask=mask, loss_type="bnpo", top_entropy_quantile=0.9, entropy=entropy)
    torch.testing.assert_close(got, (expected_loss.detach(), expected_grad), **EXACT)
    _, metrics = fused_hadw_grpo_loss(data["logprobs"], data["old"], None, mask, advantages=data["advantages"],
                                      loss_type="bnpo", top_entropy_quantile=0.9, entropy=entropy,
                                      return_metrics=True, backend=backend)
    assert float(metrics["entropy_masked_frac"]) == 0.25


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_bias_corrected_kl(backend, level):
    data = batch(seed=6)
    args = trl_config("grpo", beta=0.1, use_bias_correction_kl=True, importance_sampling_level=level)
    logprobs = data["logprobs"].clone().requires_grad_()
    expected_loss = TrlLoss(args)(logprobs, data["old"], data["advantages"], data["mask"], ref_logprobs=data["ref"])
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    got = library_loss(data, backend, beta=0.1, kl_bias_correction=True, ref_logprobs=data["ref"],
                       ratio_level=level)
    torch.testing.assert_close(got, (expected_loss.detach(), expected_grad), **EXACT)


# --- edges ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tokens_at_the_entropy_quantile_are_kept_in_every_dtype(backend, dtype):
    """The quantile is taken in the entropies' own dtype (fp32 at least): equal entropies
    all sit at it and are all kept (in float64 the threshold was rounded to float32 above
    them and every token was masked); with distinct ones the tokens at or above it are."""
    mask = torch.ones(4, 5, dtype=torch.bool)
    logprobs, old = torch.full((4, 5), -1.0), torch.full((4, 5), -1.1)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    # Formed in the dtype itself: float64's 1.1 is not a float32 value.
    equal = torch.full((4, 5), 1.1, dtype=dtype)
    distinct = torch.arange(20, dtype=dtype).view(4, 5) / 7 + 0.1
    for entropy, kept in ((equal, 20), (distinct, 10)):
        _, metrics = fused_hadw_grpo_loss(
            logprobs.to(dtype), old.to(dtype), None, mask, advantages=advantages.to(dtype), top_entropy_quantile=0.5,
            entropy=entropy, return_metrics=True, backend=backend)
        assert float(metrics["entropy_masked_frac"]) == pytest.approx(1 - kept / 20), (entropy.dtype, kept)


def test_bounds_are_inclusive_and_beyond_them_the_rule_acts():
    """A weight exactly at a bound is kept by both rules; one beyond it is clamped or zeroed."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    rollout = -torch.log(torch.tensor([[0.5, 2.0, 2.5]], dtype=torch.float64))  # weights 0.5, 2, 2.5
    data = dict(old=old, rollout=rollout, mask=mask, logprobs=old, advantages=torch.ones(1),
                entropy=torch.ones(1, 3, dtype=torch.float64))
    masked, _, _ = corrected(data, rollout_correction=RolloutCorrection(level="token", rule="mask", lower=0.5,
                                                                        upper=2.0))
    truncated, _, _ = corrected(data, rollout_correction=RolloutCorrection(level="token", rule="truncate",
                                                                           lower=0.6, upper=2.0))
    torch.testing.assert_close(masked, torch.tensor([[0.5, 2.0, 0.0]], dtype=torch.float64), **EXACT)
    torch.testing.assert_close(truncated, torch.tensor([[0.6, 2.0, 2.0]], dtype=torch.float64), **EXACT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_token_filtered_out_gives_zero(backend):
    data = batch(seed=7, rollout_noise=1.0)
    correction = RolloutCorrection(level=None, rejection={"token_k2": 1e-12})
    logprobs = data["logprobs"].clone().requires_grad_()
    loss, metrics = fused_hadw_grpo_loss(logprobs, data["old"], None, data["mask"], advantages=data["advantages"],
                                         rollout_correction=correction, rollout_logprobs=data["rollout"],
                                         return_metrics=True, backend=backend)
    loss.backward()
    assert float(loss) == 0 and torch.all(logprobs.grad == 0)
    assert float(metrics["rollout_rejected_frac"]) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_response_filtered_whole_leaves_the_others(backend):
    """seq_max_k3 removes the one response whose worst token drifted; the loss is then that
    of the batch without it (its count gone too, as verl's mask)."""
    data = batch(seed=8, rollout_noise=0.01)
    data["rollout"][2, 1] -= 2.0
    correction = RolloutCorrection(level=None, rejection={"seq_max_k3": 0.5})
    without = data["mask"].clone()
    without[2] = False
    expected = library_loss(data, backend, mask=without)
    got = library_loss(data, backend, rollout_correction=correction, rollout_logprobs=data["rollout"])
    torch.testing.assert_close(got, expected, **EXACT)


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (dict(level="token", lower=2.0, upper=1.0), "out of order"),
    (dict(level="chunk"), "unknown rollout correction level"),
    (dict(rule="clip"), "unknown rollout correction rule"),
    (dict(upper=-1.0), "finite positive"),
    (dict(upper=math.nan), "finite positive"),
    (dict(level=None, batch_normalize=True), "needs a level"),
    (dict(rejection={"seq_max_k1": 2.0}), "unknown rejection filter"),
    (dict(rejection={"token_k4": 2.0}), "unknown rejection filter"),
    (dict(rejection={"token_k3": (0.1, 0.5)}), "upper bound only"),
    (dict(rejection={"token_k1": (2.0, 1.5)}), "above upper"),
    (dict(rejection=["token_k1"]), "RejectionFilter items"),
])
def test_bad_correction_options(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        RolloutCorrection(**options)


def test_verl_and_trl_spellings():
    assert rollout_correction_from_verl("token", "2.0") == RolloutCorrection(level="token", rule="truncate", upper=2.0)
    assert rollout_correction_from_verl("sequence", "0.5_2.0") == RolloutCorrection(level="sequence", rule="mask",
                                                                                    lower=0.5, upper=2.0)
    assert rollout_correction_from_verl(rollout_rs="token_k1", rollout_rs_threshold=2.0).rejection == (
        RejectionFilter("token_k1", upper=2.0, lower=0.5),)
    with pytest.raises(ValueError, match="2 values for 3 filters"):
        rollout_correction_from_verl(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="2.0,0.1")
    with pytest.raises(ValueError, match="unknown vllm_importance_sampling_mode"):
        RolloutCorrection.from_trl("batch_mask", None, 3.0)
    with pytest.raises(TypeError, match="vllm_importance_sampling_mode must be one of TRL's modes"):
        RolloutCorrection.from_trl(None, None, 3.0)
    assert rollout_correction_from_verl("token", " 1e-3_5 ") == RolloutCorrection(level="token", rule="mask",
                                                                                  lower=1e-3, upper=5.0)


@pytest.mark.parametrize("threshold", ["0.5_2_0", "abc", "0.5_", "_2.0", "0.5-2.0", "2.0x", "1_2_3"])
@pytest.mark.parametrize("option", ["rollout_is_threshold", "rollout_rs_threshold"])
def test_malformed_verl_thresholds_are_refused_naming_the_option(option, threshold):
    """Not a number or 'lower_upper': refused, naming the option (Python's float would read
    '0.5_2_0' as 20, and say nothing of the option otherwise)."""
    options = ({"rollout_is": "token", option: threshold} if option == "rollout_is_threshold"
               else {"rollout_rs": "token_k1", option: threshold})
    with pytest.raises(ValueError, match=f"^{option} must be a number, or a string 'upper' or 'lower_upper'"):
        rollout_correction_from_verl(**options)


@pytest.mark.parametrize("change, message", [
    (dict(rollout_logprobs=None), "rollout_correction needs rollout_logprobs"),
    (dict(rollout_correction=None), "would be ignored"),
    (dict(rollout_logprobs="short"), "rollout_logprobs has shape"),
    (dict(rollout_logprobs="int"), "rollout_logprobs"),
    (dict(rollout_logprobs="meta"), "one device"),
    (dict(rollout_logprobs="positive"), r"log-probabilities \(<= 0\)"),
    (dict(rollout_logprobs="nan"), "NaN at response tokens"),
    (dict(top_entropy_quantile=0.5), "needs entropy"),
    (dict(entropy="given"), "read by top_entropy_quantile < 1 only"),
    (dict(top_entropy_quantile=0.0), r"must be in \(0, 1\]"),
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold"),
    (dict(kl_bias_correction=True), "needs beta > 0"),
    (dict(beta=0.1, kl_bias_correction=True, kl_bias_ratio="sequence"), "kl_bias_ratio must be one of"),
    (dict(beta=0.1, kl_bias_ratio="token"), "needs kl_bias_correction=True"),
])
def test_bad_correction_input(change, message):
    data = batch()
    rollout = data["rollout"].clone()
    special = {"short": rollout[:, :3], "int": rollout.long(), "positive": rollout.abs() + 0.1,
               "nan": rollout.masked_fill(data["mask"], math.nan), "given": data["entropy"],
               "meta": rollout.to("meta")}
    kwargs = dict(rollout_correction=RolloutCorrection(), rollout_logprobs=rollout)
    kwargs.update({key: special.get(value, value) if isinstance(value, str) else value for key, value in change.items()})
    with pytest.raises((ValueError, TypeError), match=message):
        fused_hadw_grpo_loss(data["logprobs"], data["old"], None, data["mask"], advantages=data["advantages"],
                             **kwargs)


def test_nan_is_no_evidence_when_values_are_not_checked():
    """Unchecked, a token the engine did not score (NaN) weighs 1, as TRL reads it."""
    data = batch()
    correction = RolloutCorrection(level="token", rule="truncate", upper=None)
    unscored = data["rollout"].clone()
    unscored[0, 2] = math.nan
    filled = data["rollout"].clone()
    filled[0, 2] = data["old"][0, 2]
    expected = library_loss(data, "torch", rollout_correction=correction, rollout_logprobs=filled)
    got = library_loss(data, "torch", rollout_correction=correction, rollout_logprobs=unscored, check_values=False)
    torch.testing.assert_close(got, expected, **EXACT)


def test_linear_loss_takes_the_recompute_path_where_a_rule_reads_the_policy():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 5, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 30, (4, 5), generator=generator)
    mask = torch.ones(4, 5, dtype=torch.bool)
    old = -torch.rand(4, 5, generator=generator, dtype=torch.float64) - 3
    with pytest.raises(ValueError, match="read them first"):
        fused_linear_hadw_grpo_loss(hidden, weight, labels, old, torch.rand(4, dtype=torch.float64), mask,
                                    group_size=2, top_entropy_quantile=0.5, linear_path="gradients_in_forward",
                                    backend="cpp" if "cpp" in BACKENDS else "torch")


@pytest.mark.parametrize("bad, message", [(math.nan, "NaN at response tokens"), (0.5, r"\(<= 0\)")])
def test_the_linear_loss_checks_the_rollout_log_probs_too(bad, message):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 5, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(30, 8, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 30, (4, 5), generator=generator)
    mask = torch.ones(4, 5, dtype=torch.bool)
    old = -torch.rand(4, 5, generator=generator, dtype=torch.float64) - 3
    rollout = old.clone()
    rollout[1, 2] = bad
    with pytest.raises(ValueError, match=message):
        fused_linear_hadw_grpo_loss(hidden, weight, labels, old, torch.rand(4, dtype=torch.float64), mask,
                                    group_size=2, rollout_correction=RolloutCorrection(), rollout_logprobs=rollout)
