"""The public losses: check the inputs, resolve the options, pick a backend, run it."""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, cast

import torch

from .advantage.group import call_advantages, group_metrics
from .backends import check_backend_name, resolve_backend
from .batch.active_rows import RowSelection, active_rows
from .batch.inputs import CallInputs, LinearHead, LinearInputs, SurrogateBatch
from .checks.arguments import check_temperature, device_of
from .checks.validation import check_linear_inputs, linear_batch, surrogate_batch
from .checks.values import assert_label_range, check_label_range
from .config.call_config import LINEAR_ONLY_OPTIONS, call_config
from .config.loss_config import LossConfig
from .config.option_types import LossOptions
from .formulas.aggregation import agg_weights, aggregate
from .formulas.correction import correct, needs_current_logprobs
from .formulas.token_terms import kl_estimate, masked_mean, own_token_ratio, token_ratio
from .objectives.table import OBJECTIVES
from .ops import attach_single_use_gradients
from .tables.linear_blocks import IGNORE_INDEX, check_block_rows, check_linear_path
from .tables.metrics import ordered_metrics
from .tables.precision import accumulate_dtype

if TYPE_CHECKING:
    from typing_extensions import Unpack

Metrics = dict[str, torch.Tensor]


def fused_hadw_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    rewards: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    config: LossConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    anchor: float | torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    batch_totals: torch.Tensor | None = None,
    prior: torch.Tensor | None = None,
    return_metrics: bool = False,
    backend: str = "auto",
    check_values: bool = True,
    **options: Unpack[LossOptions],
) -> torch.Tensor | tuple[torch.Tensor, Metrics]:
    """The group-relative clipped surrogate with HA-DW, from per-token log-probs.

    The loss's options come either from ``config`` (a :class:`LossConfig`, e.g.
    ``LossConfig.build("dapo", group_size=8, beta=0.04)``, built once) or from the
    keywords of :class:`LossOptions` (``loss_type``, ``group_size``, ... below; None or
    left out: the preset's value or the default), never both.

    A batch comes padded (per-token tensors [B, T], one response per row) or packed
    (padding-free: per-token tensors [N] or [1, N] and ``cu_seqlens``, one response per
    segment; docs/options.md, "Packed batches"). Below, [B] is one value per response:
    per segment, [S], when packed.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy.
        old_logprobs: [B, T] the same under the behaviour policy; None means on-policy
            (the detached current log-probs: ratio 1, as TRL's and Liger's default).
        rewards: [B] with ``group_size``, each group's responses contiguous: the fused
            path computes A_hat (and Phi with ``anchor``) in the kernel; None when
            ``advantages`` are given. A call that cannot guarantee contiguous, complete
            groups (rows shuffled or split into micro-batches, as TRL and verl do) must
            pass ``advantages`` instead, or ``group_index`` to have the grouping checked.
        response_mask: [B, T], 1 on response tokens, 0 on padding (bool or 0/1).
        config: the resolved options, instead of the option keywords.
        cu_seqlens: [S+1] int32 or int64 offsets of a packed batch's segments
            (flash-attention's: 0 first, N last, non-decreasing; segment i is tokens
            cu_seqlens[i]:cu_seqlens[i+1]); None for a padded batch. A segment may hold
            its prompt too (masked out); one with no counted token is an empty response.
        advantages: [B] per-response advantages computed elsewhere, e.g. by
            :func:`hadw_advantages` over the whole rollout batch, or [B, T] per token
            (verl's, process rewards); rows may then come in any order and any split.
        group_index: [B] group id of each row (verl's uid as integers): checks that the
            rows of each group are contiguous and complete.
        loss_type: a preset (``presets.LOSS_PRESETS``: TRL's loss types, "grpo" the
            default, and verl's policy losses; docs/options.md); each of its choices can
            be overridden below.
        objective, ratio_level: the per-token loss (a row of ``objectives.table.OBJECTIVES``) and
            the ratio's form ("token", "sequence", "gspo_token"); docs/math.md, section 5.
        loss_agg_mode: verl's aggregation ("token-mean", "seq-mean-token-mean",
            "seq-mean-token-sum", "seq-mean-token-sum-norm") or "token-sum".
        normalize_std, std_eps: divide A by the group's std (+ std_eps; TRL uses 1e-4).
        anchor: the difficulty belief C in [0, 1] (a float or 0-d tensor, e.g. from
            ``DifficultyAnchor.update``); None runs the plain algorithm without HA-DW.
        lambda_scale: Phi's scale (default and paper: 1.3; the authors' code: 1.5).
        epsilon_low, epsilon_high: clip range; default by loss type.
        beta, kl_estimator, ref_logprobs: KL penalty to a reference policy (default
            beta 0: none), aggregated like the loss; estimators k1, k2, k3 (the default,
            verl's low_var_kl), abs.
        dual_clip, delta, ratio_cap, sapo_temperature_pos, ...: the objectives' own
            options, each read by the objectives whose row of ``objectives.table.OBJECTIVES``
            names it (docs/options.md).
        importance_weights: detached rollout-engine correction, [B, T] or [B] (packed:
            [N] or [1, N], or [S]; a 1-D tensor of length S is per response),
            multiplying each token's loss in every ratio form.
        rollout_logprobs: [B, T] the rollout engine's log-probs of the sampled tokens
            (vLLM's), read by ``rollout_correction`` and ``off_policy_mask_threshold``.
        rollout_correction: a :class:`RolloutCorrection` (TRL's vLLM importance-sampling
            modes, verl's TIS, IcePop, batch normalisation and rejection filters): the
            weights and filters formed from ``old_logprobs`` and ``rollout_logprobs``
            inside the call (docs/options.md, "Rollout correction").
        off_policy_mask_threshold: TRL's off-policy sequence mask (DeepSeek-V3.2): a
            response of negative advantage whose mean (rollout - current) log-prob
            exceeds it leaves the loss's numerator.
        top_entropy_quantile, entropy: keep the policy term of the tokens whose
            ``entropy`` [B, T] is at or above the (1 - q) quantile of the counted tokens'
            (over every rank when torch.distributed is initialised).
        kl_bias_correction: the KL term of each token weighed by its ratio (TRL's
            use_bias_correction_kl); kl_bias_ratio: which ratio, "objective" (the
            objective's, in its ratio form) or "token" (each token's own, as TRL at
            importance_sampling_level="token" whatever the objective).
        loss_normalizer: the batch's count that replaces this call's in the aggregation
            (valid tokens for token-mean, responses for the seq-mean modes): pass the
            whole rollout batch's count to every micro-batch and their losses add up to
            the big-batch loss.
        max_response_length: L of seq-mean-token-sum-norm (Dr.GRPO; default: T;
            required with ``loss_normalizer`` and in a packed batch, which has no width).
        generator: the random draws of an objective that draws its tokens (clip_cov:
            ``torch.randperm``'s generator; None: the global one, as verl).
        advantage_estimator: the baseline of the advantage formed from ``rewards``
            (docs/math.md, section 2a), inside the kernels' launch: "grpo", "rloo",
            "james_stein" or "prompt_history" (which reads ``prior``).
        batch_totals: with ``advantage_estimator="james_stein"``, the whole rollout
            batch's sums (:func:`~hadw_kernels.batch_totals`, this call's groups
            among them): each group shrinks toward the batch's other groups, not the
            call's. Without it the call's groups are the batch, which must hold two or
            more, on one process (a call of one group, or under torch.distributed, is
            refused: each rank's would shrink over its own groups alone).
        prior: with ``advantage_estimator="prompt_history"``, each response's
            pseudo-counts (alpha, beta) [B, 2], ``PromptHistory.update``'s for the
            rollout batch, in its rows' order (a group's rows alike; rewards in [0, 1]).
        return_metrics: also return a dict of 0-d tensors (metrics.METRIC_NAMES).
        backend: "auto", "torch", "triton" or "cpp".
        check_values: check finite inputs at response tokens, a 0/1 mask, rewards and
            anchor in [0, 1] under HA-DW (one host sync on CUDA; False in a hot loop,
            where a NaN input gives a NaN loss).

    An empty batch (B = 0, or no response token) gives a loss of exactly 0 with zero
    metrics and zero gradients.
    """
    check_backend_name(backend)
    config = call_config(config, options, linear=False)
    call = CallInputs(logprobs, old_logprobs, response_mask, cu_seqlens, rewards, advantages, group_index, anchor,
                      ref_logprobs, importance_weights, rollout_logprobs, entropy, generator, batch_totals, prior)
    batch = surrogate_batch(config, call, check_values=_checks_run(check_values), with_metrics=return_metrics)
    implementation = resolve_backend(backend, logprobs.device)
    loss, metrics = _corrected_surrogate(implementation, batch)
    if not return_metrics:
        return loss
    return loss, metrics


def _corrected_surrogate(implementation, batch: SurrogateBatch):
    """The backend's surrogate op on ``batch``, with the rollout correction and token masks
    (correction.py) folded into its mask and importance weights, and the bias-corrected
    KL term added: every backend applies them in its kernels as it applies a caller's
    weights, so they compose with every objective. ``batch.entropy``: what the op takes
    (the linear loss's, with its gradient: bonus and metric); ``batch.mask_entropy``: what
    the entropy mask reads. An objective that selects tokens (its row's selection)
    selects them here, over the tokens the correction leaves counted, with
    ``batch.generator``."""
    config, layout = batch.config, batch.layout
    logprobs, old_logprobs = batch.current_logprobs(), batch.behaviour_logprobs()
    corrected_metrics = {}
    selection = OBJECTIVES[config.objective].selection
    # Each token's advantage (A_hat Phi from rewards, or the caller's), for the rules that
    # read it: the off-policy mask its sign, the bias-corrected KL GMPO's clip side, the
    # selections their covariance.
    token_advantage = None
    if config.off_policy_mask_threshold is not None or config.kl_bias_correction or selection is not None:
        token_advantage, _, _ = call_advantages(batch)
    if _has_correction(config):
        correction = correct(batch, token_advantage=token_advantage)
        mask, importance_weights = _fold(correction, batch.mask, batch.importance_weights, logprobs.dtype)
        entropy = batch.entropy
        if entropy is not None and correction.entropy_keep is not None and config.entropy_coef > 0:
            # The entropy bonus acts on the tokens the entropy mask keeps, as TRL's; the
            # metric stays the mean over every counted token.
            corrected_metrics["entropy_mean"] = masked_mean(entropy.detach(), mask.bool())
            entropy = entropy * correction.entropy_keep.to(entropy.dtype)
        corrected_metrics.update(correction.metrics)
        batch = batch.replace(mask=mask, importance_weights=importance_weights, entropy=entropy)
    if selection is not None:
        counted = batch.mask.bool()
        token_advantage = cast(torch.Tensor, token_advantage)  # formed above for every objective that selects
        selected = selection(logprobs.detach(), old_logprobs.detach(), token_advantage.to(logprobs.dtype), counted,
                             config, batch.generator)
        if batch.with_metrics:
            corrected_metrics["selected_frac"] = masked_mean(selected, counted)
        batch = batch.replace(selected=selected)
    if config.kl_bias_correction:
        kernel_config = dataclasses.replace(config, beta=0.0, kl_bias_correction=False, kl_bias_ratio="objective")
        loss, metrics = implementation.surrogate_loss(batch.replace(config=kernel_config, ref_logprobs=None))
        kl_term, metrics["ref_kl"] = _bias_corrected_kl(logprobs, old_logprobs, batch.mask.bool(), layout, config,
                                                        batch.ref_logprobs, token_advantage)
        loss = loss + kl_term
    else:
        loss, metrics = implementation.surrogate_loss(batch)
    if not batch.with_metrics:
        return loss, {}
    metrics.update(corrected_metrics)
    return loss, ordered_metrics(metrics)


def _fold(correction, mask, importance_weights, dtype):
    """(mask, importance weights) with a correction's filters and weights folded in."""
    if correction.keep is not None:
        mask = (mask.bool() & correction.keep).to(mask.dtype)
    if correction.weights is not None:
        weights = correction.weights.to(accumulate_dtype(dtype))
        importance_weights = weights if importance_weights is None else importance_weights * weights
    return mask, importance_weights


def _has_correction(config: LossConfig) -> bool:
    return config.rollout_correction is not None or needs_current_logprobs(config)


def _bias_corrected_kl(logprobs, old_logprobs, mask, layout, config, ref_logprobs, token_advantage):
    """beta x the aggregated k(l, l_ref) x rho, rho the ratio ``config.kl_bias_ratio`` names
    with its gradient (TRL's use_bias_correction_kl), and the metric: the corrected
    estimate's mean. On [N] tensors through autograd, beside the backend's op
    (docs/math.md, section 5d)."""
    advantage = torch.where(mask, token_advantage.to(logprobs.dtype), torch.zeros_like(logprobs))
    if config.kl_bias_ratio == "token":
        ratio = own_token_ratio(logprobs, old_logprobs.detach(), mask)
    else:
        ratio, _, _ = token_ratio(logprobs, old_logprobs.detach(), mask, advantage, layout, config)
    zero = torch.zeros_like(logprobs)
    own = torch.where(mask, logprobs, zero)
    corrected = kl_estimate(own, torch.where(mask, ref_logprobs.detach(), zero), config.kl_estimator) * ratio
    corrected = torch.where(mask, corrected, zero)
    return config.beta * aggregate(corrected, mask, layout, config), masked_mean(corrected.detach(), mask)


def fused_linear_hadw_grpo_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    rewards: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    config: LossConfig | None = None,
    cu_seqlens: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    anchor: float | torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    block_rows: int | None = None,
    linear_path: str = "auto",
    generator: torch.Generator | None = None,
    batch_totals: torch.Tensor | None = None,
    prior: torch.Tensor | None = None,
    return_metrics: bool = False,
    backend: str = "auto",
    check_values: bool = True,
    **options: Unpack[LossOptions],
) -> torch.Tensor | tuple[torch.Tensor, Metrics]:
    """The same loss from hidden states [B, T, H] and the LM head [V, H].

    ``labels`` [B, T] are the sampled tokens (already shifted: hidden state t predicts
    label t). Packed (``cu_seqlens`` given): hidden states [N, H] or [1, N, H] and labels
    and the other per-token tensors [N] or [1, N]. The log-probs of the labels are formed block by block, never as [B*T, V]
    logits; padding rows (and every row whose label is ignored) enter no GEMM, except on
    the triton and torch backends with ``check_values=False`` or under ``torch.compile``,
    where no count of them is read (docs/architecture.md, "Which rows enter the GEMMs"). ``entropy_coef`` (an option of ``config``; default
    0) subtracts the aggregated entropy of the token distribution (an exploration bonus). Under DeepSpeed ZeRO-3 pass the
    gathered LM head (``GatheredParameters``), see docs/architecture.md, "Calling the linear loss".

    ``linear_path``: "gradients_in_forward" forms the gradients with respect to the
    hidden states and the head while each block's logits are at hand (three GEMMs:
    token-level losses, on backends that have it: cpp, triton); "recompute" forms the
    log-probs, then backward recomputes the logits (four GEMMs; any loss, GSPO
    included); "auto" picks the first that applies. ``block_rows``: rows whose logits
    are held at once, a [block_rows, V] buffer (default: per backend and device,
    docs/architecture.md, "The linear loss"). Other arguments as in :func:`fused_hadw_grpo_loss`.
    """
    check_backend_name(backend)
    config = call_config(config, options, linear=True)
    _check_linear_options(linear_path=linear_path, block_rows=block_rows, temperature=temperature)
    # Resolved first: whether the checks' read counts the active rows is the backend's.
    implementation = resolve_backend(backend, device_of("hidden_states", hidden_states))
    call = CallInputs(None, old_logprobs, response_mask, cu_seqlens, rewards, advantages, group_index, anchor,
                      ref_logprobs, importance_weights, rollout_logprobs, None, generator, batch_totals, prior)
    linear = LinearInputs(hidden_states, lm_head_weight, labels, lm_head_bias, temperature, ignore_index, block_rows)
    batch, head = linear_batch(config, call, linear, select_rows=not implementation.compacts_rows,
                               check_values=_checks_run(check_values), with_metrics=return_metrics)
    corrected_metrics = {}
    old = batch.old_logprobs
    if _has_correction(batch.config) and not _reads_current_policy(batch.config, old is not None):
        # Weights and filters from the behaviour and rollout log-probs alone: formed before
        # the sweep, whose rejected rows then enter no GEMM.
        correction = correct(batch, token_advantage=None)
        mask, importance_weights = _fold(correction, batch.mask, batch.importance_weights,
                                         batch.behaviour_logprobs().dtype)
        head = head.replace(labels=head.labels.masked_fill(head.rows.take(~mask.bool()), head.ignore_index))
        corrected_metrics.update(correction.metrics)
        batch = batch.replace(config=dataclasses.replace(batch.config, rollout_correction=None), mask=mask,
                              importance_weights=importance_weights)
    config = batch.config
    path = _linear_path(linear_path, implementation, config, hidden_states.device, old)
    with_entropy = config.entropy_coef > 0 or return_metrics or config.top_entropy_quantile < 1.0
    if path == "gradients_in_forward":
        loss, metrics = _gradients_in_forward(implementation, head, batch, with_entropy)
    else:
        logprobs, entropy = implementation.token_logprobs(
            head.hidden, head.weight, head.labels, with_entropy=with_entropy, lm_head_bias=head.bias,
            temperature=head.temperature, ignore_index=head.ignore_index,
        )
        logprobs, entropy = head.rows.put(logprobs), head.rows.put(entropy)
        batch = batch.replace(logprobs=logprobs, old_logprobs=logprobs.detach() if old is None else old,
                              entropy=entropy, mask_entropy=entropy)
        loss, metrics = _corrected_surrogate(implementation, batch)
    if not return_metrics:
        return loss
    metrics.update(corrected_metrics)
    return loss, ordered_metrics(metrics)


def _reads_current_policy(config: LossConfig, old_logprobs_given: bool) -> bool:
    """Whether a correction or mask reads the current policy's log-probs or entropies (the
    off-policy and entropy masks, the bias-corrected KL, a rollout weight of an on-policy
    call, whose behaviour log-probs are the current ones): the linear loss then forms them
    first (its recompute path)."""
    on_policy_weight = config.rollout_correction is not None and not old_logprobs_given
    return (needs_current_logprobs(config) or config.kl_bias_correction or on_policy_weight
            or OBJECTIVES[config.objective].selects_tokens)


def _check_linear_options(*, linear_path, block_rows, temperature) -> None:
    check_linear_path(linear_path)
    check_block_rows(block_rows)
    check_temperature(temperature)


def call_options(function) -> set[str]:
    """Every keyword option of ``function`` (one of the two losses): its keyword-only
    parameters and the loss's options (:class:`LossOptions`)."""
    parameters = inspect.signature(function).parameters
    named = {name for name, parameter in parameters.items() if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    loss_options = set(LossOptions.__annotations__)
    if function is not fused_linear_hadw_grpo_loss:
        loss_options -= set(LINEAR_ONLY_OPTIONS)
    return named | loss_options


def check_options(function, **options) -> None:
    """Every check of ``function``'s (one of the two losses) options that needs no
    tensor, with its defaults for the options not given: the checks a call runs first,
    run here without one (the modules call it when they are built)."""
    parameters = inspect.signature(function).parameters
    values = {name: parameter.default for name, parameter in parameters.items()
              if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    values.update((name, value) for name, value in options.items() if name in values)
    loss_options = {name: value for name, value in options.items() if name not in values}
    linear = function is fused_linear_hadw_grpo_loss
    check_backend_name(values["backend"])
    call_config(values["config"], loss_options, linear=linear)
    if linear:
        _check_linear_options(**{name: values[name] for name in ("linear_path", "block_rows", "temperature")})


def _checks_run(check_values: bool) -> bool:
    """Whether the value checks run: as asked, except under ``torch.compile``, which
    cannot branch on a tensor's value. A compiled call checks shapes, dtypes and devices
    (while tracing) but no values, as ``check_values=False`` (docs/architecture.md,
    "torch.compile")."""
    return check_values and not torch.compiler.is_compiling()


def refuse_gradients_in_forward(config: LossConfig, old_logprobs_given: bool = True,
                                option: str = "linear_path") -> None:
    """Raises where ``config`` cannot take the gradients-in-forward path: a ratio per
    response, or a correction or mask that reads the batch's log-probs first (with
    ``old_logprobs_given`` False, a rollout correction of an on-policy call reads them
    too). ``option``: the name the caller knows the path's option by."""
    if config.sequence_level:
        raise ValueError(
            f"{option}='gradients_in_forward' needs a token ratio: with ratio_level={config.ratio_level!r} "
            f"(objective {config.objective!r}) a token's gradient depends on every log-prob of its response; "
            "use 'recompute' or 'auto'"
        )
    if _reads_current_policy(config, old_logprobs_given):
        raise ValueError(
            f"{option}='gradients_in_forward' forms each token's gradient before the batch's log-probs are "
            "known: off_policy_mask_threshold, top_entropy_quantile < 1, kl_bias_correction, a rollout "
            "correction without old_logprobs and an objective that selects tokens (clip_cov, kl_cov) read them "
            "first; use 'recompute' or 'auto'"
        )


def _linear_path(requested: str, implementation, config: LossConfig, device: torch.device,
                 old_logprobs: torch.Tensor | None) -> str:
    available = implementation.linear_surrogate is not None and implementation.has_gradients_in_forward(device)
    reads_current = _reads_current_policy(config, old_logprobs is not None)
    if requested == "auto":
        return "gradients_in_forward" if available and not config.sequence_level and not reads_current \
            else "recompute"
    if requested == "gradients_in_forward":
        refuse_gradients_in_forward(config, old_logprobs is not None)
        if not available:
            raise ValueError(f"backend {implementation.name!r} has no gradients-in-forward path here")
    return requested


def _gradients_in_forward(implementation, head: LinearHead, batch: SurrogateBatch, with_entropy: bool):
    """One sweep forms the log-probs and the gradients; the surrogate op then gives the
    loss value and the metrics from the log-probs (its gradient is the one already
    formed), and backward scales the stored gradients. The sweep runs over ``head``'s
    rows, its per-token inputs (each token's advantage among them) taken and its per-row
    outputs put back at them; every per-token tensor after it is [N]."""
    config, layout, rows = batch.config, batch.layout, head.rows
    token_advantage, _, phi = call_advantages(batch)
    swept = batch.replace(mask=rows.take(batch.mask), old_logprobs=rows.take(batch.old_logprobs),
                          rewards=None, advantages=rows.take(token_advantage), response_advantages=None, anchor=None,
                          ref_logprobs=rows.take(batch.ref_logprobs),
                          importance_weights=rows.take(batch.importance_weights))
    logprobs, entropy, grad_hidden, grad_weight, grad_bias = implementation.linear_surrogate(
        head, swept, rows.take(layout.expand(agg_weights(batch.mask.bool(), layout, config))), with_entropy,
    )
    logprobs, grad_hidden = rows.put(logprobs), rows.put(grad_hidden)
    entropy = rows.put(entropy) if with_entropy else None
    loss, metrics = implementation.surrogate_loss(batch.replace(
        logprobs=logprobs, old_logprobs=logprobs if batch.old_logprobs is None else batch.old_logprobs,
        rewards=None, advantages=token_advantage, response_advantages=None, anchor=None,
        entropy=entropy,
    ))
    if phi is not None and batch.rewards is not None and batch.with_metrics:  # phi is formed from rewards alone
        metrics.update(group_metrics(batch.rewards, phi, config.reward_group_size()))
        metrics = ordered_metrics(metrics)
    inputs = [head.hidden_states, head.weight, head.bias]
    gradients = [grad_hidden.view_as(head.hidden_states), grad_weight, None if head.bias is None else grad_bias]
    return attach_single_use_gradients(loss, inputs, gradients, implementation.scale_in_place), metrics


def token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
    backend: str = "auto",
    check_values: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` under softmax(h W^T / temperature), without the logits:
    e.g. the old policy's log-probs before an update. ``hidden_states`` [..., H] (padded
    [B, T, H], packed [N, H] or [1, N, H]) and ``labels`` of the same leading shape, which
    the log-probs take. Differentiable; returns ``(logprobs, entropy)`` with
    ``with_entropy=True``. Ignored labels give 0; a label outside the vocabulary is an
    error on every call (``check_values`` or not). ``check_values`` is kept for symmetry
    with the losses: with it (the default) the label check's one host read also counts the
    rows whose label counts, and only those enter the GEMMs (as in the loss)."""
    check_linear_inputs(hidden_states, lm_head_weight, labels, lm_head_bias, temperature)
    implementation = resolve_backend(backend, hidden_states.device)
    flat_labels = labels.reshape(-1)
    active = count = None
    if _checks_run(check_values):
        active = _rows_to_count(implementation, flat_labels, ignore_index)
        count = check_label_range(flat_labels, lm_head_weight.shape[0], ignore_index, active=active)
    else:
        assert_label_range(labels, lm_head_weight.shape[0], ignore_index)
    rows = RowSelection.of(active, count)
    logprobs, entropy = implementation.token_logprobs(
        rows.take(hidden_states.reshape(-1, hidden_states.shape[-1])),
        lm_head_weight,
        rows.take(flat_labels),
        lm_head_bias=lm_head_bias,
        temperature=temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
    )
    logprobs = rows.put(logprobs).view(labels.shape)
    if not with_entropy:
        return logprobs
    if entropy is None:  # Backend.token_logprobs forms it when asked
        raise RuntimeError(f"backend {implementation.name!r} formed no entropy with with_entropy=True")
    return logprobs, rows.put(entropy).view(labels.shape)


def _rows_to_count(implementation, labels: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The active rows whose count a checked call reads with its values, so that the
    backend sweeps them alone; None where the backend finds them itself (active_rows.py)."""
    return None if implementation.compacts_rows else active_rows(labels, ignore_index)
