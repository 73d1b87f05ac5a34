"""The safe path the integrations use: per-response advantages computed once over the
whole rollout batch (hadw_advantages), then handed to the loss as ``advantages=``.

On whole, contiguous groups it equals the fused path from rewards. Split into
micro-batches that break groups apart, shuffle rows and are each padded to their own
width, with the rollout batch's count as ``loss_normalizer``, the micro-batch losses and
gradients add up to the one-batch loss and gradient: every loss type and aggregation
mode. The rewards path cannot tell shuffled rows; group_index makes it check them."""

import pytest
import torch

from hadw_kernels import (
    AGG_MODES,
    LOSS_PRESETS,
    LOSS_TYPES,
    fused_hadw_grpo_loss,
    fused_linear_hadw_grpo_loss,
    hadw_advantages,
)
from hadw_kernels.objectives.table import OBJECTIVES

GROUPS, GROUP_SIZE, WIDTH = 4, 4, 10
ANCHOR, LAMBDA = 0.35, 1.5


def rollout_batch(seed: int = 0):
    """fp64 tensors of one rollout batch: lengths from 0 (an empty response) to WIDTH,
    ratios wide enough to clip, binary rewards with one group all right."""
    generator = torch.Generator().manual_seed(seed)
    batch = GROUPS * GROUP_SIZE
    lengths = torch.randint(0, WIDTH + 1, (batch,), generator=generator)
    lengths[3] = WIDTH
    mask = torch.arange(WIDTH)[None, :] < lengths[:, None]
    old = -3 * torch.rand(batch, WIDTH, generator=generator, dtype=torch.float64)
    logprobs = old + 0.3 * torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64)
    rewards = torch.bernoulli(torch.full((batch,), 0.5, dtype=torch.float64), generator=generator)
    rewards[:GROUP_SIZE] = 1.0
    weights = 0.5 + torch.rand(batch, WIDTH, generator=generator, dtype=torch.float64)
    return dict(logprobs=logprobs, old=old, ref=ref, mask=mask, rewards=rewards, weights=weights)


def preset_advantages(data, loss_type, with_hadw):
    preset = LOSS_PRESETS[loss_type]
    return hadw_advantages(
        data["rewards"], group_size=GROUP_SIZE, anchor=ANCHOR if with_hadw else None, lambda_scale=LAMBDA,
        normalize_std=preset.normalize_std,
    )


def importance_weights(data, loss_type):
    """Per token, or one per response for a sequence-level loss (which refuses [B, T])."""
    return data["weights"][:, 0] if LOSS_PRESETS[loss_type].sequence_level else data["weights"]


def loss_and_gradient(rows, data, advantages, loss_type, mode, **options):
    """The loss on the given rows, cut to their own width, and its gradient written
    back into a full [B, T] tensor."""
    mask = data["mask"][rows]
    width = max(int(mask.sum(dim=1).max()), 1)
    logprobs = data["logprobs"][rows, :width].clone().requires_grad_()
    loss = fused_hadw_grpo_loss(
        logprobs, data["old"][rows, :width], None, mask[:, :width], advantages=advantages[rows],
        loss_type=loss_type, loss_agg_mode=mode, beta=0.1, ref_logprobs=data["ref"][rows, :width],
        importance_weights=weights[rows] if (weights := importance_weights(data, loss_type)).dim() == 1
        else weights[rows, :width], **options,
    )
    loss.backward()
    gradient = torch.zeros_like(data["logprobs"])
    gradient[rows, :width] = logprobs.grad
    return loss.detach(), gradient


@pytest.mark.parametrize("with_hadw", [False, True], ids=["grpo", "hadw"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_advantages_equal_the_rewards_path_on_whole_groups(loss_type, with_hadw):
    data = rollout_batch()
    results = []
    for inputs in (
        dict(rewards=data["rewards"], group_size=GROUP_SIZE, anchor=ANCHOR if with_hadw else None),
        dict(rewards=None, advantages=preset_advantages(data, loss_type, with_hadw)),
    ):
        logprobs = data["logprobs"].clone().requires_grad_()
        loss = fused_hadw_grpo_loss(
            logprobs, data["old"], response_mask=data["mask"], loss_type=loss_type, lambda_scale=LAMBDA,
            beta=0.1, ref_logprobs=data["ref"], importance_weights=importance_weights(data, loss_type), **inputs,
        )
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-12, atol=1e-14)


def whole_batch_count(mask, mode):
    """What loss_normalizer stands for in each mode (tables.aggregations.AGG_MODES)."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "token-sum":
        return 1.0
    return float(mask.shape[0])


@pytest.mark.parametrize("mode", AGG_MODES)
# An objective that selects tokens selects them per call (a micro-batch's statistic, as
# verl's): its micro-batches do not add up to the batch's loss, by definition.
@pytest.mark.parametrize("loss_type", [loss_type for loss_type in LOSS_TYPES
                                       if not OBJECTIVES[LOSS_PRESETS[loss_type].objective].selects_tokens])
def test_micro_batches_that_split_groups_and_shuffle_rows_add_up(loss_type, mode):
    data = rollout_batch(seed=1)
    advantages = preset_advantages(data, loss_type, with_hadw=True)
    options = dict(loss_normalizer=whole_batch_count(data["mask"], mode), max_response_length=WIDTH)
    everything = torch.arange(data["mask"].shape[0])
    expected_loss, expected_gradient = loss_and_gradient(everything, data, advantages, loss_type, mode, **options)

    order = torch.randperm(everything.numel(), generator=torch.Generator().manual_seed(2))
    # Uneven micro-batches whose borders fall inside groups of 4.
    micro_batches = torch.split(order, [3, 6, 2, 5])
    total_loss, total_gradient = 0.0, torch.zeros_like(expected_gradient)
    for rows in micro_batches:
        loss, gradient = loss_and_gradient(rows, data, advantages, loss_type, mode, **options)
        total_loss, total_gradient = total_loss + loss, total_gradient + gradient
    torch.testing.assert_close(total_loss, expected_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(total_gradient, expected_gradient, rtol=1e-12, atol=1e-14)


def test_linear_loss_micro_batches_add_up():
    generator = torch.Generator().manual_seed(4)
    data = rollout_batch(seed=3)
    batch, hidden, vocabulary = data["mask"].shape[0], 8, 13
    hidden_states = torch.randn(batch, WIDTH, hidden, generator=generator, dtype=torch.float64)
    head = torch.randn(vocabulary, hidden, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocabulary, (batch, WIDTH), generator=generator)
    advantages = preset_advantages(data, "dapo", with_hadw=True)
    tokens = float(data["mask"].sum())

    def loss_on(rows):
        return fused_linear_hadw_grpo_loss(
            hidden_states[rows], head, labels[rows], data["old"][rows], None, data["mask"][rows],
            advantages=advantages[rows], loss_type="dapo", loss_normalizer=tokens,
        )

    expected = loss_on(torch.arange(batch))
    (expected_gradient,) = torch.autograd.grad(expected, head)
    order = torch.randperm(batch, generator=generator)
    total = sum(loss_on(rows) for rows in torch.split(order, [7, 9]))
    (gradient,) = torch.autograd.grad(total, head)
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-12, atol=1e-14)


def test_rewards_path_checks_shuffled_rows_only_with_group_index():
    data = rollout_batch()
    order = torch.randperm(data["mask"].shape[0], generator=torch.Generator().manual_seed(5))
    group_index = torch.arange(GROUPS).repeat_interleave(GROUP_SIZE)
    shuffled = dict(logprobs=data["logprobs"][order], old_logprobs=data["old"][order],
                    rewards=data["rewards"][order], response_mask=data["mask"][order], group_size=GROUP_SIZE)
    # Without group_index the loss runs on wrong groups and cannot know it.
    wrong = fused_hadw_grpo_loss(**shuffled)
    right = fused_hadw_grpo_loss(data["logprobs"], data["old"], data["rewards"], data["mask"], group_size=GROUP_SIZE)
    assert not torch.allclose(wrong, right)
    with pytest.raises(ValueError, match="group"):
        fused_hadw_grpo_loss(**shuffled, group_index=group_index[order])
    fused_hadw_grpo_loss(data["logprobs"], data["old"], data["rewards"], data["mask"], group_size=GROUP_SIZE,
                         group_index=group_index)


@pytest.mark.parametrize("grouping", ["group_size", "group_index"])
@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(anchor=7.0), r"anchor must lie in \[0, 1\]"),
        (dict(anchor=float("nan")), r"anchor must lie in \[0, 1\]"),
        (dict(anchor=torch.tensor(7.0)), r"anchor must be finite and in \[0, 1\]"),
        (dict(anchor=torch.tensor(float("nan"))), r"anchor must be finite and in \[0, 1\]"),
        (dict(anchor=0.5, lambda_scale=-1.0), "lambda_scale must be a finite positive number"),
        (dict(lambda_scale=0.0), "lambda_scale must be a finite positive number"),
        (dict(std_eps=float("inf")), "std_eps must be a finite positive number"),
        (dict(anchor=0.5, rewards_scale=2.0), r"rewards must lie in \[0, 1\] with HA-DW"),
        (dict(anchor=0.5, rewards_shift=-1.0), r"rewards must lie in \[0, 1\] with HA-DW"),
        (dict(rewards_nan=True), "rewards contain NaN or inf"),
    ],
    ids=str,
)
def test_hadw_advantages_refuse_what_the_fused_loss_refuses(grouping, options, match):
    """The same checks and messages as the fused loss: hadw_advantages accepted each of
    these and returned finite (or NaN) advantages the loss itself would have refused."""
    options = dict(options)
    rewards = rollout_batch()["rewards"] * options.pop("rewards_scale", 1.0) + options.pop("rewards_shift", 0.0)
    if options.pop("rewards_nan", False):
        rewards = rewards.clone()
        rewards[5] = float("nan")
    grouping_kwargs = (dict(group_size=GROUP_SIZE) if grouping == "group_size"
                       else dict(group_index=torch.arange(rewards.numel()) // GROUP_SIZE))
    with pytest.raises(ValueError, match=match):
        hadw_advantages(rewards, **grouping_kwargs, **options)
    loss_options = {key: value for key, value in options.items() if key != "std_eps"}
    with pytest.raises(ValueError, match=match):  # the fused loss's own message
        batch = GROUPS * GROUP_SIZE
        fused_hadw_grpo_loss(torch.zeros(batch, 2), None, rewards, torch.ones(batch, 2), group_size=GROUP_SIZE,
                             std_eps=options.get("std_eps"), **loss_options)


def test_hadw_advantages_accept_rewards_outside_the_unit_interval_without_anchor():
    rewards = rollout_batch()["rewards"] * 3 - 1
    assert torch.isfinite(hadw_advantages(rewards, group_size=GROUP_SIZE)).all()


@pytest.mark.parametrize("as_ids", [list, lambda ids: ids.numpy()], ids=["list", "numpy"])
def test_hadw_advantages_take_group_index_as_a_list_or_a_numpy_array(as_ids):
    """A list raised AttributeError and a numpy array "group_index is on cpu, rewards on
    cpu": both are converted, and give the tensor's advantages."""
    rewards = rollout_batch()["rewards"]
    order = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(3))
    group_index = (torch.arange(rewards.numel()) // GROUP_SIZE)[order]
    expected = hadw_advantages(rewards[order], group_index=group_index, anchor=ANCHOR)
    ids = as_ids(group_index) if as_ids is not list else group_index.tolist()
    assert torch.equal(hadw_advantages(rewards[order], group_index=ids, anchor=ANCHOR), expected)


@pytest.mark.parametrize("group_index, error, match", [
    (["a", "a", "b", "b"] * GROUP_SIZE, TypeError, "group_index must be integer ids"),
    ([0.0, 0.0, 1.0, 1.0] * GROUP_SIZE, TypeError, "group_index must hold integers"),
    ([0, 0, 1, 1], ValueError, r"group_index has shape \(4,\), rewards \(16,\)"),
], ids=["strings", "floats", "short"])
def test_hadw_advantages_refuse_a_group_index_that_is_not_integer_ids(group_index, error, match):
    with pytest.raises(error, match=match):
        hadw_advantages(rollout_batch()["rewards"], group_index=group_index)


def test_the_group_metrics_come_with_rewards_only():
    """README.md lists phi_mean and zero_std_frac as the rewards path's only: given
    advantages, the loss cannot see the groups."""
    from hadw_kernels.tables.metrics import GROUP_METRICS

    data = rollout_batch()
    common = dict(anchor=None, return_metrics=True)
    _, with_rewards = fused_hadw_grpo_loss(data["logprobs"], data["old"], data["rewards"], data["mask"],
                                           group_size=GROUP_SIZE, **common)
    _, with_advantages = fused_hadw_grpo_loss(data["logprobs"], data["old"], None, data["mask"],
                                              advantages=preset_advantages(data, "grpo", False), **common)
    assert set(GROUP_METRICS) <= set(with_rewards)
    assert set(with_rewards) - set(with_advantages) == set(GROUP_METRICS)
