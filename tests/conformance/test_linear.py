"""The linear ops and the linear loss on every backend against the full-logits
reference: log-probs and entropy with random upstream gradients, and the whole loss on
each execution path (gradients formed in the forward, or recomputed in backward) with
blocks of 8 rows, so blocks end inside responses and a response spans several."""

import pytest
import torch
from cases import (
    DTYPES,
    UPSTREAM,
    Variant,
    cast,
    linear_batch,
    loss_kwargs,
    mask_vocabulary,
    reference_linear_loss,
    rounded,
    run_linear_loss,
    run_token_logprobs,
    unpreset_objective_variants,
)
from check import assert_conforms

from hadw_kernels import LOSS_TYPES, LossConfig, RolloutCorrection, fused_linear_hadw_grpo_loss
from hadw_kernels.backends import load_backend
from hadw_kernels.objectives.table import OBJECTIVES

# (batch, width, hidden, vocab, bias, temperature, logit scale): a vocabulary that no
# tile divides, a single token, and logits near +-40 (a trained head's) at temperature 0.5.
SHAPES = [
    pytest.param(3, 13, 32, 300, True, 0.7, 1.0, id="ragged_vocab-bias-temperature"),
    pytest.param(1, 1, 24, 200, False, 1.3, 1.0, id="one_token"),
    pytest.param(2, 12, 20, 150, True, 0.5, 5.0, id="large_logits"),
    # -inf logits (mask_vocabulary) beside finite ones in every tile, and a whole tile of them.
    pytest.param(3, 13, 32, 300, "masked", 0.7, 1.0, id="masked_vocab"),
]


@pytest.mark.parametrize("check_values", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch, width, hidden, vocab, bias, temperature, scale", SHAPES)
def test_token_logprobs_match_reference(backend, device, dtype, batch, width, hidden, vocab, bias, temperature,
                                        scale, check_values):
    """Every fifth label ignored: checked (the default call), those rows are left out of
    the sweep on every backend; unchecked, the triton and torch backends sweep them too."""
    data = linear_batch(7, batch=batch, width=width, hidden=hidden, vocab=vocab, scale=scale)
    if bias == "masked":
        data = mask_vocabulary(data)
    hidden_states = torch.randn(batch, width, hidden, dtype=torch.float64)
    labels = data["labels"].clamp(max=vocab - 1)
    if labels.numel() > 1:
        labels.view(-1)[1::5] = -100
    upstream = (torch.randn(batch, width, dtype=torch.float64), torch.randn(batch, width, dtype=torch.float64))
    weight, lm_bias = data["lm_head_weight"], data["lm_head_bias"] if bias else None

    def run(name, on, in_dtype):
        convert = (lambda t: None if t is None else t.to(dtype).to(in_dtype).to(on))
        return run_token_logprobs(
            name, convert(hidden_states), convert(weight), labels.to(on), [u.to(on) for u in upstream],
            lm_head_bias=convert(lm_bias), temperature=temperature, check_values=check_values,
        )

    fast = run(backend, device, dtype)
    eager = run("reference", device, dtype)
    exact = run("reference", torch.device("cpu"), torch.float64)
    assert_conforms(fast, eager, exact, dtype)
    ignored = (labels == -100).to(device)
    assert torch.all(fast.values["logprobs"][ignored] == 0) and torch.all(fast.values["entropy"][ignored] == 0)


LINEAR_VARIANTS = [
    Variant("plain"),
    Variant("hadw_kl_entropy_bias_temperature", {"anchor": 0.35, "beta": 0.05, "entropy_coef": 0.01,
                                                 "temperature": 0.7, "dual_clip": 3.0},
            ("old_logprobs", "rewards", "ref_logprobs", "bias")),
    Variant("importance_weights_normalizer", {"loss_normalizer": 40.0, "max_response_length": 16,
                                         "kl_estimator": "k2", "beta": 0.02},
            ("old_logprobs", "rewards", "token_importance_weights", "ref_logprobs")),
    Variant("advantages_on_policy", {"entropy_coef": 0.02, "loss_agg_mode": "seq-mean-token-sum"},
            ("advantages",)),
    # A vocabulary masked through the bias (-inf logits), with the entropy's gradient.
    Variant("masked_vocab_entropy", {"entropy_coef": 0.01, "anchor": 0.35},
            ("old_logprobs", "rewards", "bias", "masked_vocab")),
    # Each objective's own options away from their defaults (cases.OBJECTIVE_VARIANT_OPTIONS).
    Variant("objective_options", {"anchor": 0.45}, ("old_logprobs", "rewards", "objective_options")),
    Variant("token_advantages_entropy", {"entropy_coef": 0.01}, ("old_logprobs", "token_advantages")),
    # The objectives no loss type presets, in each loss type's ratio form.
    *unpreset_objective_variants(),
    # The estimators (tables/estimators.py), with Phi: the batch's and the history's.
    Variant("james_stein_hadw", {"advantage_estimator": "james_stein", "anchor": 0.35}),
    Variant("prompt_history_hadw", {"advantage_estimator": "prompt_history", "anchor": 0.4},
            ("old_logprobs", "rewards", "prior")),
    # Rollout weights and filters (formed before the sweep), and the rules that read the
    # current policy (the recompute path only).
    Variant("rollout_correction_filters",
            {"rollout_correction": RolloutCorrection(level="token", rule="mask", lower=0.7, upper=1.4,
                                                     rejection={"seq_mean_k3": 0.03, "token_k1": (0.6, 1.6)}),
             "anchor": 0.35},
            ("old_logprobs", "rewards", "rollout_logprobs", "bias")),
    Variant("off_policy_entropy_masks_bias_corrected_kl",
            {"off_policy_mask_threshold": 0.05, "top_entropy_quantile": 0.5, "beta": 0.05, "kl_bias_correction": True,
             "rollout_correction": RolloutCorrection(upper=2.0)},
            ("old_logprobs", "rewards", "rollout_logprobs", "ref_logprobs")),
]
PATHS = ["gradients_in_forward", "recompute"]


def linear_cases() -> list[tuple[str, Variant, torch.dtype]]:
    """(loss type, variant, dtype) with every pair of the three present, not their
    product (as cases.pairwise_cases): every (loss type, variant) pair once, its dtype
    DTYPES[(l + v) % 4]. Each runs on both paths; the gradients-in-forward path then
    serves every objective of the token ratio form."""
    return [(loss_type, variant, DTYPES[(l_index + v_index) % len(DTYPES)])
            for l_index, loss_type in enumerate(LOSS_TYPES) for v_index, variant in enumerate(LINEAR_VARIANTS)]


LINEAR_CASES = linear_cases()


def test_the_linear_cases_cover_every_pair():
    seen = [(loss_type, str(variant), dtype) for loss_type, variant, dtype in LINEAR_CASES]
    axes = (LOSS_TYPES, [str(variant) for variant in LINEAR_VARIANTS], DTYPES)
    for first, second in ((0, 1), (0, 2), (1, 2)):
        pairs = {(case[first], case[second]) for case in seen}
        assert len(pairs) == len(axes[first]) * len(axes[second]), (first, second)
    token_level = {LossConfig.build(loss_type, objective=variant.options.get("objective")).objective
                   for loss_type, variant, _ in LINEAR_CASES
                   if not LossConfig.build(loss_type, objective=variant.options.get("objective")).sequence_level}
    assert token_level == {name for name, objective in OBJECTIVES.items() if "token" in objective.ratio_levels}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type, variant, dtype", LINEAR_CASES,
                         ids=[f"{loss_type}-{variant}-{str(dtype)[6:]}" for loss_type, variant, dtype in LINEAR_CASES])
def test_linear_loss_matches_reference(backend, device, loss_type, variant, dtype, path):
    _linear_loss_matches_reference(backend, device, loss_type, variant, dtype, path, check_values=False)


# Every variant once, each dtype among them (LINEAR_CASES' first loss type).
CHECKED_CASES = [case for case in LINEAR_CASES if case[0] == LOSS_TYPES[0]]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("loss_type, variant, dtype", CHECKED_CASES,
                         ids=[f"{loss_type}-{variant}-{str(dtype)[6:]}" for loss_type, variant, dtype in CHECKED_CASES])
def test_checked_linear_loss_matches_reference(backend, device, loss_type, variant, dtype, path):
    """The default call: its value checks count the active rows, which alone enter the
    GEMMs on the triton and torch backends (padding, with NaN hidden states and labels
    outside the vocabulary, then reaches no block at all)."""
    _linear_loss_matches_reference(backend, device, loss_type, variant, dtype, path, check_values=True)


def _linear_loss_matches_reference(backend, device, loss_type, variant, dtype, path, *, check_values):
    if path == "gradients_in_forward":
        if any(name in variant.options for name in ("off_policy_mask_threshold", "top_entropy_quantile",
                                                     "kl_bias_correction")):
            pytest.skip("the off-policy and entropy masks and the bias-corrected KL read the batch's log-probs "
                        "first: the recompute path")
        if OBJECTIVES[LossConfig.build(loss_type, objective=variant.options.get("objective")).objective].selects_tokens:
            pytest.skip("an objective that selects tokens reads the batch's log-probs first: the recompute path")
        if LossConfig.build(loss_type, objective=variant.options.get("objective")).sequence_level:
            pytest.skip("a sequence-level loss has no gradients-in-forward path (its token gradients need the "
                        "whole response)")
        if not load_backend(backend).has_gradients_in_forward(device):
            pytest.skip(f"backend {backend!r} has no gradients-in-forward path")
    data = linear_batch(11)
    if "masked_vocab" in variant.tensors:
        data = mask_vocabulary(data)
    variant_tensors = tuple(name for name in variant.tensors if name not in ("bias", "masked_vocab"))
    kwargs = loss_kwargs(data, loss_type, Variant(variant.name, variant.options, variant_tensors))
    mask, labels = data["response_mask"], data["labels"]
    bias = data["lm_head_bias"] if "bias" in variant.tensors else None

    def tensors(on, in_dtype):
        convert = (lambda t: None if t is None else t.to(dtype).to(in_dtype).to(on))
        return convert(data["hidden_states"]), convert(data["lm_head_weight"]), convert(bias)

    hidden, weight, lm_bias = tensors(device, dtype)
    on_device = cast(kwargs, dtype, device)
    fast = run_linear_loss(backend, hidden, weight, labels.to(device), mask.to(device), on_device,
                           lm_head_bias=lm_bias, linear_path=path, check_values=check_values)
    eager = reference_linear_loss(hidden, weight, labels.to(device), mask.to(device), on_device, lm_head_bias=lm_bias)
    hidden, weight, lm_bias = tensors(torch.device("cpu"), torch.float64)
    exact = reference_linear_loss(hidden, weight, labels, mask, rounded(kwargs, dtype), lm_head_bias=lm_bias)
    assert_conforms(fast, eager, exact, dtype)
    # Padding rows (hidden states NaN, labels outside the vocabulary) get exactly zero.
    assert torch.all(fast.values["grad_hidden"][~mask.to(device)] == 0)


def test_unit_upstream_gradient(backend, device):
    """``loss.backward()``: the stored gradients are returned unscaled (the CPU skips the
    multiplication by 1), as the reference's gradients times 1 / UPSTREAM."""
    data = linear_batch(7)
    kwargs = dict(advantages=data["advantages"].float().to(device), loss_type="grpo")
    mask, labels = data["response_mask"].to(device), data["labels"].to(device)
    hidden, weight = data["hidden_states"].float().to(device), data["lm_head_weight"].float().to(device)
    unit = run_linear_loss(backend, hidden, weight, labels, mask, kwargs, upstream=1.0)
    scaled = run_linear_loss(backend, hidden, weight, labels, mask, kwargs)
    for name in ("grad_hidden", "grad_weight"):
        torch.testing.assert_close(unit.values[name] * UPSTREAM, scaled.values[name], rtol=1e-6, atol=1e-9)
    assert torch.any(unit.values["grad_weight"] != 0)


def test_gradients_formed_in_forward_serve_one_backward(backend, device):
    """The stored gradients are scaled in place by the backward: a second backward of the
    same graph is refused, never silently scaled twice."""
    if not load_backend(backend).has_gradients_in_forward(device):
        pytest.skip(f"backend {backend!r} has no gradients-in-forward path")
    data = linear_batch(5)
    hidden = data["hidden_states"].float().to(device).requires_grad_()
    loss = fused_linear_hadw_grpo_loss(
        hidden, data["lm_head_weight"].float().to(device), data["labels"].to(device), None, None,
        data["response_mask"].to(device), advantages=data["advantages"].float().to(device), backend=backend,
        linear_path="gradients_in_forward",
    )
    (first,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    assert torch.isfinite(first).all()
    with pytest.raises(RuntimeError, match="already handed to a backward"):
        torch.autograd.grad(loss, hidden)
