"""Case builders shared by the whole suite: seeded float64 inputs on the CPU, and the
runs of a backend, of eager PyTorch in the case's dtype, and of the exact reference.

A surrogate batch has contiguous groups of 4 (the first one degenerate: equal rewards),
an empty response and a full one, an odd width, and padding that holds NaN and inf in
every per-token input (masked positions must never reach an output).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from hadw_kernels import batch_totals, fused_hadw_grpo_loss, fused_linear_hadw_grpo_loss, token_logprobs
from hadw_kernels.advantage.group import weighted_advantages
from hadw_kernels.backends import load_backend
from hadw_kernels.batch.inputs import SurrogateBatch, caller_advantages
from hadw_kernels.batch.token_layout import TokenLayout
from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.config.presets import LOSS_PRESETS, LOSS_TYPES
from hadw_kernels.formulas.correction import correct
from hadw_kernels.formulas.token_terms import masked_mean
from hadw_kernels.objectives.table import OBJECTIVE_OPTIONS, OBJECTIVES
from hadw_kernels.reference.linear_logprob import token_logprobs_reference
from hadw_kernels.reference.surrogate import surrogate_loss as reference_surrogate
from hadw_kernels.tables.aggregations import AGGREGATIONS
from hadw_kernels.tables.corrections import RolloutCorrection
from hadw_kernels.tables.linear_blocks import IGNORE_INDEX
from hadw_kernels.tables.metrics import CORRECTION_METRIC_NAMES, METRIC_NAMES

GROUP_SIZE = 4
IGNORE = IGNORE_INDEX
# Rows of hidden states per block of the linear loss: a linear batch's longest responses
# (13 tokens) span two blocks, and blocks end inside responses.
BLOCK_ROWS = 8
UPSTREAM = 0.7  # a non-unit upstream gradient of the loss


def _poison(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NaN and inf, alternating, at masked positions."""
    poison = torch.full_like(values, float("nan"))
    poison.view(-1)[::2] = float("inf")
    return torch.where(mask, values, poison)


def surrogate_batch(seed: int, batch: int = 12, width: int = 37, drift: float = 0.3) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=generator)
    if batch >= 3:
        lengths[1] = 0
        lengths[2] = width
    mask = torch.arange(width)[None, :] < lengths[:, None]
    logprobs = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3
    old = logprobs + drift * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    ref = logprobs + 0.2 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    rewards = torch.bernoulli(torch.full((batch,), 0.5), generator=generator).double()
    if batch >= 2 * GROUP_SIZE:
        rewards[:GROUP_SIZE] = 1.0
        rewards[GROUP_SIZE] = 0.0
        rewards[GROUP_SIZE + 1] = 1.0
    entropy = torch.rand(batch, width, generator=generator, dtype=torch.float64) * 4
    token_importance_weights = 0.5 + torch.rand(batch, width, generator=generator, dtype=torch.float64)
    # Per-token advantages (process rewards): each response's sign mostly, some tokens flipped.
    token_advantages = torch.randn(batch, 1, generator=generator, dtype=torch.float64) + 0.5 * torch.randn(
        batch, width, generator=generator, dtype=torch.float64)
    data = dict(
        logprobs=_poison(logprobs, mask),
        old_logprobs=_poison(old, mask),
        ref_logprobs=_poison(ref, mask),
        entropy=_poison(entropy, mask),
        token_importance_weights=_poison(token_importance_weights, mask),
        response_importance_weights=0.5 + torch.rand(batch, generator=generator, dtype=torch.float64),
        rewards=rewards,
        advantages=torch.randn(batch, generator=generator, dtype=torch.float64),
        token_advantages=_poison(token_advantages, mask),
        response_mask=mask,
    )
    # The rollout engine's log-probs (drawn last, leaving the other tensors as they were):
    # the behaviour policy's, off by a token-level noise whose sequence sums cross every
    # bound of the correction variants.
    rollout = (old + 0.15 * torch.randn(batch, width, generator=generator, dtype=torch.float64)).clamp(max=0.0)
    data["rollout_logprobs"] = _poison(rollout, mask)
    # What the estimators read beyond the rewards (drawn after the rest, which they leave
    # as it was): each group's prompt's pseudo-counts, alike over the group's rows, and the
    # totals of a rollout batch that holds these groups and two more.
    groups = -(-batch // GROUP_SIZE)
    data["prior"] = (0.5 + 3 * torch.rand(groups, 2, generator=generator, dtype=torch.float64)).repeat_interleave(
        GROUP_SIZE, 0)[:batch]
    others = torch.bernoulli(torch.full((2 * GROUP_SIZE,), 0.3), generator=generator).double()
    whole = torch.cat([rewards[: batch - batch % GROUP_SIZE], others])
    data["batch_totals"] = batch_totals(whole, group_size=GROUP_SIZE)
    return data


@dataclass(frozen=True)
class Variant:
    """Options of one loss call; ``tensors`` names the batch tensors it passes."""

    name: str
    options: dict = field(default_factory=dict)
    tensors: tuple = ("old_logprobs", "rewards")

    def __str__(self) -> str:
        return self.name


_ROLLOUT = ("old_logprobs", "rewards", "rollout_logprobs")
# Every rule, level and rejection filter of the rollout correction, the two token masks and
# the bias-corrected KL, some with HA-DW and the caller's weights.
CORRECTION_VARIANTS = [
    Variant("rollout_sequence_mask", {"rollout_correction": RolloutCorrection(), "anchor": 0.35}, _ROLLOUT),
    Variant("rollout_token_truncate_normalized",
            {"rollout_correction": RolloutCorrection(level="token", rule="truncate", lower=0.9, upper=1.1,
                                                     batch_normalize=True)},
            _ROLLOUT + ("token_importance_weights",)),
    Variant("rollout_sequence_icepop_normalized_filters",
            {"rollout_correction": RolloutCorrection(level="sequence", rule="mask", lower=0.6, upper=1.6,
                                                     batch_normalize=True,
                                                     rejection={"seq_sum_k1": (0.4, 2.5), "seq_max_k2": 0.04,
                                                                "token_k3": 0.05, "seq_mean_k2": 0.02})},
            _ROLLOUT),
    Variant("rollout_token_filters",
            {"rollout_correction": RolloutCorrection(level=None, rejection={
                "token_k1": (0.8, 1.25), "token_k2": 0.03, "seq_sum_k2": 0.3, "seq_sum_k3": 0.3,
                "seq_mean_k1": 1.05, "seq_mean_k3": 0.015, "seq_max_k3": 0.05}),
             "loss_agg_mode": "token-mean"},
            _ROLLOUT),
    Variant("off_policy_mask", {"off_policy_mask_threshold": 0.05, "anchor": 0.4}, _ROLLOUT),
    Variant("off_policy_mask_without_rollout", {"off_policy_mask_threshold": 0.02}, ("old_logprobs", "advantages")),
    Variant("entropy_mask", {"top_entropy_quantile": 0.4}, ("old_logprobs", "rewards", "entropy")),
    Variant("kl_bias_correction", {"beta": 0.05, "kl_bias_correction": True, "anchor": 0.3},
            ("old_logprobs", "rewards", "ref_logprobs")),
]

# Options of each objective (objectives.table.OBJECTIVES) away from their defaults.
OBJECTIVE_VARIANT_OPTIONS = {
    "clip": dict(delta=1.35, dual_clip=2.5),
    "cispo_cap": dict(ratio_cap=1.3),
    "cispo_clip": dict(epsilon_low=0.1, epsilon_high=0.3),
    "sapo": dict(sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "gmpo": dict(epsilon_low=0.2, epsilon_high=0.3),
    "vespo": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    "gpg": dict(),
    "dppo_tv": dict(ratio_cap=1.3, epsilon_low=0.1, epsilon_high=0.05),
    "dppo_kl": dict(ratio_cap=1.3, epsilon_low=0.02, epsilon_high=0.05),
    "dro": dict(dro_beta=0.6),
    "clip_cov": dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=2.0),
    "kl_cov": dict(kl_cov_ratio=0.1, ppo_kl_coef=0.7),
}


def unpreset_objective_variants() -> list[Variant]:
    """A variant per objective that no loss type presets (cispo_clip), with its options of
    OBJECTIVE_VARIANT_OPTIONS: each loss type then runs it in its ratio form, so that a
    row added to the table without a preset runs on every backend."""
    preset = {setting.objective for setting in LOSS_PRESETS.values()}
    return [Variant(name, {"objective": name, "anchor": 0.3, **OBJECTIVE_VARIANT_OPTIONS[name]})
            for name in OBJECTIVES if name not in preset]


# Every option of the loss appears in at least one variant; each variant runs with
# every loss type, dtype and backend.
SURROGATE_VARIANTS = [
    Variant("plain"),
    Variant("hadw", {"anchor": 0.35}),
    Variant("hadw_kl_k3_dual_clip", {"anchor": 0.6, "beta": 0.1, "dual_clip": 3.0}, ("old_logprobs", "rewards",
                                                                                      "ref_logprobs")),
    Variant("kl_k1", {"beta": 0.05, "kl_estimator": "k1"}, ("old_logprobs", "rewards", "ref_logprobs")),
    Variant("kl_k2_std_eps", {"beta": 0.05, "kl_estimator": "k2", "std_eps": 1e-4},
            ("old_logprobs", "rewards", "ref_logprobs")),
    Variant("kl_abs_no_std", {"beta": 0.05, "kl_estimator": "abs", "normalize_std": False},
            ("old_logprobs", "rewards", "ref_logprobs")),
    Variant("token_importance_weights", {"anchor": 0.35}, ("old_logprobs", "rewards", "token_importance_weights")),
    Variant("response_importance_weights", {}, ("old_logprobs", "rewards", "response_importance_weights")),
    Variant("normalizer", {"loss_normalizer": 50.0, "max_response_length": 40}),
    Variant("advantages", {}, ("old_logprobs", "advantages")),
    Variant("on_policy", {"anchor": 0.35}, ("rewards",)),
    Variant("token_mean", {"loss_agg_mode": "token-mean", "anchor": 0.2}),
    Variant("seq_mean_token_sum", {"loss_agg_mode": "seq-mean-token-sum"}),
    Variant("seq_mean_token_sum_norm", {"loss_agg_mode": "seq-mean-token-sum-norm"}),
    Variant("token_sum", {"loss_agg_mode": "token-sum", "anchor": 0.8}),
    # Each objective's own options away from their defaults (OBJECTIVE_VARIANT_OPTIONS).
    Variant("objective_options", {"anchor": 0.45}, ("old_logprobs", "rewards", "objective_options")),
    Variant("token_advantages", {}, ("old_logprobs", "token_advantages")),
    # The two sequence ratio forms with per-token importance weights, where they differ.
    Variant("sequence_ratio_token_weights", {"ratio_level": "sequence"},
            ("old_logprobs", "rewards", "token_importance_weights")),
    Variant("gspo_token_weights", {"ratio_level": "gspo_token", "anchor": 0.5},
            ("old_logprobs", "rewards", "token_importance_weights")),
    # The objectives no loss type presets, in each loss type's ratio form.
    *unpreset_objective_variants(),
    # The estimators (tables/estimators.py), inside the kernels' launch, with and without
    # Phi: James-Stein over the call's groups and over a larger batch's totals, the
    # history's with its prompts' pseudo-counts.
    Variant("rloo", {"advantage_estimator": "rloo"}),
    Variant("james_stein_hadw", {"advantage_estimator": "james_stein", "anchor": 0.35}),
    Variant("james_stein_batch_totals", {"advantage_estimator": "james_stein"},
            ("old_logprobs", "rewards", "batch_totals")),
    Variant("prompt_history_hadw", {"advantage_estimator": "prompt_history", "anchor": 0.45},
            ("old_logprobs", "rewards", "prior")),
    # Rollout correction and token masks (correction.py): every rule, level and filter.
    *CORRECTION_VARIANTS,
]
# The seed of the generator every call of an objective that draws its tokens gets afresh
# (cast and rounded copy it per run), so that each run draws the same.
SELECTION_SEED = 17

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = ("padded", "packed")


def pairwise_cases() -> list[tuple[str, Variant, torch.dtype, str]]:
    """(loss type, variant, dtype, layout) with every pair of values of the four axes
    present, not their product: every (loss type, variant) pair once, its dtype
    DTYPES[(l + v) % 4] and its layout by ((l + v) // 4) % 2 (l, v the indices), which
    meet every loss type, variant and each other (tests/conformance/test_surrogate_op.py
    checks the coverage)."""
    cases = []
    for l_index, loss_type in enumerate(LOSS_TYPES):
        for v_index, variant in enumerate(SURROGATE_VARIANTS):
            diagonal = l_index + v_index
            cases.append((loss_type, variant, DTYPES[diagonal % len(DTYPES)], LAYOUTS[(diagonal // len(DTYPES)) % 2]))
    return cases


def loss_kwargs(batch: dict, loss_type: str, variant: Variant) -> dict:
    """The keyword arguments of one call, batch tensors still in float64 on the CPU. The
    variant's options that the preset's objective does not take (another objective's
    option, a ratio form it has no use for) are left out."""
    kwargs = dict(loss_type=loss_type, **variant.options)
    objective = OBJECTIVES[LOSS_PRESETS[loss_type].objective]
    if OBJECTIVES[kwargs.get("objective", LOSS_PRESETS[loss_type].objective)].selects_tokens:
        kwargs["generator"] = torch.Generator().manual_seed(SELECTION_SEED)
    if kwargs.get("ratio_level") not in (None, *objective.ratio_levels):
        del kwargs["ratio_level"]
    for name in set(kwargs) & set(OBJECTIVE_OPTIONS):
        if name not in objective.options:
            del kwargs[name]
    for name in variant.tensors:
        if name == "token_importance_weights":
            kwargs["importance_weights"] = batch["token_importance_weights"]
        elif name == "response_importance_weights":
            kwargs["importance_weights"] = batch["response_importance_weights"]
        elif name == "token_advantages":
            kwargs["advantages"] = batch["token_advantages"]
        elif name == "objective_options":
            kwargs.update(OBJECTIVE_VARIANT_OPTIONS[LOSS_PRESETS[loss_type].objective])
        else:
            kwargs[name] = batch[name]
    if "rewards" in kwargs:
        kwargs["group_size"] = GROUP_SIZE
    return kwargs


def with_required(kwargs: dict) -> dict:
    """A call's keywords with the losses' required positions filled: None is on-policy,
    and goes with advantages=."""
    return {"old_logprobs": None, "rewards": None, **kwargs}


def fresh(generator: torch.Generator) -> torch.Generator:
    """A generator in ``generator``'s state: each run of a case draws what the others do."""
    return torch.Generator().set_state(generator.get_state())


# What the advantages are formed from: at least fp32, as a trainer holds them.
_ADVANTAGE_DATA = ("rewards", "advantages", "prior", "batch_totals")


def cast(kwargs: dict, dtype: torch.dtype, device: torch.device) -> dict:
    """Float tensors to ``dtype`` (what the advantages are formed from at least fp32, as
    a trainer holds them) on ``device``; a generator copied."""
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Generator):
            value = fresh(value)
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                target = torch.promote_types(dtype, torch.float32) if key in _ADVANTAGE_DATA else dtype
                value = value.to(target)
            value = value.to(device)
        out[key] = value
    return out


def rounded(kwargs: dict, dtype: torch.dtype) -> dict:
    """The same inputs rounded to ``dtype``, then float64 on the CPU: what an exact
    computation of the fast path's inputs sees."""
    return {
        key: value.to(dtype).double() if isinstance(value, torch.Tensor) and value.is_floating_point()
        and key not in _ADVANTAGE_DATA else fresh(value) if isinstance(value, torch.Generator) else value
        for key, value in kwargs.items()
    }


@dataclass
class Outputs:
    values: dict  # name -> tensor (loss, gradients, per-token outputs)
    metrics: dict


def run_surrogate(backend: str, logprobs, response_mask, kwargs) -> Outputs:
    """The public loss from log-probs: loss, d loss / d logprobs (upstream 0.7), metrics."""
    logprobs = logprobs.detach().requires_grad_()
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, response_mask=response_mask, return_metrics=True, backend=backend, check_values=False,
        **with_required(kwargs)
    )
    (loss * UPSTREAM).backward()
    return Outputs({"loss": loss.detach(), "grad_logprobs": logprobs.grad}, metrics)


def run_surrogate_op_with_entropy(backend: str, logprobs, entropy, response_mask, kwargs, entropy_coef) -> Outputs:
    """The backend's surrogate op with an entropy input (what the linear loss feeds it); an
    objective that selects tokens selects none here (the op takes the selection as given)."""
    kwargs = dict(kwargs)
    kwargs.pop("generator", None)
    loss_type = kwargs.pop("loss_type")
    config = LossConfig.build(
        loss_type, kwargs.pop("group_size", None), entropy_coef=entropy_coef,
        **{key: kwargs.pop(key) for key in list(kwargs) if key not in _TENSOR_KEYS},
    )
    logprobs = logprobs.detach().requires_grad_()
    entropy = entropy.detach().requires_grad_()
    run = reference_surrogate if backend == "reference" else load_backend(backend).surrogate_loss
    loss, metrics = run_padded_op(run, logprobs, response_mask, config, entropy=entropy, **kwargs)
    (loss * UPSTREAM).backward()
    return Outputs({"loss": loss.detach(), "grad_logprobs": logprobs.grad, "grad_entropy": entropy.grad}, metrics)


_TENSOR_KEYS = {"old_logprobs", "rewards", "advantages", "anchor", "ref_logprobs", "importance_weights",
                "rollout_logprobs", "prior", "batch_totals"}
# The options whose rules the public losses apply around the backend's op (correction.py).
CORRECTION_OPTIONS = ("rollout_correction", "off_policy_mask_threshold", "top_entropy_quantile", "kl_bias_correction")


def run_padded_op(run, logprobs, response_mask, config, *, entropy=None, old_logprobs=None, ref_logprobs=None,
                  importance_weights=None, advantages=None, **per_response):
    """A backend's (or the reference's) surrogate on a padded [B, T] batch, flattened onto
    its token layout as the losses do; ``config``'s L resolved to the width."""
    layout = TokenLayout.padded(*response_mask.shape, response_mask.device)
    if AGGREGATIONS[config.loss_agg_mode].times_max_length and config.max_response_length is None:
        config = dataclasses.replace(config, max_response_length=max(response_mask.shape[1], 1))
    flat = layout.flat
    return run(SurrogateBatch(
        layout, config, flat(logprobs), flat(logprobs.detach() if old_logprobs is None else old_logprobs),
        flat(response_mask), entropy=flat(entropy), ref_logprobs=flat(ref_logprobs),
        importance_weights=layout.per_token(importance_weights), **caller_advantages(layout, advantages),
        **per_response,
    ))


# --- linear -------------------------------------------------------------------------------


def linear_batch(seed: int, batch: int = 8, width: int = 13, hidden: int = 24, vocab: int = 300,
                 scale: float = 1.0) -> dict:
    """A surrogate batch plus hidden states (NaN/inf at padding), a head, a bias and
    labels; typical log-probs near -log V so that some ratios leave the clip range."""
    generator = torch.Generator().manual_seed(seed)
    data = surrogate_batch(seed, batch=batch, width=width, drift=0.0)
    mask = data["response_mask"]
    typical = -math.log(vocab)
    old = typical + 0.3 * torch.randn(batch, width, generator=generator, dtype=torch.float64)
    data["old_logprobs"] = _poison(old, mask)
    data["ref_logprobs"] = _poison(old + 0.1 * torch.randn(batch, width, generator=generator, dtype=torch.float64),
                                   mask)
    hidden_states = torch.randn(batch, width, hidden, generator=generator, dtype=torch.float64)
    data["hidden_states"] = torch.where(mask[..., None], hidden_states, float("nan"))
    data["lm_head_weight"] = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) * (
        scale / hidden**0.5)
    data["lm_head_bias"] = 0.5 * torch.randn(vocab, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, width), generator=generator)
    # Labels at padding may be anything, an index outside the vocabulary included.
    data["labels"] = torch.where(mask, labels, torch.full_like(labels, vocab + 7))
    rollout = (old + 0.15 * torch.randn(batch, width, generator=generator, dtype=torch.float64)).clamp(max=0.0)
    data["rollout_logprobs"] = _poison(rollout, mask)
    return data


def mask_vocabulary(data: dict) -> dict:
    """Vocabulary masking through the LM head's bias, as a trainer bans tokens: -inf at
    the first 70 columns (a whole tile of the torch backend's 64) and at every 7th, the
    valid labels moved to unmasked columns. Each row's logits then hold -inf next to a
    finite max: the entropy's p log p and p (z - E[z]) must be 0 there, not NaN."""
    data = dict(data)
    vocab = data["lm_head_weight"].shape[0]
    masked = torch.zeros(vocab, dtype=torch.bool)
    masked[:70] = True
    masked[::7] = True
    data["lm_head_bias"] = data["lm_head_bias"].masked_fill(masked, float("-inf"))
    allowed = (~masked).nonzero().flatten()
    labels = data["labels"]
    inside = (labels >= 0) & (labels < vocab)
    data["labels"] = torch.where(inside, allowed[labels.clamp(0, vocab - 1) % allowed.numel()], labels)
    return data


def run_linear_loss(backend: str, hidden_states, lm_head_weight, labels, response_mask, kwargs, *,
                    lm_head_bias=None, linear_path="auto", upstream=UPSTREAM, cu_seqlens=None,
                    check_values=False) -> Outputs:
    """The linear loss, its gradients and metrics. ``check_values``: the checked call, whose
    read of the values also counts the active rows, which alone then enter the GEMMs on
    the triton and torch backends (the default call); unchecked, every row does."""
    leaves = [hidden_states.detach().requires_grad_(), lm_head_weight.detach().requires_grad_()]
    if lm_head_bias is not None:
        leaves.append(lm_head_bias.detach().requires_grad_())
    loss, metrics = fused_linear_hadw_grpo_loss(
        leaves[0], leaves[1], labels, response_mask=response_mask, lm_head_bias=leaves[2] if lm_head_bias is not None
        else None, return_metrics=True, backend=backend, linear_path=linear_path, block_rows=BLOCK_ROWS,
        check_values=check_values, cu_seqlens=cu_seqlens, **with_required(kwargs),
    )
    (loss if upstream == 1 else loss * upstream).backward()
    values = {"loss": loss.detach(), "grad_hidden": leaves[0].grad, "grad_weight": leaves[1].grad}
    if lm_head_bias is not None:
        values["grad_bias"] = leaves[2].grad
    return Outputs(values, metrics)


def reference_linear_loss(hidden_states, lm_head_weight, labels, response_mask, kwargs, *,
                          lm_head_bias=None) -> Outputs:
    """Eager PyTorch: materialised logits in the inputs' dtype, log-softmax in fp32 (as
    trainers do), then the reference surrogate."""
    kwargs = dict(kwargs)
    temperature = kwargs.pop("temperature", 1.0)
    entropy_coef = kwargs.pop("entropy_coef", 0.0)
    batch, width, hidden = hidden_states.shape
    leaves = [hidden_states.detach().requires_grad_(), lm_head_weight.detach().requires_grad_()]
    bias = None
    if lm_head_bias is not None:
        bias = lm_head_bias.detach().requires_grad_()
        leaves.append(bias)
    mask = response_mask.bool()
    safe_labels = labels.masked_fill(~mask, IGNORE)
    # Padding rows hold NaN: the reference must not form their logits either.
    rows = mask.reshape(-1)
    flat_hidden = torch.where(rows[:, None], leaves[0].reshape(-1, hidden), torch.zeros_like(leaves[0].reshape(-1, hidden)))
    logprobs, entropy = token_logprobs_reference(
        flat_hidden, leaves[1], safe_labels.reshape(-1), lm_head_bias=bias, temperature=temperature,
        with_entropy=True,
    )
    logprobs, entropy = logprobs.view(batch, width), entropy.view(batch, width)
    if any(name in kwargs for name in CORRECTION_OPTIONS):
        # The log-prob loss on the eager log-probs, its entropy mask reading their entropy.
        assert entropy_coef == 0, "a correction variant of the linear loss takes no entropy bonus"
        loss, metrics = fused_hadw_grpo_loss(
            logprobs, response_mask=mask, return_metrics=True, backend="torch", check_values=False,
            entropy=entropy.detach() if kwargs.get("top_entropy_quantile", 1.0) < 1 else None,
            **with_required(kwargs))
        (loss * UPSTREAM).backward()
        # The linear loss's entropy metric, over the tokens its filters leave counted.
        # (The rejection filters alone remove tokens from the count.)
        config = LossConfig.build(kwargs["loss_type"], rollout_correction=kwargs.get("rollout_correction"))
        layout = TokenLayout.padded(batch, width, mask.device)
        old = kwargs.get("old_logprobs")
        corrected = SurrogateBatch(layout, config, layout.flat(logprobs),
                                   layout.flat(old if old is not None else logprobs), mask.reshape(-1),
                                   rollout_logprobs=layout.flat(kwargs.get("rollout_logprobs")),
                                   mask_entropy=layout.flat(entropy))
        kept = correct(corrected, token_advantage=None).keep
        counted = mask.reshape(-1) if kept is None else kept
        metrics = dict(metrics, entropy_mean=masked_mean(entropy.detach().reshape(-1), counted))
        metrics = {name: metrics[name] for name in METRIC_NAMES + CORRECTION_METRIC_NAMES if name in metrics}
        return Outputs({"loss": loss.detach(), "grad_hidden": leaves[0].grad, "grad_weight": leaves[1].grad,
                        **({"grad_bias": bias.grad} if bias is not None else {})}, metrics)
    loss_type = kwargs.pop("loss_type")
    generator = kwargs.pop("generator", None)
    config = LossConfig.build(
        loss_type, kwargs.pop("group_size", None), entropy_coef=entropy_coef,
        **{key: kwargs.pop(key) for key in list(kwargs) if key not in _TENSOR_KEYS},
    )
    selection = {}
    if OBJECTIVES[config.objective].selects_tokens:
        # As the loss selects: over the counted tokens, by the eager log-probs.
        layout = TokenLayout.padded(batch, width, mask.device)
        old = kwargs.get("old_logprobs")
        advantages = kwargs.get("advantages")
        advantage, _ = weighted_advantages(kwargs.get("rewards"), layout.per_token(advantages), config,
                                           kwargs.get("anchor"), kwargs.get("batch_totals"), kwargs.get("prior"))
        token_advantage = advantage if advantages is not None else layout.expand(advantage)
        flat_logprobs = layout.flat(logprobs).detach()
        selected = OBJECTIVES[config.objective].selection(
            flat_logprobs, flat_logprobs if old is None else layout.flat(old).to(flat_logprobs.dtype),
            token_advantage.to(flat_logprobs.dtype), mask.reshape(-1), config, generator)
        selection = dict(selected=selected)
    loss, metrics = run_padded_op(reference_surrogate, logprobs, mask, config, entropy=entropy, **kwargs,
                                  **selection)
    if selection:
        metrics = dict(metrics, selected_frac=masked_mean(selection["selected"], mask.reshape(-1)))
    (loss * UPSTREAM).backward()
    values = {"loss": loss.detach(), "grad_hidden": leaves[0].grad, "grad_weight": leaves[1].grad}
    if bias is not None:
        values["grad_bias"] = bias.grad
    return Outputs(values, metrics)


def run_token_logprobs(backend: str, hidden_states, lm_head_weight, labels, upstream, *, lm_head_bias=None,
                       temperature=1.0, check_values=False) -> Outputs:
    """Log-probs and entropy [B, T] and the gradients of sum(g * logp + g_ent * entropy);
    ``check_values`` as :func:`run_linear_loss`'s."""
    leaves = [hidden_states.detach().requires_grad_(), lm_head_weight.detach().requires_grad_()]
    if lm_head_bias is not None:
        leaves.append(lm_head_bias.detach().requires_grad_())
    bias = leaves[2] if lm_head_bias is not None else None
    if backend == "reference":
        batch, width, hidden = hidden_states.shape
        logprobs, entropy = token_logprobs_reference(
            leaves[0].reshape(-1, hidden), leaves[1], labels.reshape(-1), lm_head_bias=bias,
            temperature=temperature, with_entropy=True,
        )
        logprobs, entropy = logprobs.view(batch, width), entropy.view(batch, width)
    else:
        logprobs, entropy = token_logprobs(
            leaves[0], leaves[1], labels, lm_head_bias=bias, temperature=temperature, with_entropy=True,
            backend=backend, check_values=check_values,
        )
    total = (logprobs * upstream[0].to(logprobs)).sum() + (entropy * upstream[1].to(entropy)).sum()
    grads = torch.autograd.grad(total, leaves)
    names = ["grad_hidden", "grad_weight", "grad_bias"]
    values = {"logprobs": logprobs.detach(), "entropy": entropy.detach(), **dict(zip(names, grads))}
    return Outputs(values, {})


# --- packed (padding-free) ------------------------------------------------------------------

PER_TOKEN_KEYS = ("logprobs", "old_logprobs", "ref_logprobs", "entropy", "token_importance_weights", "token_advantages",
                  "rollout_logprobs", "response_mask")


@dataclass
class PackedBatch:
    """A padded batch's responses packed into segments: per-token tensors [N] (the
    padded ones' valid tokens, each segment led by a prompt of masked tokens that holds
    NaN and inf), ``cu_seqlens`` [S+1] (int64), per-response tensors unchanged, and
    where each padded position went (``padded_index`` [N], -1 for a prompt token)."""

    tensors: dict
    cu_seqlens: torch.Tensor
    padded_index: torch.Tensor

    def unpack(self, per_token: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """A packed per-token output [N] at the padded positions ([B, T], zero elsewhere)."""
        out = torch.zeros(shape[0] * shape[1], dtype=per_token.dtype, device=per_token.device)
        taken = self.padded_index >= 0
        out[self.padded_index[taken].to(out.device)] = per_token[taken.to(per_token.device)]
        return out.view(shape)


def pack(batch: dict, seed: int, *, empty_segments: str = "prompt_only") -> PackedBatch:
    """``batch`` (from :func:`surrogate_batch`) packed row by row: segment i is a prompt
    of 0 to 3 masked tokens, then row i's valid tokens. A response with no token is a
    segment of its prompt alone (``empty_segments="prompt_only"``) or of no token at all
    (``"zero_length"``)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    mask = batch["response_mask"]
    rows, width = mask.shape
    pieces = {key: [] for key in PER_TOKEN_KEYS}
    index, lengths = [], []
    for row in range(rows):
        valid = mask[row].nonzero().flatten()
        prompt = int(torch.randint(0, 4, (), generator=generator))
        if valid.numel() == 0 and empty_segments == "zero_length":
            prompt = 0
        for key in PER_TOKEN_KEYS:
            values = batch[key][row]
            if key == "response_mask":
                pieces[key].append(torch.cat([torch.zeros(prompt, dtype=torch.bool), values[valid]]))
            else:
                poison = torch.full((prompt,), float("nan"), dtype=values.dtype)
                poison[::2] = float("inf")
                pieces[key].append(torch.cat([poison, values[valid]]))
        index.append(torch.cat([torch.full((prompt,), -1), row * width + valid]))
        lengths.append(prompt + valid.numel())
    tensors = {key: torch.cat(value) for key, value in pieces.items()}
    tensors.update({key: value for key, value in batch.items() if key not in PER_TOKEN_KEYS})
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    return PackedBatch(tensors, cu_seqlens, torch.cat(index))


def run_surrogate_packed(backend: str, packed: PackedBatch, logprobs, response_mask, kwargs) -> Outputs:
    """The public loss on a packed batch: as :func:`run_surrogate`, with ``cu_seqlens``."""
    logprobs = logprobs.detach().requires_grad_()
    loss, metrics = fused_hadw_grpo_loss(
        logprobs, response_mask=response_mask, cu_seqlens=packed.cu_seqlens.to(logprobs.device),
        return_metrics=True, backend=backend, check_values=False, **with_required(kwargs)
    )
    (loss * UPSTREAM).backward()
    return Outputs({"loss": loss.detach(), "grad_logprobs": logprobs.grad}, metrics)
