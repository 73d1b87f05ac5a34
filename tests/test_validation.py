"""Bad calls fail before any computation, with a message that names the problem."""

import pytest
import torch

from hadw_kernels import fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss


def _inputs(batch=4, width=3):
    return dict(
        logprobs=torch.zeros(batch, width),
        old_logprobs=torch.zeros(batch, width),
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0])[:batch],
        response_mask=torch.ones(batch, width),
    )


def _call(group_size=2, **overrides):
    inputs = _inputs()
    options = {k: overrides.pop(k) for k in list(overrides) if k not in inputs}
    inputs.update(overrides)
    return fused_hadw_grpo_loss(**inputs, group_size=group_size, **options)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(group_size=3), ValueError, "not divisible by group_size=3"),
        (dict(group_size=1), ValueError, "at least 2"),
        (dict(old_logprobs=torch.zeros(4, 2)), ValueError, "old_logprobs has shape"),
        (dict(response_mask=torch.ones(4, 2)), ValueError, "response_mask has shape"),
        (dict(rewards=torch.zeros(4, 1)), ValueError, r"rewards must be \[B\]"),
        (dict(rewards=torch.zeros(2)), ValueError, r"rewards must be \[B\]"),
        (dict(logprobs=torch.zeros(4, 3, 1), old_logprobs=torch.zeros(4, 3, 1)), ValueError, r"\[B, T\]"),
        (dict(response_mask=torch.full((4, 3), 0.5)), ValueError, "only 0 and 1"),
        (dict(rewards=torch.tensor([1.0, float("nan"), 0.0, 1.0])), ValueError, "NaN or inf"),
        (dict(rewards=torch.tensor([1.0, float("inf"), 0.0, 1.0])), ValueError, "NaN or inf"),
        (dict(loss_type="ppo"), ValueError, "unknown loss_type"),
        (dict(epsilon_low=-0.1), ValueError, "non-negative"),
        (dict(epsilon_high=-0.1), ValueError, "non-negative"),
        (dict(lambda_scale=0.0), ValueError, "lambda_scale must be positive"),
        (dict(lambda_scale=-1.0), ValueError, "lambda_scale must be positive"),
        (dict(dual_clip=0.5), ValueError, "dual_clip"),
        (dict(beta=0.1), ValueError, "needs ref_logprobs"),
        (dict(anchor=torch.zeros(2)), ValueError, "0-d tensor"),
        (dict(anchor="0.5"), TypeError, "anchor"),
        (dict(anchor=float("nan")), ValueError, "anchor must be finite"),
        (dict(importance_weights=torch.ones(4, 2)), ValueError, "importance_weights"),
        (dict(importance_weights=torch.ones(4, 3), loss_type="gspo"), ValueError, "importance_weights"),
        (dict(logprobs=torch.zeros(4, 3, dtype=torch.long)), TypeError, "floating-point"),
        (dict(loss_normalizer=0), ValueError, "loss_normalizer"),
        (dict(backend="cuda-magic"), ValueError, "unknown backend"),
    ],
)
def test_bad_input_raises(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_bool_mask_is_accepted():
    assert torch.isfinite(_call(response_mask=torch.ones(4, 3, dtype=torch.bool)))


def test_value_checks_can_be_skipped_for_hot_loops():
    # With the checks off the caller owns the inputs; the call itself must still run.
    loss = _call(response_mask=torch.ones(4, 3), check_values=False)
    assert torch.isfinite(loss)


def _linear_inputs():
    return dict(
        hidden_states=torch.zeros(4, 3, 8),
        lm_head_weight=torch.zeros(16, 8),
        labels=torch.zeros(4, 3, dtype=torch.long),
        old_logprobs=torch.zeros(4, 3),
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        response_mask=torch.ones(4, 3),
    )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(lm_head_weight=torch.zeros(16, 7)), ValueError, "H = 8"),
        (dict(hidden_states=torch.zeros(12, 8)), ValueError, r"\[B, T, H\]"),
        (dict(labels=torch.zeros(4, 2, dtype=torch.long)), ValueError, "labels must be"),
        (dict(labels=torch.zeros(4, 3)), TypeError, "int64"),
        (dict(labels=torch.full((4, 3), 16)), ValueError, r"labels must lie in \[0, 16\)"),
        (dict(lm_head_weight=torch.zeros(16, 8, dtype=torch.float64)), TypeError, "share a dtype"),
        (dict(old_logprobs=torch.zeros(4, 2)), ValueError, "old_logprobs has shape"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(lm_head_bias=torch.zeros(15)), ValueError, "lm_head_bias"),
        (dict(lm_head_bias=torch.zeros(16, dtype=torch.float64)), TypeError, "lm_head_bias"),
        (dict(entropy_coef=-0.1), ValueError, "entropy_coef"),
    ],
)
def test_bad_linear_input_raises(overrides, error, match):
    inputs = _linear_inputs()
    options = {k: overrides.pop(k) for k in list(overrides) if k not in inputs}
    inputs.update(overrides)
    with pytest.raises(error, match=match):
        fused_linear_hadw_grpo_loss(**inputs, group_size=2, **options)
