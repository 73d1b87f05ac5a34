"""What a hostile user found, held on every backend: data is data, padding
reaches nothing, NaN in gives NaN out, empty batches give an exact zero, labels outside the
vocabulary are refused on every call, and the KL keeps its digits near on-policy."""

import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from cases import GROUP_SIZE, Variant, linear_batch, surrogate_batch
from check import compare_padded

from hadw_kernels import (
    LOSS_PRESETS,
    LOSS_TYPES,
    METRIC_NAMES,
    fused_hadw_grpo_loss,
    fused_linear_hadw_grpo_loss,
    token_logprobs,
)
from hadw_kernels.objectives.table import OBJECTIVES


def _clean_batch(device, dtype=torch.float32, seed=0):
    """A surrogate batch with zeros (not poison) at padding, on ``device``."""
    batch = surrogate_batch(seed)
    mask = batch["response_mask"]
    clean = {key: torch.where(mask, value, torch.zeros_like(value)) if value.shape == mask.shape else value
             for key, value in batch.items() if key != "response_mask"}
    out = {key: value.to(dtype if key != "rewards" else torch.float32).to(device) for key, value in clean.items()}
    out["response_mask"] = mask.to(device)
    return out


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_data_inputs_receive_no_gradient(backend, device, loss_type):
    """The current log-probs passed as the old ones without .detach() (a common slip) give
    the same policy gradient as detached ones, and no data tensor gets a gradient."""
    batch = _clean_batch(device)
    logprobs = batch["logprobs"].clone().requires_grad_()
    # A sequence-level loss takes one weight per response.
    weights = "response_importance_weights" if LOSS_PRESETS[loss_type].sequence_level else "token_importance_weights"
    data = {name: batch[name].clone().requires_grad_() for name in ("rewards", "ref_logprobs", weights)}
    loss = fused_hadw_grpo_loss(
        logprobs, logprobs, data["rewards"], batch["response_mask"], group_size=GROUP_SIZE, loss_type=loss_type,
        anchor=0.4, beta=0.1, ref_logprobs=data["ref_logprobs"], importance_weights=data[weights],
        backend=backend, generator=torch.Generator().manual_seed(0),
    )
    loss.backward()
    detached = logprobs.detach().clone().requires_grad_()
    expected = fused_hadw_grpo_loss(
        detached, logprobs.detach(), batch["rewards"], batch["response_mask"], group_size=GROUP_SIZE,
        loss_type=loss_type, anchor=0.4, beta=0.1, ref_logprobs=batch["ref_logprobs"],
        importance_weights=batch[weights], backend=backend, generator=torch.Generator().manual_seed(0),
    )
    expected.backward()
    torch.testing.assert_close(logprobs.grad, detached.grad)
    assert torch.any(logprobs.grad != 0)
    assert all(tensor.grad is None for tensor in data.values())


def test_advantages_receive_no_gradient(backend, device):
    batch = _clean_batch(device)
    advantages = batch["advantages"].clone().requires_grad_()
    logprobs = batch["logprobs"].clone().requires_grad_()
    fused_hadw_grpo_loss(logprobs, batch["old_logprobs"], None, batch["response_mask"],
                         advantages=advantages, backend=backend).backward()
    assert advantages.grad is None and torch.any(logprobs.grad != 0)


@pytest.mark.parametrize("loss", ["surrogate", "linear"])
def test_a_tensor_anchor_receives_no_gradient(backend, device, loss):
    """A 0-d anchor that requires grad (an anchor kept in a module's state) is data: it
    gets no gradient, and the call gives the loss and gradients of the same anchor as a
    float (docs/math.md: the loss differentiates only through the current log-probs)."""
    batch = _clean_batch(device)
    mask, rewards = batch["response_mask"], batch["rewards"]

    def run(anchor):
        if loss == "surrogate":
            logprobs = batch["logprobs"].clone().requires_grad_()
            value = fused_hadw_grpo_loss(logprobs, batch["old_logprobs"], rewards, mask, group_size=GROUP_SIZE,
                                         anchor=anchor, backend=backend)
            value.backward()
            return value.detach(), logprobs.grad
        data = linear_batch(0)
        hidden = data["hidden_states"].nan_to_num().float().to(device).requires_grad_()
        value = fused_linear_hadw_grpo_loss(
            hidden, data["lm_head_weight"].float().to(device), data["labels"].to(device),
            data["old_logprobs"].nan_to_num().float().to(device), data["rewards"].float().to(device),
            data["response_mask"].to(device), group_size=GROUP_SIZE, anchor=anchor, backend=backend)
        value.backward()
        return value.detach(), hidden.grad

    anchor = torch.tensor(0.3, device=device, requires_grad=True)
    with warnings.catch_warnings():
        # A kernel op handed an input that requires grad warns (in backward) that it has no autograd formula.
        warnings.filterwarnings("error", message=".*autograd kernel was not registered")
        loss_value, gradient = run(anchor)
    assert anchor.grad is None
    expected_loss, expected_gradient = run(0.3)
    torch.testing.assert_close(loss_value, expected_loss)
    torch.testing.assert_close(gradient, expected_gradient)


def test_clip_cov_draws_with_a_generator_on_the_inputs_device(backend, device):
    """A generator on the inputs' device (a CUDA one on a GPU, where the draw ran on the CPU
    and failed) draws there: the same seed, the same tokens; another seed, others."""
    batch = _clean_batch(device)

    def run(seed):
        generator = torch.Generator(device=device).manual_seed(seed)
        logprobs = batch["logprobs"].clone().requires_grad_()
        loss, metrics = fused_hadw_grpo_loss(
            logprobs, batch["old_logprobs"], batch["rewards"], batch["response_mask"], group_size=GROUP_SIZE,
            loss_type="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0, return_metrics=True,
            backend=backend, generator=generator)
        loss.backward()
        return logprobs.grad, metrics["selected_frac"]

    first, again, other = run(0), run(0), run(1)
    assert first[1] > 0
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])


# Every objective that reads epsilon_low, as the ratio's lower bound 1 - eps (clip, cispo_clip,
# clip_cov), a log-ratio bound (gmpo) or a divergence threshold (dppo_tv, dppo_kl).
LOWER_CLIP_READERS = [("grpo", {}), ("gspo", {}), ("cispo", {"objective": "cispo_clip"}), ("gmpo", {}),
                      ("dppo_tv", {}), ("dppo_kl", {}), ("clip_cov", {"clip_cov_lb": -10.0, "clip_cov_ub": 10.0})]


@pytest.mark.parametrize("epsilon_low", [1.0, 10.0])
@pytest.mark.parametrize("loss_type, options", LOWER_CLIP_READERS, ids=[case[0] for case in LOWER_CLIP_READERS])
def test_epsilon_low_of_one_or_more_computes_as_written(backend, device, loss_type, options, epsilon_low):
    """epsilon_low >= 1 (verl's clip_ratio_low=10 in its CISPO tests: no lower clip) is
    taken and computed by its formula on every backend, loss, gradient and metrics as
    the reference: a lower bound 1 - eps at or below 0 clips no ratio."""
    variant = Variant(f"epsilon_low_{epsilon_low:g}", {"epsilon_low": epsilon_low, "anchor": 0.4, **options})
    fast = compare_padded(backend, device, loss_type, variant, torch.float32)
    if loss_type in ("grpo", "gspo", "cispo", "clip_cov"):
        assert fast.metrics["clip_frac_low"] == 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_nan_logprob_gives_nan_loss(backend, device, loss_type):
    batch = _clean_batch(device)
    logprobs = batch["logprobs"].clone()
    row = 5  # a response with tokens, in a group with a non-zero advantage
    logprobs[row, 0] = float("nan")
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, batch["old_logprobs"], batch["rewards"], batch["response_mask"], group_size=GROUP_SIZE,
        loss_type=loss_type, anchor=0.4, return_metrics=True, backend=backend, check_values=False,
    )
    assert torch.isnan(loss), loss
    assert torch.isnan(metrics["ratio_mean"])
    with pytest.raises(ValueError, match="logprobs contain NaN"):
        fused_hadw_grpo_loss(logprobs, batch["old_logprobs"], batch["rewards"], batch["response_mask"],
                             group_size=GROUP_SIZE, loss_type=loss_type, backend=backend)


@pytest.mark.parametrize("path", ["auto", "recompute"])
def test_nan_hidden_state_gives_nan_loss(backend, device, path):
    data = linear_batch(1)
    hidden = data["hidden_states"].float().to(device)
    mask = data["response_mask"].to(device)
    hidden[5, 0, 3] = float("nan")  # a response token
    kwargs = dict(rewards=data["rewards"].float().to(device), group_size=GROUP_SIZE, anchor=0.4, backend=backend,
                  linear_path=path)
    loss = fused_linear_hadw_grpo_loss(hidden, data["lm_head_weight"].float().to(device), data["labels"].to(device),
                                       data["old_logprobs"].float().to(device), response_mask=mask,
                                       check_values=False, **kwargs)
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match="hidden_states contain NaN"):
        fused_linear_hadw_grpo_loss(hidden, data["lm_head_weight"].float().to(device), data["labels"].to(device),
                                    data["old_logprobs"].float().to(device), response_mask=mask, **kwargs)


def test_poisoned_ignored_rows_leave_the_head_gradient_finite(backend, device):
    """NaN and inf hidden states at ignored labels: every gradient finite, those rows' zero."""
    hidden = torch.randn(2, 6, 16, device=device)
    labels = torch.randint(0, 50, (2, 6), device=device)
    labels[:, 3:] = -100
    hidden[:, 3] = float("nan")
    hidden[:, 4] = float("inf")
    hidden.requires_grad_()
    weight = torch.randn(50, 16, device=device, requires_grad=True)
    logprobs, entropy = token_logprobs(hidden, weight, labels, with_entropy=True, backend=backend)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(weight.grad).all() and torch.isfinite(hidden.grad).all()
    assert torch.all(hidden.grad[:, 3:] == 0)


@pytest.mark.parametrize("bad", [30, 31, -5, 2**40], ids=["V", "above-V", "negative", "huge"])
@pytest.mark.parametrize("check_values", [True, False])
def test_labels_outside_the_vocabulary_are_refused_on_every_call(backend, device, bad, check_values):
    """A label equal to V, above V or negative (not ignore_index) is an error even with
    check_values=False: unchecked it would give a NaN log-prob. On a GPU, unchecked, the
    refusal is a device-side assert (no host read), which ends the process's CUDA context
    as torch's own indexing does: there it is held in a child process."""
    if device.type == "cuda" and not check_values:
        _refused_by_a_device_assert(backend, bad)
        return
    hidden = torch.randn(1, 4, 8, device=device)
    weight = torch.randn(30, 8, device=device)
    labels = torch.tensor([[1, bad, 2, -100]], device=device)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 30\)"):
        token_logprobs(hidden, weight, labels, backend=backend, check_values=check_values)
    mask = torch.ones(1, 4, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 30\)"):
        fused_linear_hadw_grpo_loss(hidden.expand(2, 4, 8), weight, labels.expand(2, 4), None,
                                    torch.tensor([0.0, 1.0], device=device), mask.expand(2, 4), group_size=2,
                                    backend=backend, check_values=check_values)


def test_labels_outside_the_vocabulary_at_padding_are_accepted(backend, device):
    data = linear_batch(2)
    mask = data["response_mask"]
    assert bool((data["labels"][~mask] >= data["lm_head_weight"].shape[0]).all())  # the batch holds such labels
    loss = fused_linear_hadw_grpo_loss(
        data["hidden_states"].float().to(device), data["lm_head_weight"].float().to(device), data["labels"].to(device),
        data["old_logprobs"].float().to(device), data["rewards"].float().to(device), mask.to(device),
        group_size=GROUP_SIZE, backend=backend,
    )
    assert torch.isfinite(loss)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (4, 5)], ids=["no_rows", "no_columns", "all_masked"])
def test_empty_batches_give_exact_zeros(backend, device, loss_type, shape):
    logprobs = torch.randn(*shape, device=device, requires_grad=True)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], device=device)[: shape[0]]
    mask = torch.zeros(*shape, dtype=torch.bool, device=device)
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, logprobs.detach(), rewards, mask, group_size=2, loss_type=loss_type, anchor=0.5, beta=0.1,
        ref_logprobs=logprobs.detach(), return_metrics=True, backend=backend,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))
    selection = {"selected_frac"} if OBJECTIVES[LOSS_PRESETS[loss_type].objective].selects_tokens else set()
    assert set(metrics) == set(METRIC_NAMES) - {"entropy_mean"} | selection
    for name, value in metrics.items():
        expected = 1.3 if name == "phi_mean" and shape[0] else 0.0
        if name == "zero_std_frac" and shape[0]:
            expected = 0.0
        assert torch.isfinite(value), name
        if name != "phi_mean":
            assert value.item() == expected, (name, value)


@pytest.mark.parametrize("check_values", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("rows", [0, 4], ids=["no_rows", "all_masked"])
@pytest.mark.parametrize("path", ["auto", "recompute"])
def test_empty_linear_batch_gives_exact_zeros(backend, device, path, rows, check_values):
    """No row, or rows of which none counts: checked, the count read is 0 and the sweep
    runs over no row at all; unchecked, every row enters it, zeroed."""
    hidden = torch.randn(rows, 5, 8, device=device, requires_grad=True)
    weight = torch.randn(30, 8, device=device, requires_grad=True)
    labels = torch.zeros(rows, 5, dtype=torch.long, device=device)
    empty = torch.zeros(rows, 5, device=device)
    loss = fused_linear_hadw_grpo_loss(hidden, weight, labels, empty, torch.tensor([0.0, 1.0, 1.0, 0.0])[:rows].to(device),
                                       empty.bool(), group_size=2, backend=backend, linear_path=path,
                                       check_values=check_values)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_keeps_its_precision_near_on_policy(backend, device, estimator):
    """Reference deltas of 1e-4 in fp32: the KL term of the loss (k3 ~ 5e-9 a token) within
    1e-3 of its fp64 value on every backend (the literal exp(d) - d - 1 is off by 100%)."""
    batch = _clean_batch(device)
    logprobs = batch["logprobs"]
    ref = logprobs + 1e-4 * torch.sign(torch.randn_like(logprobs))
    kwargs = dict(rewards=None, advantages=torch.zeros_like(batch["advantages"]), beta=1.0, kl_estimator=estimator)
    _, metrics = fused_hadw_grpo_loss(logprobs, logprobs, response_mask=batch["response_mask"], ref_logprobs=ref,
                                      return_metrics=True, backend=backend, **kwargs)
    _, exact = fused_hadw_grpo_loss(logprobs.double().cpu(), logprobs.double().cpu(),
                                    response_mask=batch["response_mask"].cpu(), ref_logprobs=ref.double().cpu(),
                                    return_metrics=True, backend="torch",
                                    **{key: value.double().cpu() if isinstance(value, torch.Tensor) else value
                                       for key, value in kwargs.items()})
    assert math.isclose(metrics["ref_kl"].item(), exact["ref_kl"].item(), rel_tol=1e-3)


def test_dr_grpo_micro_batches_of_different_widths_add_up(backend, device):
    """With max_response_length, micro-batches padded to their own widths add up to the
    batch; without it, a loss_normalizer is refused for seq-mean-token-sum-norm."""
    batch = _clean_batch(device, seed=4)
    mask, width = batch["response_mask"], batch["logprobs"].shape[1]
    kwargs = dict(group_size=GROUP_SIZE, loss_type="dr_grpo", anchor=0.3, backend=backend)
    whole = fused_hadw_grpo_loss(batch["logprobs"], batch["old_logprobs"], batch["rewards"], mask,
                                 max_response_length=width, **kwargs)
    total = 0.0
    for rows in (slice(0, 4), slice(4, 12)):
        trimmed = int(mask[rows].sum(dim=1).max())  # padded only to this micro-batch's longest response
        total += fused_hadw_grpo_loss(
            batch["logprobs"][rows, :trimmed], batch["old_logprobs"][rows, :trimmed], batch["rewards"][rows],
            mask[rows, :trimmed], loss_normalizer=12, max_response_length=width, **kwargs,
        ).item()
    assert total == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="needs max_response_length"):
        fused_hadw_grpo_loss(batch["logprobs"], batch["old_logprobs"], batch["rewards"], mask, loss_normalizer=12,
                             **kwargs)


_UNCHECKED_CALLS = {
    "token_logprobs": "token_logprobs(hidden, weight, labels, backend=BACKEND, check_values=False)",
    "fused_linear_hadw_grpo_loss": (
        "fused_linear_hadw_grpo_loss(hidden.expand(2, 4, 8), weight, labels.expand(2, 4), None, "
        "torch.tensor([0.0, 1.0], device='cuda'), torch.ones(2, 4, dtype=torch.bool, device='cuda'), group_size=2, "
        "backend=BACKEND, check_values=False)"),
}


def _refused_by_a_device_assert(backend, bad):
    for name, call in _UNCHECKED_CALLS.items():
        code = "\n".join([
            "import torch",
            "from hadw_kernels import fused_linear_hadw_grpo_loss, token_logprobs",
            "hidden, weight = torch.randn(1, 4, 8, device='cuda'), torch.randn(30, 8, device='cuda')",
            f"labels = torch.tensor([[1, {bad}, 2, -100]], device='cuda')",
            f"BACKEND = {backend!r}",
            call,
            "torch.cuda.synchronize()",
            "print('NOT REFUSED')",
        ])
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                               cwd=Path(__file__).resolve().parents[2])
        assert child.returncode != 0 and "NOT REFUSED" not in child.stdout, (name, child.stdout, child.stderr[-2000:])
        assert "labels must lie in [0, 30)" in child.stderr, (name, child.stderr[-2000:])



@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "cispo"])
def test_float16_ratios_past_its_range_stay_finite(backend, device, layout, loss_type):
    """A log-ratio of 11.5 puts exp past float16's largest value (65504): computed in the
    inputs' dtype the ratio was inf and the gradients and metrics NaN or inf, where the
    loss itself is representable. Every backend computes in fp32 at least and matches the
    float32 call."""
    logprobs = torch.full((4, 3), -0.5, dtype=torch.float16, device=device)
    old = torch.full((4, 3), -12.0, dtype=torch.float16, device=device)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], device=device)
    mask = torch.ones(4, 3, dtype=torch.bool, device=device)
    extra = {}
    if layout == "packed":
        logprobs, old, mask = logprobs.reshape(-1), old.reshape(-1), mask.reshape(-1)
        extra = dict(cu_seqlens=torch.arange(0, 13, 3, device=device))
    results = {}
    for dtype in (torch.float16, torch.float32):
        leaf = logprobs.detach().to(dtype).requires_grad_()
        loss, metrics = fused_hadw_grpo_loss(leaf, old.to(dtype), rewards, mask, group_size=2, loss_type=loss_type,
                                             return_metrics=True, backend=backend, **extra)
        loss.backward()
        results[dtype] = (loss, leaf.grad, metrics)
    (loss, grad, metrics), (loss32, grad32, metrics32) = results[torch.float16], results[torch.float32]
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
    assert all(math.isfinite(float(value)) for value in metrics.values()), metrics
    torch.testing.assert_close(loss.float(), loss32, rtol=1e-3, atol=0)
    torch.testing.assert_close(grad.float(), grad32, rtol=1e-3, atol=0)
    torch.testing.assert_close(metrics["ratio_mean"], metrics32["ratio_mean"], rtol=1e-3, atol=0)


@pytest.mark.parametrize("temperature", [1e-30, 1e30])
@pytest.mark.parametrize("on_policy", [True, False])
def test_sapo_at_the_ends_of_its_temperature_range_stays_finite(backend, device, temperature, on_policy):
    """SAPO's temperatures are accepted in [1e-30, 1e30] (validation refuses the rest): at
    either end every backend's loss, gradient and metrics are finite and the torch
    backend's. Beyond them float32's 4 / tau or tau overflowed, and the C++ loss was NaN."""
    batch = _clean_batch(device)
    old = None if on_policy else batch["old_logprobs"]
    results = {}
    for name in {backend, "torch"}:
        leaf = batch["logprobs"].clone().requires_grad_()
        loss, metrics = fused_hadw_grpo_loss(
            leaf, old, batch["rewards"], batch["response_mask"], group_size=GROUP_SIZE, loss_type="sapo",
            sapo_temperature_pos=temperature, sapo_temperature_neg=temperature, return_metrics=True, backend=name)
        loss.backward()
        assert math.isfinite(float(loss)) and bool(torch.isfinite(leaf.grad).all())
        assert all(math.isfinite(float(value)) for value in metrics.values()), metrics
        results[name] = (loss.detach(), leaf.grad)
    torch.testing.assert_close(results[backend], results["torch"], rtol=1e-4, atol=1e-6 * max(1.0, 4 / temperature))
