"""HA-DW and the fused surrogate in verl (0.9.1 up to 0.10, checked on import: versions.py),
through verl's own registries.

Importing this module registers, in ``verl.trainer.ppo.core_algos``:

- the advantage estimator ``"hadw"``: verl's GRPO advantage (groups by ``uid``, std
  normalisation by ``algorithm.norm_adv_by_std_in_grpo``) times the HA-DW weight Phi,
  with the difficulty anchor folded once per training step over the whole batch;
- the policy losses ``"hadw"`` (verl's ``vanilla``: token ratio, dual clip at
  ``clip_ratio_c``) and ``"hadw_gspo"`` (verl's ``gspo``: sequence ratio), computed by
  :func:`hadw_kernels.fused_hadw_grpo_loss` with verl's ``loss_agg_mode`` and its
  global-batch normalisation, so they return verl's loss on the same tensors.

``pip install hadw-kernels[verl]`` declares this module as a ``verl.plugins`` entry point,
which verl imports in every process of a run: the names above are then known without
user code. The lines a verl user adds (docs/integrations/verl.md)::

    algorithm.adv_estimator=hadw
    actor_rollout_ref.actor.policy_loss.loss_mode=hadw        # or hadw_gspo
    trainer.checkpoint_callback_class=hadw_kernels.integrations.verl.HADWCheckpointCallback
    +algorithm.hadw.lambda_scale=1.3                          # optional, HADW_OPTIONS

The anchor lives in the driver process, where verl's trainer computes advantages; the
checkpoint callback writes it next to verl's ``data.pt`` in each ``global_step_N``
folder and restores it when verl resumes from one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from .versions import require_supported

# Before verl itself is imported: an unsupported release fails here, naming the range.
require_supported("verl")

import numpy as np
import torch
from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from ..advantage import hadw_advantages
from ..anchor import DifficultyAnchor
from ..config import DEFAULT_LAMBDA_SCALE, DEFAULT_STD_EPS, LOG_RATIO_CLAMP, check_finite_positive
from ..loss import fused_hadw_grpo_loss
from .rewards import require_unit_interval

logger = logging.getLogger(__name__)

ADVANTAGE_ESTIMATOR = "hadw"
TOKEN_LEVEL_LOSS = "hadw"
SEQUENCE_LEVEL_LOSS = "hadw_gspo"
ANCHOR_FILE = "hadw_anchor.json"

# The keys of algorithm.hadw and their defaults. "anchor" holds DifficultyAnchor's
# arguments (rule, eta, window, eta_min, belief, initial). std_eps is verl's GRPO epsilon.
HADW_OPTIONS = {"enable": True, "lambda_scale": DEFAULT_LAMBDA_SCALE, "std_eps": DEFAULT_STD_EPS, "anchor": {}}

# The driver's anchor: the estimator folds each step's rewards into it, the checkpoint
# callback saves and restores it. verl runs both in the driver process.
_driver_anchor: DifficultyAnchor | None = None


# The anchor's keys that take a word; the others take numbers.
_ANCHOR_WORDS = ("rule", "belief")


def _refuse_string(key: str, value) -> None:
    # A quoted YAML value ("1.3") reaches us as a string. verl passes it on unchecked;
    # it is refused here, naming the key, rather than converted or failing deep inside.
    if isinstance(value, str):
        raise ValueError(f"{key} must be a number, got the string {value!r}: write it without quotes in the YAML "
                         "or on the command line (verl passes quoted values on as strings)")


def hadw_options(algorithm_config: Mapping | None) -> dict[str, Any]:
    """``algorithm.hadw`` merged over :data:`HADW_OPTIONS` and checked: unknown keys,
    a non-bool ``enable``, a ``lambda_scale`` or ``std_eps`` that is not a finite
    positive number (a string included) and anchor arguments DifficultyAnchor refuses
    raise ValueError naming the key."""
    given = {} if algorithm_config is None else algorithm_config.get("hadw", None) or {}
    unknown = set(given) - set(HADW_OPTIONS)
    if unknown:
        raise ValueError(f"algorithm.hadw: unknown keys {sorted(unknown)}; expected some of {sorted(HADW_OPTIONS)}")
    options = {**HADW_OPTIONS, **{key: given[key] for key in given}}
    if not isinstance(options["enable"], bool):
        raise ValueError(f"algorithm.hadw.enable must be true or false, got {options['enable']!r}")
    for key in ("lambda_scale", "std_eps"):
        _refuse_string(f"algorithm.hadw.{key}", options[key])
        check_finite_positive(f"algorithm.hadw.{key}", options[key])
    anchor = options["anchor"] or {}
    if not isinstance(anchor, Mapping):
        raise ValueError(f"algorithm.hadw.anchor must be a mapping of DifficultyAnchor's arguments, got {anchor!r}")
    options["anchor"] = dict(anchor)
    for key, value in options["anchor"].items():
        if key not in _ANCHOR_WORDS:
            _refuse_string(f"algorithm.hadw.anchor.{key}", value)
    try:
        DifficultyAnchor(**options["anchor"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"algorithm.hadw.anchor: {error}") from None
    return options


def driver_anchor(anchor_options: Mapping) -> DifficultyAnchor:
    """The driver's anchor, built from ``algorithm.hadw.anchor`` on first use."""
    global _driver_anchor
    wanted = DifficultyAnchor(**anchor_options)
    if _driver_anchor is None:
        _driver_anchor = wanted
    elif _driver_anchor.state_dict()["config"] != wanted.state_dict()["config"]:
        raise ValueError(
            f"algorithm.hadw.anchor changed within a run: the anchor holds {_driver_anchor.state_dict()['config']}, "
            f"the config asks for {wanted.state_dict()['config']}. A new run in the same process starts with "
            "hadw_kernels.integrations.verl.reset_driver_anchor()"
        )
    return _driver_anchor


def reset_driver_anchor() -> None:
    """Forgets the driver's anchor (a new run in the same process, tests)."""
    global _driver_anchor
    _driver_anchor = None


@register_adv_est(ADVANTAGE_ESTIMATOR)
def compute_hadw_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Mapping | None = None,
    **_unused,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's outcome advantage times Phi, broadcast over each response's tokens.

    ``token_level_rewards`` [B, T] sum to one reward per response; ``index`` holds the
    ``uid`` of each row (its prompt): rows may come in any order, groups of any size of
    at least 2. With ``algorithm.hadw.enable`` the rewards must lie in [0, 1]; the
    anchor is updated once per call, which verl makes once per training step over the
    whole batch. Returns (advantages, returns), both [B, T], as verl's GRPO does.
    """
    if index is None:
        raise ValueError("the hadw advantage estimator groups responses by their uid, which verl passes as index=")
    options = hadw_options(config)
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        # verl's own GRPO estimator would broadcast a mismatched mask; refused here.
        raise ValueError(
            f"token_level_rewards has shape {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)}: both must be the same [B, T] (verl's grpo estimator would broadcast "
            "one against the other; the hadw estimator refuses)"
        )
    scores = token_level_rewards.sum(dim=-1)
    uids = np.asarray(index).reshape(-1)
    if uids.shape[0] != scores.shape[0]:
        raise ValueError(f"index has {uids.shape[0]} uids for {scores.shape[0]} responses")
    group_index = torch.as_tensor(np.unique(uids, return_inverse=True)[1].reshape(-1), device=scores.device)
    belief = None
    if options["enable"]:
        require_unit_interval(scores, "scale them into [0, 1] in the reward function (compute_score)")
        belief = driver_anchor(options["anchor"]).update(scores)
    normalize_std = True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True))
    advantages = hadw_advantages(
        scores, group_index=group_index, anchor=belief, lambda_scale=options["lambda_scale"],
        normalize_std=normalize_std, std_eps=options["std_eps"],
    )
    advantages = advantages.to(scores.dtype)[:, None] * response_mask
    return advantages, advantages


def _per_response(values: torch.Tensor, response_mask: torch.Tensor, name: str, explain: str) -> torch.Tensor:
    """[B, T] values constant over each response's valid tokens to one per response [B]
    (0 for a response without valid tokens); ``explain`` follows the rows that vary."""
    mask = response_mask.bool()
    if values.shape != mask.shape:
        raise ValueError(f"{name} have shape {tuple(values.shape)}, response_mask {tuple(mask.shape)}")
    first_valid = values.gather(1, mask.to(torch.int8).argmax(dim=1, keepdim=True))
    varies = (mask & (values != first_valid)).any(dim=1)
    if bool(varies.any()):
        rows = varies.nonzero().flatten()[:8].tolist()
        raise ValueError(f"the {name} of rows {rows} vary over their valid tokens: {explain}")
    return torch.where(mask.any(dim=1), first_valid.squeeze(1), torch.zeros_like(first_valid.squeeze(1)))


def advantage_per_response(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] advantages, constant over each response's valid tokens (what verl's outcome
    estimators give), to one per response [B]; a response without valid tokens gets 0."""
    return _per_response(
        advantages, response_mask, "advantages",
        f"the {TOKEN_LEVEL_LOSS}/{SEQUENCE_LEVEL_LOSS} policy losses take one advantage per response; a per-token "
        "estimator (gae, ...) needs verl's own losses; outcome estimators (grpo, hadw, rloo, ...) give one value "
        "per response",
    )


def response_is_weights(rollout_is_weights: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's rollout_is_weights [B, T] to one per response [B]: verl's sequence-level
    correction (``rollout_is="sequence"``) broadcasts one weight over each response's
    tokens. Per-token weights are refused: GSPO's ratio is per response (verl's own gspo
    multiplies each token's loss by its weight; the fused loss is stricter)."""
    return _per_response(
        rollout_is_weights, response_mask, "rollout_is_weights",
        f"the {SEQUENCE_LEVEL_LOSS} policy loss (GSPO, a ratio per response) takes one rollout weight per "
        "response (algorithm.rollout_correction with rollout_is='sequence'); per-token weights would weigh each "
        "token's share of one response's loss differently. verl's own gspo accepts them; this loss is stricter",
    )


def batch_normalizer(
    loss_agg_mode: str, response_mask: torch.Tensor, global_batch_info: Mapping
) -> tuple[float | None, int | None]:
    """(loss_normalizer, max_response_length) that make the fused loss equal verl's
    ``agg_loss`` with ``**global_batch_info``.

    verl divides the micro-batch's sum by the global count (valid tokens, or responses)
    and multiplies by dp_size, since data-parallel ranks average their gradients: the
    normaliser is count / dp_size. Without global counts (one process), verl counts this
    call's valid tokens or its responses that have any valid token; the fused loss alone
    would count every response, so the count is passed.
    """
    mask = response_mask.bool()
    dp_size = global_batch_info.get("dp_size") or 1
    if loss_agg_mode == "token-sum":
        return 1.0 / dp_size, None
    if loss_agg_mode == "token-mean":
        count = global_batch_info.get("batch_num_tokens")
        if count is None:
            if dp_size > 1:
                raise ValueError(
                    "loss_agg_mode='token-mean' with dp_size > 1 needs global_batch_info['batch_num_tokens']"
                )
            count = int(mask.sum())
        return (float(count) / dp_size if count > 0 else None), None
    count = global_batch_info.get("global_batch_size")
    if count is None:
        if dp_size > 1:
            raise ValueError(
                f"loss_agg_mode={loss_agg_mode!r} with dp_size > 1 needs global_batch_info['global_batch_size']"
            )
        count = int(mask.any(dim=1).sum())
    normalizer = float(count) / dp_size if count > 0 else None
    if loss_agg_mode != "seq-mean-token-sum-norm":
        return normalizer, None
    scale = global_batch_info.get("loss_scale_factor")
    if scale is None:
        return normalizer, mask.shape[-1]
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and float(scale).is_integer() and scale >= 1):
        raise ValueError(f"loss_scale_factor must be a positive whole number (a response length), got {scale!r}")
    return normalizer, int(scale)


def _fused_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, *, sequence_level
):
    if config is None:
        raise ValueError("the hadw policy losses read the clip ratios from the actor config verl passes as config=")
    mask = response_mask.bool()
    per_response = advantage_per_response(advantages, mask)
    if sequence_level and rollout_is_weights is not None and rollout_is_weights.dim() == 2:
        rollout_is_weights = response_is_weights(rollout_is_weights, mask)
    clip_ratio = config.get("clip_ratio", 0.2)
    epsilon_low = config.get("clip_ratio_low", None)
    epsilon_high = config.get("clip_ratio_high", None)
    epsilon_low = clip_ratio if epsilon_low is None else epsilon_low
    epsilon_high = clip_ratio if epsilon_high is None else epsilon_high
    # verl's vanilla loss always bounds negative advantages at clip_ratio_c; its GSPO does not.
    dual_clip = None if sequence_level else config.get("clip_ratio_c", 3.0)
    normalizer, max_length = batch_normalizer(loss_agg_mode, mask, config.get("global_batch_info", None) or {})
    loss, metrics = fused_hadw_grpo_loss(
        log_prob, old_log_prob, None, mask, advantages=per_response, loss_agg_mode=loss_agg_mode,
        ratio_level="gspo_token" if sequence_level else "token", epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, dual_clip=dual_clip,
        importance_weights=rollout_is_weights, loss_normalizer=normalizer, max_response_length=max_length,
        return_metrics=True,
    )
    with torch.no_grad():
        log_ratio = torch.where(mask, (log_prob - old_log_prob).detach(), torch.zeros_like(log_prob))
        tokens = mask.sum().clamp(min=1)
        lower = torch.zeros((), device=log_prob.device)
        if dual_clip is not None:
            # Tokens whose loss the dual clip bounds: a negative advantage and a PPO-clipped
            # ratio above clip_ratio_c.
            ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            clipped = torch.maximum(ratio, ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high))
            lower = ((clipped > dual_clip) & (per_response < 0)[:, None] & mask).sum() / tokens
    return loss, {
        # verl's names; at sequence level the clip fraction counts responses, not tokens.
        "actor/pg_clipfrac": (metrics["clip_frac_low"] + metrics["clip_frac_high"]).item(),
        "actor/ppo_kl": (-log_ratio.sum() / tokens).item(),
        "actor/pg_clipfrac_lower": lower.item(),
    }


def _policy_loss(name: str, sequence_level: bool, default_agg_mode: str, doc: str):
    """A verl policy loss with verl's signature (``get_policy_loss_fn``'s), by the fused
    surrogate at token or sequence level."""

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = default_agg_mode,
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return _fused_policy_loss(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
            sequence_level=sequence_level,
        )

    policy_loss.__name__ = policy_loss.__qualname__ = name
    policy_loss.__doc__ = doc
    return policy_loss


compute_policy_loss_hadw = register_policy_loss(TOKEN_LEVEL_LOSS)(_policy_loss(
    "compute_policy_loss_hadw", sequence_level=False, default_agg_mode="token-mean",
    doc="""verl's ``vanilla`` PPO loss (token ratio, clip_ratio_low/high, dual clip at
    clip_ratio_c, rollout_is_weights, loss_agg_mode, global_batch_info) by the fused
    surrogate. ``advantages`` must be constant over each response's valid tokens.""",
))
compute_policy_loss_hadw_gspo = register_policy_loss(SEQUENCE_LEVEL_LOSS)(_policy_loss(
    "compute_policy_loss_hadw_gspo", sequence_level=True, default_agg_mode="seq-mean-token-mean",
    doc="""verl's ``gspo`` loss (one ratio per response from its mean log-ratio, carried by
    each token; no dual clip) by the fused surrogate. ``rollout_is_weights`` must be
    constant over each response's valid tokens (``rollout_is="sequence"``).""",
))


def resume_folder(trainer_config: Mapping) -> str | None:
    """The ``global_step_N`` folder verl's trainer resumes from under this config, by
    its own rule (trainer.resume_mode: disable, auto, resume_path), or None."""
    trainer = trainer_config["trainer"]
    mode = trainer.get("resume_mode", "auto")
    if mode == "disable":
        return None
    if mode == "resume_path":
        folder = trainer.get("resume_from_path", None)
        if not isinstance(folder, str) or "global_step_" not in folder:
            raise ValueError(f"trainer.resume_from_path must name a global_step_N folder, got {folder!r}")
        return os.path.abspath(folder)
    if mode == "auto":
        return find_latest_ckpt_path(os.path.abspath(trainer.get("default_local_dir")))
    raise ValueError(f"unknown trainer.resume_mode {mode!r}")


class HADWCheckpointCallback(CheckpointCallback):
    """Saves the driver's anchor with every verl checkpoint and restores it on resume.

    verl builds the callback named by ``trainer.checkpoint_callback_class`` in the
    driver when the trainer starts, before it trains: the callback then finds the
    checkpoint verl will resume from and loads the anchor saved there. ``on_save``
    writes ``hadw_anchor.json`` (plain JSON: loading a checkpoint runs no code) into the
    ``global_step_N`` folder. Subclass it to add your own ``on_save`` and call super().
    """

    def __init__(self, config=None):
        super().__init__(config=config)
        if config is None:
            return
        options = hadw_options(config.get("algorithm", None))
        if not options["enable"]:
            return
        folder = resume_folder(config)
        if folder is None:
            return
        path = os.path.join(folder, ANCHOR_FILE)
        if not os.path.exists(path):
            logger.warning("resuming from %s, which holds no %s: the HA-DW anchor starts afresh", folder, ANCHOR_FILE)
            return
        with open(path) as handle:
            state = json.load(handle)
        driver_anchor(options["anchor"]).load_state_dict(state)
        logger.info("restored the HA-DW anchor (step %d) from %s", state["step"], path)

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        if _driver_anchor is None:
            return
        state = _driver_anchor.state_dict()
        path = os.path.join(checkpoint_dir, ANCHOR_FILE)
        partial = path + ".partial"
        with open(partial, "w") as handle:
            json.dump(state, handle)
        os.replace(partial, path)
