"""Bad calls fail before any computation, with a message that names the problem."""

import numpy as np
import pytest
import torch

from hadw_kernels import fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss, hadw_advantages, token_logprobs


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
        (dict(response_mask=torch.ones(4, 2)), ValueError, r"logprobs has shape \(4, 3\), response_mask \(4, 2\)"),
        (dict(rewards=torch.zeros(4, 1)), ValueError, r"rewards must be \[B\]"),
        (dict(rewards=torch.zeros(2)), ValueError, r"rewards must be \[B\]"),
        (dict(logprobs=torch.zeros(4, 3, 1), old_logprobs=torch.zeros(4, 3, 1)), ValueError,
         r"logprobs has shape \(4, 3, 1\), response_mask \(4, 3\)"),
        (dict(response_mask=torch.full((4, 3), 0.5)), ValueError, "only 0 and 1"),
        (dict(rewards=torch.tensor([1.0, float("nan"), 0.0, 1.0])), ValueError, "NaN or inf"),
        (dict(rewards=torch.tensor([1.0, float("inf"), 0.0, 1.0])), ValueError, "NaN or inf"),
        (dict(loss_type="ppo"), ValueError, "unknown loss_type"),
        (dict(epsilon_low=-0.1), ValueError, "non-negative"),
        (dict(epsilon_high=-0.1), ValueError, "non-negative"),
        (dict(lambda_scale=0.0), ValueError, "lambda_scale must be a finite positive"),
        (dict(lambda_scale=-1.0), ValueError, "lambda_scale must be a finite positive"),
        (dict(lambda_scale=float("inf")), ValueError, "lambda_scale must be a finite positive"),
        (dict(dual_clip=0.5), ValueError, "dual_clip"),
        (dict(beta=0.1), ValueError, "needs ref_logprobs"),
        (dict(anchor=torch.zeros(2)), ValueError, "0-d tensor"),
        (dict(anchor="0.5"), TypeError, "anchor"),
        (dict(anchor=float("nan")), ValueError, r"anchor must lie in \[0, 1\]"),
        (dict(importance_weights=torch.ones(4, 2)), ValueError, "importance_weights"),
        (dict(anchor=True), TypeError, "anchor must be a float"),
        (dict(anchor=1.5), ValueError, r"anchor must lie in \[0, 1\]"),
        (dict(anchor=torch.tensor(-0.2)), ValueError, "anchor must be finite and in"),
        (dict(anchor=torch.tensor(float("nan"))), ValueError, "anchor must be finite and in"),
        (dict(rewards=None, advantages=torch.tensor([0.0, float("-inf"), 0.0, 1.0])), ValueError,
         "advantages contain NaN or inf"),
        (dict(anchor=0.5, rewards=torch.tensor([1.0, 0.0, 5.0, 1.0])), ValueError, r"rewards must lie in \[0, 1\]"),
        (dict(loss_agg_mode="seq-sum"), ValueError, "unknown loss_agg_mode"),
        (dict(kl_estimator="k4"), ValueError, "unknown kl_estimator"),
        (dict(std_eps=0.0), ValueError, "std_eps"),
        (dict(max_response_length=2.5), TypeError, "max_response_length must be an int"),
        (dict(max_response_length=0), ValueError, "max_response_length must be positive"),
        (dict(loss_normalizer=float("inf")), ValueError, "loss_normalizer"),
        (dict(rewards=None), ValueError, "exactly one of rewards"),
        (dict(advantages=torch.zeros(4)), ValueError, "exactly one of rewards"),
        (dict(rewards=None, advantages=torch.zeros(4), anchor=0.5), ValueError, "fold Phi in"),
        (dict(rewards=None, advantages=torch.zeros(3)), ValueError,
         r"advantages has shape \(3,\), response_mask \(4, 3\).*or one advantage per response, \[4\]"),
        (dict(group_index=torch.tensor([0, 1, 0, 1])), ValueError, "not in contiguous groups"),
        (dict(group_size=None), ValueError, "need group_size"),
        (dict(logprobs=torch.zeros(4, 3, dtype=torch.long)), TypeError, "floating-point"),
        (dict(loss_normalizer=0), ValueError, "loss_normalizer"),
        (dict(backend="cuda-magic"), ValueError, "unknown backend"),
        (dict(loss_type="sapo", sapo_temperature_pos=1e-40), ValueError, r"sapo_temperature_pos must lie in \[1e-30"),
        (dict(loss_type="sapo", sapo_temperature_neg=1e40), ValueError, r"sapo_temperature_neg must lie in \[1e-30"),
    ],
)
def test_bad_input_raises(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_rewards_outside_zero_one_are_accepted_without_hadw():
    assert torch.isfinite(_call(rewards=torch.tensor([3.0, -1.0, 2.0, 7.5])))


def test_matching_group_index_is_accepted():
    assert torch.isfinite(_call(group_index=torch.tensor([7, 7, 3, 3])))


def test_unknown_option_in_a_config_built_directly_is_rejected():
    from hadw_kernels.config.loss_config import LossConfig

    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        LossConfig(group_size=2, normalize_std=True, loss_agg_mode="grpo", epsilon_low=0.2,
                   epsilon_high=0.2).validate()


def test_bool_mask_is_accepted():
    assert torch.isfinite(_call(response_mask=torch.ones(4, 3, dtype=torch.bool)))


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
@pytest.mark.parametrize("name", ["logprobs", "old_logprobs"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_logprobs_are_refused_at_response_tokens_only(mask_dtype, name, poison):
    mask = torch.ones(4, 3, dtype=mask_dtype)
    mask[1, 2] = 0
    values = torch.zeros(4, 3)
    values[1, 2] = poison  # masked out: accepted
    assert torch.isfinite(_call(response_mask=mask, **{name: values}))
    values[2, 0] = poison
    with pytest.raises(ValueError, match=f"^{name} contain NaN or inf at response tokens"):
        _call(response_mask=mask, **{name: values})


def _batch(loss, layout):
    """The inputs of ``loss`` ("surrogate" or "linear") in ``layout``: padded [4, 3] with one
    padding position, or packed over N = 7 tokens (prompt tokens masked out)."""
    if layout == "padded":
        mask = torch.ones(4, 3)
        mask[1, 2] = 0
        inputs = dict(old_logprobs=torch.zeros(4, 3), rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), response_mask=mask)
    else:
        inputs = {k: v for k, v in _packed_inputs().items() if k != "logprobs"}
    shape = inputs["response_mask"].shape
    if loss == "surrogate":
        return dict(inputs, logprobs=torch.zeros(shape)), fused_hadw_grpo_loss
    return dict(inputs, hidden_states=torch.zeros(*shape, 8), lm_head_weight=torch.zeros(16, 8),
                labels=torch.zeros(shape, dtype=torch.long)), fused_linear_hadw_grpo_loss


def _unread_and_read(mask):
    """A position the loss does not read (padding, a prompt token) and one it does."""
    unread = (mask == 0).nonzero()[0].tolist()
    read = (mask != 0).nonzero()[0].tolist()
    return tuple(unread), tuple(read)


@pytest.mark.parametrize("loss", ["surrogate", "linear"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name, options", [
    ("ref_logprobs", dict(beta=0.04)), ("importance_weights", {}), ("advantages", {}),
])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_every_per_token_input_is_checked_at_the_tokens_it_counts(loss, layout, name, options, poison):
    """The reference log-probs (read with a KL term), per-token importance weights and
    per-token advantages: a NaN or inf where the loss reads them is refused, naming the
    input; where it does not (padding, a prompt token), accepted, as for the log-probs."""
    inputs, function = _batch(loss, layout)
    mask = inputs["response_mask"]
    values = torch.ones(mask.shape) if name == "importance_weights" else torch.zeros(mask.shape)
    if name == "advantages":
        inputs["rewards"] = None
    unread, read = _unread_and_read(mask)
    values[unread] = poison
    group_size = None if name == "advantages" else 2
    assert torch.isfinite(function(**inputs, **{name: values}, group_size=group_size, **options))
    values[read] = poison
    with pytest.raises(ValueError, match=f"^{name} contain NaN or inf at response tokens"):
        function(**inputs, **{name: values}, group_size=group_size, **options)


@pytest.mark.parametrize("loss", ["surrogate", "linear"])
def test_reference_log_probs_are_not_read_without_a_kl_term(loss):
    inputs, function = _batch(loss, "padded")
    assert torch.isfinite(function(**inputs, ref_logprobs=torch.full((4, 3), float("nan")), group_size=2))


@pytest.mark.parametrize("loss", ["surrogate", "linear"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_per_response_importance_weights_must_be_finite(loss, layout):
    inputs, function = _batch(loss, layout)
    with pytest.raises(ValueError, match="^importance_weights contain NaN or inf$"):
        function(**inputs, importance_weights=torch.tensor([1.0, float("inf"), 1.0, 1.0]), group_size=2)


def test_finite_logprobs_whose_sum_overflows_are_accepted():
    """The value checks screen the log-probs with one sum over all positions; finite
    values that overflow it are still finite inputs."""
    loss = _call(logprobs=torch.full((4, 3), -3e38))
    assert loss.dim() == 0


@pytest.mark.parametrize("name", ["advantages", "importance_weights", "rewards"])
def test_finite_per_response_values_whose_sum_overflows_are_accepted(name):
    """Per-response values join the same screen (rewards without HA-DW too: their range
    is read only with an anchor); finite values that overflow it are accepted, and a
    NaN among them still refused."""
    large = torch.tensor([3e38, 3e38, -1.0, 0.0])
    overrides = {"rewards": None, "advantages": large} if name == "advantages" else {name: large}
    assert _call(**overrides).dim() == 0
    with pytest.raises(ValueError, match=f"^{name} contain NaN or inf$"):
        _call(**{key: torch.where(value == 0, float("nan"), value) if key == name else value
                 for key, value in overrides.items()})


def test_finite_hidden_states_whose_sum_overflows_are_accepted():
    """The linear loss's hidden states join the screen too."""
    hidden = torch.full((4, 3, 2), 3e38)
    weight = torch.zeros(5, 2)
    loss = fused_linear_hadw_grpo_loss(hidden, weight, torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3),
                                       torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 3), group_size=2,
                                       backend="torch")
    assert loss.dim() == 0


@pytest.mark.parametrize("bad", [2.0, -1.0, float("nan")])
def test_mask_values_other_than_zero_and_one_are_refused(bad):
    mask = torch.ones(4, 3)
    mask[3, 1] = bad
    with pytest.raises(ValueError, match="only 0 and 1"):
        _call(response_mask=mask)


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
        (dict(labels=torch.zeros(4, 2, dtype=torch.long)), ValueError, r"labels has shape \(4, 2\), response_mask"),
        (dict(labels=torch.zeros(4, 3)), TypeError, "int64"),
        (dict(labels=torch.full((4, 3), 16)), ValueError, r"labels must lie in \[0, 16\)"),
        (dict(lm_head_weight=torch.zeros(16, 8, dtype=torch.float64)), TypeError, "share a dtype"),
        (dict(old_logprobs=torch.zeros(4, 2)), ValueError, "old_logprobs has shape"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(block_rows=0), ValueError, "block_rows"),
        (dict(linear_path="fast"), ValueError, "unknown linear_path"),
        (dict(linear_path="gradients_in_forward", loss_type="gspo"), ValueError, "needs a token ratio: with ratio_level=.gspo_token."),
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


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_hidden_states_are_refused_at_response_tokens_only(poison):
    inputs = _linear_inputs()
    inputs["response_mask"][1, 2] = 0
    inputs["hidden_states"][1, 2, 5] = poison  # a padding row: accepted
    assert torch.isfinite(fused_linear_hadw_grpo_loss(**inputs, group_size=2))
    inputs["hidden_states"][2, 0, 1] = poison
    with pytest.raises(ValueError, match="hidden_states contain NaN or inf at response tokens"):
        fused_linear_hadw_grpo_loss(**inputs, group_size=2)


def test_finite_half_precision_inputs_pass_the_screen(monkeypatch):
    """The screening sum runs in fp32 at least: in fp16 it would overflow (65504) at a few
    thousand tokens and send every call down the masked checks."""
    import hadw_kernels.checks.values as value_checks

    def masked_check(*_):
        raise AssertionError("the masked checks ran for finite inputs")

    monkeypatch.setattr(value_checks, "_nonfinite_at", masked_check)
    inputs = dict(logprobs=torch.full((4, 3000), -30.0, dtype=torch.float16),
                  old_logprobs=torch.zeros(4, 3000, dtype=torch.float16),
                  rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), response_mask=torch.ones(4, 3000, dtype=torch.bool))
    assert torch.isfinite(fused_hadw_grpo_loss(**inputs, group_size=2, backend="torch"))


@pytest.mark.parametrize(
    ("module", "options", "match"),
    [
        ("HADWGRPOLoss", dict(loss_type="ppo"), "unknown loss_type"),
        ("HADWGRPOLoss", dict(loss_agg_mode="mean"), "unknown loss_agg_mode"),
        ("HADWGRPOLoss", dict(kl_estimator="k4"), "unknown kl_estimator"),
        ("HADWGRPOLoss", dict(lambda_scale=0.0), "lambda_scale"),
        ("HADWGRPOLoss", dict(lambda_scale=-1.0), "lambda_scale"),
        ("HADWGRPOLoss", dict(epsilon_low=-1.0), r"epsilon_low \(clip range\) must be a finite non-negative"),
        ("HADWGRPOLoss", dict(group_size=1), "group_size must be at least 2"),
        ("HADWGRPOLoss", dict(backend="cuda"), "unknown backend"),
        ("HADWGRPOLoss", dict(loss_normalizer=0.0), "loss_normalizer"),
        ("LinearHADWGRPOLoss", dict(loss_type="ppo"), "unknown loss_type"),
        ("LinearHADWGRPOLoss", dict(temperature=0.0), "temperature"),
        ("LinearHADWGRPOLoss", dict(linear_path="fast"), "unknown linear_path"),
        ("LinearHADWGRPOLoss", dict(block_rows=0), "block_rows"),
        ("LinearHADWGRPOLoss", dict(entropy_coef=-0.1), "entropy_coef"),
        ("LinearHADWGRPOLoss", dict(backend="gpu"), "unknown backend"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_modules_check_their_options_when_built(module, options, match):
    """A bad option fails where the module is built, with the message a call would give."""
    import hadw_kernels

    with pytest.raises((ValueError, TypeError), match=match):
        getattr(hadw_kernels, module)(**options)


def test_modules_accept_good_options():
    from hadw_kernels import HADWGRPOLoss, LinearHADWGRPOLoss

    HADWGRPOLoss(loss_type="dapo", group_size=4, beta=0.04, backend="torch")
    LinearHADWGRPOLoss(loss_type="gspo", temperature=0.7, block_rows=64, linear_path="recompute", entropy_coef=0.01)


def test_sequence_ratios_take_per_token_importance_weights():
    """Both sequence ratio forms take [B, T] importance weights (TRL's and verl's
    semantics: docs/math.md, section 5): constant over each response they equal the [B]
    weights; varying within a response, the two forms part."""
    from hadw_kernels import fused_hadw_grpo_loss

    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 3, dtype=torch.float64, generator=generator)
    old = logprobs - 0.1 * torch.rand(4, 3, dtype=torch.float64, generator=generator)
    per_response = torch.tensor([0.5, 1.5, 2.0, 1.0], dtype=torch.float64)
    varying = torch.rand(4, 3, dtype=torch.float64, generator=generator) + 0.5

    def gradient(ratio_level, weights):
        leaf = logprobs.clone().requires_grad_()
        fused_hadw_grpo_loss(leaf, old, torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.ones(4, 3), group_size=2,
                             loss_type="gspo", epsilon_low=0.2, epsilon_high=0.2, ratio_level=ratio_level,
                             importance_weights=weights, backend="torch").backward()
        return leaf.grad

    for ratio_level in ("sequence", "gspo_token"):
        torch.testing.assert_close(gradient(ratio_level, per_response[:, None].expand(4, 3)),
                                   gradient(ratio_level, per_response))
    assert not torch.allclose(gradient("sequence", varying), gradient("gspo_token", varying))


def _packed_inputs():
    """Four segments over N = 7 tokens (one empty), as a packed trainer passes them."""
    return dict(
        logprobs=torch.zeros(7),
        old_logprobs=torch.zeros(7),
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        response_mask=torch.tensor([False, True, True, True, True, False, True]),
        cu_seqlens=torch.tensor([0, 3, 3, 5, 7]),
    )


@pytest.mark.parametrize("check_values", [True, False])
@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(cu_seqlens=torch.tensor([1, 3, 3, 5, 7])), ValueError, "cu_seqlens does not start at 0"),
        (dict(cu_seqlens=torch.tensor([0, 3, 3, 5, 6])), ValueError, r"cu_seqlens does not end at N = 7"),
        (dict(cu_seqlens=torch.tensor([0, 3, 2, 5, 7])), ValueError, "cu_seqlens decreases"),
        (dict(cu_seqlens=torch.tensor([0.0, 3, 3, 5, 7])), TypeError, "cu_seqlens must be int32 or int64"),
        (dict(cu_seqlens=torch.tensor([[0, 3, 3, 5, 7]])), ValueError, r"cu_seqlens must be \[S\+1\]"),
        (dict(cu_seqlens=torch.zeros(0, dtype=torch.int64)), ValueError, r"cu_seqlens must be \[S\+1\]"),
        (dict(cu_seqlens=torch.tensor([0, 3, 3, 5, 7], device="meta")), ValueError, "cu_seqlens is on meta"),
        (dict(cu_seqlens=[0, 3, 3, 5, 7]), TypeError, "cu_seqlens must be a torch.Tensor"),
        (dict(rewards=torch.tensor([1.0, 0.0, 1.0])), ValueError, r"rewards must be \[S\] = \[4\], one per segment"),
        (dict(advantages=torch.zeros(5), rewards=None), ValueError,
         r"advantages has shape \(5,\), but this call is packed.*or one advantage per response, \[4\]"),
        (dict(group_index=torch.tensor([0, 0, 1])), ValueError, r"group_index must be \[S\] = \[4\]"),
        (dict(importance_weights=torch.ones(6)), ValueError, r"importance_weights has shape \(6,\).*\[4\]"),
        (dict(old_logprobs=torch.zeros(4, 2)), ValueError, r"old_logprobs has shape \(4, 2\), but this call is packed"),
        (dict(logprobs=torch.zeros(2, 7)), ValueError, r"logprobs has shape \(2, 7\), but this call is packed"),
        (dict(response_mask=torch.ones(2, 7)), ValueError, r"response_mask has shape \(2, 7\), but this call is packed"),
        (dict(ref_logprobs=torch.zeros(6), beta=0.1), ValueError, r"ref_logprobs has shape \(6,\)"),
        (dict(loss_type="dr_grpo"), ValueError, "pass max_response_length"),
        (dict(loss_agg_mode="seq-mean-token-sum-norm"), ValueError, "pass max_response_length"),
        (dict(cu_seqlens=None), ValueError, r"response_mask must be \[B, T\].*packed batch passes cu_seqlens"),
    ],
)
def test_bad_packed_input_raises(overrides, error, match, check_values):
    """Packed calls are refused before compute, naming the argument; the offsets' values
    also with check_values=False (the kernels would read outside the tensors)."""
    inputs = dict(_packed_inputs(), **overrides)
    with pytest.raises(error, match=match):
        fused_hadw_grpo_loss(**inputs, group_size=None if inputs["rewards"] is None else 2,
                             check_values=check_values)


def test_packed_values_are_checked_in_the_read():
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        fused_hadw_grpo_loss(**dict(_packed_inputs(), response_mask=torch.full((7,), 0.5)), group_size=2)
    logprobs = torch.zeros(7)
    logprobs[0] = float("nan")  # a prompt token: masked out
    fused_hadw_grpo_loss(**dict(_packed_inputs(), logprobs=logprobs), group_size=2)
    logprobs[1] = float("nan")
    with pytest.raises(ValueError, match="logprobs contain NaN or inf at response tokens"):
        fused_hadw_grpo_loss(**dict(_packed_inputs(), logprobs=logprobs[None]), group_size=2)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_states=torch.zeros(2, 7, 8)), r"hidden_states has shape \(2, 7, 8\), but this call is packed"),
        (dict(hidden_states=torch.zeros(6, 8)), r"hidden_states has shape \(6, 8\).*N = 7"),
        (dict(labels=torch.zeros(6, dtype=torch.long)), r"labels has shape \(6,\), but this call is packed"),
        (dict(cu_seqlens=torch.tensor([0, 3, 3, 5, 8])), "cu_seqlens does not end at N = 7"),
    ],
)
def test_bad_packed_linear_input_raises(overrides, match):
    packed = _packed_inputs()
    inputs = dict(hidden_states=torch.zeros(7, 8), lm_head_weight=torch.zeros(16, 8),
                  labels=torch.zeros(7, dtype=torch.long), old_logprobs=packed["old_logprobs"],
                  rewards=packed["rewards"], response_mask=packed["response_mask"], cu_seqlens=packed["cu_seqlens"])
    inputs.update(overrides)
    for check_values in (True, False):
        with pytest.raises(ValueError, match=match):
            fused_linear_hadw_grpo_loss(**inputs, group_size=2, check_values=check_values)


class _GeneratorOnCuda(torch.Generator):
    """A CPU generator that reports a CUDA device: another device than CPU inputs' (a real
    CUDA generator needs a GPU)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _drawing_batch(loss):
    """Inputs whose counted tokens' covariances spread over (-1, 1): some fall in the band
    (-10, 10), none in (100, 200)."""
    generator = torch.Generator().manual_seed(0)
    inputs = _linear_inputs() if loss == "linear" else _inputs()
    if loss == "linear":
        inputs["hidden_states"] = torch.randn(4, 3, 8, generator=generator)
        inputs["lm_head_weight"] = torch.randn(16, 8, generator=generator)
    else:
        inputs["logprobs"] = -torch.rand(4, 3, generator=generator)
    return inputs


@pytest.mark.parametrize("loss", ["surrogate", "linear"])
@pytest.mark.parametrize("options", [dict(loss_type="clip_cov", clip_cov_lb=-10.0, clip_cov_ub=10.0),
                                     dict(loss_type="clip_cov", clip_cov_lb=100.0, clip_cov_ub=200.0), dict(loss_type="kl_cov"), dict(loss_type="grpo")],
                         ids=["clip_cov-draws", "clip_cov-no-candidate", "kl_cov", "grpo"])
@pytest.mark.parametrize("generator, error, match", [
    ("0", TypeError, r"generator must be a torch.Generator \(or None: torch's global one\), got builtins.str"),
    (7, TypeError, "generator must be a torch.Generator .*got builtins.int"),
    (np.random.default_rng(0), TypeError, "generator must be a torch.Generator .*got numpy.random"),
    (_GeneratorOnCuda(), ValueError, "generator is on cuda:0, the inputs on cpu"),
], ids=["str", "int", "numpy", "other-device"])
def test_a_generator_that_is_not_a_torch_generator_of_the_inputs_is_refused(loss, options, generator, error, match):
    """Refused before any computation, by every objective, whether it draws or not: a
    wrong value must not pass silently on the calls that happen to draw nothing."""
    call = fused_linear_hadw_grpo_loss if loss == "linear" else fused_hadw_grpo_loss
    inputs = _drawing_batch(loss)
    assert call(**inputs, group_size=2, generator=torch.Generator().manual_seed(0), **options).isfinite()
    with pytest.raises(error, match=match):
        call(**inputs, group_size=2, generator=generator, **options)


@pytest.mark.parametrize("call", ["surrogate", "surrogate-unchecked", "linear", "token_logprobs", "hadw_advantages"])
def test_meta_tensors_are_refused_by_name(call):
    """The meta device holds shapes, no values: refused with the reason, not with torch's
    "Tensor.item() cannot be called on meta tensors" from inside a check."""
    meta = {name: value.to("meta") for name, value in _inputs().items()}
    linear = {name: value.to("meta") for name, value in _linear_inputs().items()}
    run = {
        "surrogate": lambda: fused_hadw_grpo_loss(**meta, group_size=2),
        "surrogate-unchecked": lambda: fused_hadw_grpo_loss(**meta, group_size=2, check_values=False),
        "linear": lambda: fused_linear_hadw_grpo_loss(**linear, group_size=2),
        "token_logprobs": lambda: token_logprobs(linear["hidden_states"], linear["lm_head_weight"], linear["labels"]),
        "hadw_advantages": lambda: hadw_advantages(meta["rewards"], group_size=2, anchor=0.5),
    }[call]
    name = {"surrogate": "logprobs", "surrogate-unchecked": "logprobs", "hadw_advantages": "rewards"}.get(
        call, "hidden_states")
    with pytest.raises(ValueError, match=f"{name} is on the meta device, which holds shapes but no values"):
        run()
