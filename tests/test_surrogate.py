"""The reference surrogates: hand-computed values, an independent float64 computation,
degenerate inputs and gradient accumulation."""

import math

import pytest
import torch

from hadw_kernels import LOSS_PRESETS, LOSS_TYPES, fused_hadw_grpo_loss
from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.objectives.table import OBJECTIVES

# The loss types written out by hand here (the clip objective); the other objectives are
# held to their hosts' own code (tests/test_host_objectives.py) and their derivatives to
# autograd's (tests/test_objectives.py).
HAND_COMPUTED = ("grpo", "dapo", "gspo", "dr_grpo")

# --- hand-computed tiny case -----------------------------------------------------------
# Two responses (one group): the correct one has ratios 1.1 and 0.5 on two tokens, the
# wrong one ratio 1.3 on its single token.
STD_ADVANTAGE = 0.5 / (math.sqrt(0.5) + 1e-6)


def _tiny_case():
    old = torch.zeros(2, 2, dtype=torch.float64)
    logprobs = torch.tensor([[math.log(1.1), math.log(0.5)], [math.log(1.3), 123.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    return logprobs.requires_grad_(), old, rewards, mask


def _hand_values(loss_type, phi_correct=1.0, phi_wrong=1.0):
    a = STD_ADVANTAGE if loss_type != "dr_grpo" else 0.5
    pos, neg = a * phi_correct, a * phi_wrong  # |A| of the correct and the wrong response
    if loss_type == "grpo":  # 0.2/0.2: no token is clipped on the active side
        loss = 0.5 * ((-1.1 * pos - 0.5 * pos) / 2 + 1.3 * neg)
        grad = [[-1.1 * pos / 4, -0.5 * pos / 4], [1.3 * neg / 2, 0.0]]
    elif loss_type == "dapo":
        loss = (-1.1 * pos - 0.5 * pos + 1.3 * neg) / 3
        grad = [[-1.1 * pos / 3, -0.5 * pos / 3], [1.3 * neg / 3, 0.0]]
    elif loss_type == "dr_grpo":  # L_max = T = 2
        loss = (-1.1 * pos - 0.5 * pos + 1.3 * neg) / 2 / 2
        grad = [[-1.1 * pos / 4, -0.5 * pos / 4], [1.3 * neg / 4, 0.0]]
    else:  # gspo: s0 = sqrt(1.1 * 0.5) lies below 1 - 3e-4 with A > 0: unclipped
        s0 = math.sqrt(0.55)
        loss = 0.5 * (-s0 * pos + 1.3 * neg)
        # d l0 / d logp_tok = -A s0 / T0, averaged over B = 2
        grad = [[-pos * s0 / 2 / 2, -pos * s0 / 2 / 2], [1.3 * neg / 2, 0.0]]
    return loss, torch.tensor(grad, dtype=torch.float64)


@pytest.mark.parametrize("loss_type", HAND_COMPUTED)
@pytest.mark.parametrize("with_hadw", [False, True])
def test_loss_and_gradient_by_hand(loss_type, with_hadw):
    logprobs, old, rewards, mask = _tiny_case()
    anchor = 0.25 if with_hadw else None
    # p_hat = 0.5 > C = 0.25 (an easy prompt for this model): the correct response's
    # advantage is damped by exp(-0.25), the wrong one's amplified by exp(0.25).
    phis = (1.3 * math.exp(-0.25), 1.3 * math.exp(0.25)) if with_hadw else (1.0, 1.0)
    expected_loss, expected_grad = _hand_values(loss_type, *phis)
    loss = fused_hadw_grpo_loss(
        logprobs, old, rewards, mask, group_size=2, loss_type=loss_type, anchor=anchor, backend="torch"
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=1e-12)


# --- independent float64 computation ----------------------------------------------------


def _independent_loss_and_grad(logprobs, old, rewards, mask, group_size, loss_type, anchor, lam,
                               eps_low, eps_high, beta=0.0, ref=None, dual_clip=None):
    """Loops over Python floats with the gradient written out by hand (docs/math.md, section 5)."""
    batch, width = logprobs.shape
    lp, od, msk = logprobs.tolist(), old.tolist(), mask.tolist()
    rw = rewards.tolist()
    rf = ref.tolist() if ref is not None else None
    advantages = []
    for start in range(0, batch, group_size):
        group = rw[start:start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (group_size - 1))
        for r in group:
            a_hat = 0.0 if max(group) == min(group) else r - mean
            if loss_type != "dr_grpo" and a_hat != 0.0:
                a_hat /= std + 1e-6
            phi = 1.0
            if anchor is not None:
                sign_a = (a_hat > 0) - (a_hat < 0)
                diff = mean - anchor
                sign_d = (diff > 0) - (diff < 0)
                phi = lam * math.exp(-sign_a * sign_d * abs(diff))
            advantages.append(a_hat * phi)

    def branch(ratio, adv):
        """Token loss and d loss / d ratio on the active branch."""
        clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
        unclipped, clipped = -ratio * adv, -clipped_ratio * adv
        value, slope = (unclipped, -adv) if unclipped >= clipped else (clipped, 0.0)
        if dual_clip is not None and adv < 0 and -dual_clip * adv < value:
            value, slope = -dual_clip * adv, 0.0
        return value, slope

    lengths = [sum(row) for row in msk]
    total_tokens = max(sum(lengths), 1)
    loss, grad = 0.0, [[0.0] * width for _ in range(batch)]
    for i in range(batch):
        if loss_type == "gspo":
            if lengths[i] == 0:
                continue
            mean_log_ratio = sum(lp[i][t] - od[i][t] for t in range(width) if msk[i][t]) / lengths[i]
            ratio = math.exp(mean_log_ratio)
            value, slope = branch(ratio, advantages[i])
            loss += value / batch
            for t in range(width):
                if msk[i][t]:
                    grad[i][t] += slope * ratio / lengths[i] / batch
            token_weight = 1.0 / (max(lengths[i], 1) * batch)
        else:
            token_weight = {
                "grpo": 1.0 / (max(lengths[i], 1) * batch),
                "dapo": 1.0 / total_tokens,
                "dr_grpo": 1.0 / (width * batch),
            }[loss_type]
            for t in range(width):
                if msk[i][t]:
                    ratio = math.exp(lp[i][t] - od[i][t])
                    value, slope = branch(ratio, advantages[i])
                    loss += value * token_weight
                    grad[i][t] += slope * ratio * token_weight
        if beta > 0:
            for t in range(width):
                if msk[i][t]:
                    delta = rf[i][t] - lp[i][t]
                    loss += beta * (math.exp(delta) - delta - 1) * token_weight
                    grad[i][t] += beta * (1 - math.exp(delta)) * token_weight
    return loss, torch.tensor(grad, dtype=torch.float64)


def _random_batch(batch=12, width=9, group_size=4, dtype=torch.float64, drift=0.3):
    logprobs = -torch.rand(batch, width, dtype=torch.float64) * 3
    old = logprobs + drift * torch.randn(batch, width, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (batch,))
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    rewards = torch.randint(0, 2, (batch,)).double()
    return logprobs.to(dtype), old.to(dtype), rewards, mask


@pytest.mark.parametrize("loss_type", HAND_COMPUTED)
@pytest.mark.parametrize("anchor", [None, 0.35])
@pytest.mark.parametrize("extras", ["plain", "kl", "dual_clip"])
def test_matches_independent_float64_computation(loss_type, anchor, extras):
    logprobs, old, rewards, mask = _random_batch()
    # gspo's sequence ratio barely moves with its 3e-4 range unless the drift is small.
    if loss_type == "gspo":
        old = logprobs + 1e-3 * torch.randn_like(logprobs)
    ref = logprobs + 0.2 * torch.randn_like(logprobs) if extras == "kl" else None
    options = dict(
        beta=0.05 if extras == "kl" else 0.0,
        dual_clip=1.5 if extras == "dual_clip" else None,
    )
    eps = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "dr_grpo": (0.2, 0.2)}[loss_type]
    expected_loss, expected_grad = _independent_loss_and_grad(
        logprobs, old, rewards, mask, 4, loss_type, anchor, 1.3, *eps, ref=ref, **options
    )
    logprobs.requires_grad_()
    loss = fused_hadw_grpo_loss(
        logprobs, old, rewards, mask, group_size=4, loss_type=loss_type, anchor=anchor,
        ref_logprobs=ref, backend="torch", **options,
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss_type", [loss_type for loss_type in LOSS_TYPES
                                       if OBJECTIVES[LOSS_PRESETS[loss_type].objective].gradient != "detached_weight"])
def test_gradcheck(loss_type):
    logprobs, old, rewards, mask = _random_batch(batch=4, width=5, group_size=2)
    logprobs.requires_grad_()

    def loss_of(lp):
        return fused_hadw_grpo_loss(lp, old, rewards, mask, group_size=2, loss_type=loss_type, anchor=0.4)

    assert torch.autograd.gradcheck(loss_of, (logprobs,))


# --- degenerate inputs ------------------------------------------------------------------


def _vanishes_without_advantage(loss_type: str) -> bool:
    """Whether the preset's objective is 0 where A = 0 (dro's and kl_cov's penalties are not)."""
    config = LossConfig.build(loss_type)
    points = torch.linspace(-3.0, -0.1, 7, dtype=torch.float64)
    value = OBJECTIVES[config.objective].value(torch.exp(points - points.flip(0)), torch.zeros_like(points), points,
                                                points.flip(0), torch.ones_like(points), config)
    return bool(torch.all(value == 0))


@pytest.mark.parametrize("loss_type", [loss_type for loss_type in LOSS_TYPES if _vanishes_without_advantage(loss_type)])
def test_degenerate_groups_give_zero_gradient(loss_type):
    logprobs, old, _, mask = _random_batch(batch=8, width=6, group_size=4)
    rewards = torch.tensor([1.0, 1, 1, 1, 0.3, 0.3, 0.3, 0.3], dtype=torch.float64)
    logprobs.requires_grad_()
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, old, rewards, mask, group_size=4, loss_type=loss_type, anchor=0.5, return_metrics=True
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))
    assert metrics["zero_std_frac"].item() == 1.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_tokens_and_empty_responses_contribute_nothing(loss_type):
    logprobs, old, rewards, mask = _random_batch(batch=8, width=6, group_size=4)
    mask[2] = 0  # an empty response
    # Garbage under the mask must not leak into the loss or the gradient.
    poisoned = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, float("inf")))
    poisoned.requires_grad_()
    clean = logprobs.clone().requires_grad_()
    kwargs = dict(group_size=4, loss_type=loss_type, anchor=0.5)
    loss_poisoned = fused_hadw_grpo_loss(poisoned, old, rewards, mask, **kwargs)
    loss_clean = fused_hadw_grpo_loss(clean, old, rewards, mask, **kwargs)
    loss_poisoned.backward()
    loss_clean.backward()
    assert loss_poisoned.item() == loss_clean.item()
    assert torch.equal(poisoned.grad, clean.grad)
    assert torch.equal(poisoned.grad[~mask.bool()], torch.zeros(int((~mask.bool()).sum()), dtype=torch.float64))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_is_finite_with_zero_gradient(loss_type):
    logprobs, old, rewards, _ = _random_batch(batch=4, width=5, group_size=2)
    mask = torch.zeros(4, 5, dtype=torch.long)
    logprobs.requires_grad_()
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, old, rewards, mask, group_size=2, loss_type=loss_type, anchor=0.5, return_metrics=True
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))
    assert all(torch.isfinite(value) for value in metrics.values())


# --- options ----------------------------------------------------------------------------


def test_gradient_accumulation_with_token_normalizer_equals_big_batch_for_dapo():
    logprobs, old, rewards, mask = _random_batch(batch=16, width=10, group_size=4)
    kwargs = dict(group_size=4, loss_type="dapo", anchor=0.4)
    big = logprobs.clone().requires_grad_()
    big_loss = fused_hadw_grpo_loss(big, old, rewards, mask, **kwargs)
    big_loss.backward()

    micro = logprobs.clone().requires_grad_()
    total_tokens = int(mask.sum())
    accumulated = 0.0
    for rows in (slice(0, 4), slice(4, 12), slice(12, 16)):  # whole groups, uneven sizes
        part = fused_hadw_grpo_loss(
            micro[rows], old[rows], rewards[rows], mask[rows], loss_normalizer=total_tokens, **kwargs
        )
        part.backward()
        accumulated += part.item()
    assert accumulated == pytest.approx(big_loss.item(), rel=1e-12)
    torch.testing.assert_close(micro.grad, big.grad, rtol=1e-12, atol=1e-15)

    # Without the normaliser each micro-batch divides by its own token count: not equal.
    naive = sum(
        fused_hadw_grpo_loss(logprobs[r], old[r], rewards[r], mask[r], **kwargs).item()
        for r in (slice(0, 4), slice(4, 12), slice(12, 16))
    )
    assert naive != pytest.approx(big_loss.item(), rel=1e-3)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_token_importance_weights_scale_the_policy_term(loss_type):
    logprobs, old, rewards, mask = _random_batch(batch=8, width=6, group_size=4)
    weights = torch.rand(8, 6, dtype=torch.float64)
    kwargs = dict(group_size=4, loss_type=loss_type, anchor=None)
    weighted = fused_hadw_grpo_loss(logprobs, old, rewards, mask, importance_weights=weights, **kwargs)
    uniform = fused_hadw_grpo_loss(logprobs, old, rewards, mask, importance_weights=torch.ones(8), **kwargs)
    plain = fused_hadw_grpo_loss(logprobs, old, rewards, mask, **kwargs)
    assert uniform.item() == pytest.approx(plain.item(), rel=1e-12)
    assert weighted.item() != pytest.approx(plain.item(), rel=1e-6)


def test_dr_grpo_uses_configured_max_length():
    logprobs, old, rewards, mask = _random_batch(batch=4, width=6, group_size=2)
    by_width = fused_hadw_grpo_loss(logprobs, old, rewards, mask, group_size=2, loss_type="dr_grpo")
    by_max = fused_hadw_grpo_loss(
        logprobs, old, rewards, mask, group_size=2, loss_type="dr_grpo", max_response_length=12
    )
    assert by_max.item() == pytest.approx(by_width.item() / 2, rel=1e-12)


def test_metrics_by_hand():
    logprobs, old, rewards, mask = _tiny_case()
    _, metrics = fused_hadw_grpo_loss(
        logprobs, old, rewards, mask, group_size=2, anchor=0.25, return_metrics=True
    )
    # Tokens: ratio 1.1 (A>0), 0.5 (A>0: below 0.8 but the clip does not bind), 1.3 (A<0).
    assert metrics["clip_frac_low"].item() == 0.0
    assert metrics["clip_frac_high"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((1.1 + 0.5 + 1.3) / 3, rel=1e-6)
    k3 = [(r - 1) - math.log(r) for r in (1.1, 0.5, 1.3)]
    assert metrics["approx_kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-6)
    assert metrics["phi_mean"].item() == pytest.approx(1.3 * (math.exp(-0.25) + math.exp(0.25)) / 2, rel=1e-6)
    assert metrics["zero_std_frac"].item() == 0.0
