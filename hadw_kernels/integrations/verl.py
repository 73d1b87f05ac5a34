"""HA-DW and the fused surrogate in verl (0.9.1 up to 0.10, checked on import: versions.py),
through verl's own registries.

Importing this module registers, in ``verl.trainer.ppo.core_algos``:

- the advantage estimator ``"hadw"``: verl's GRPO advantage (groups by ``uid``, std
  normalisation by ``algorithm.norm_adv_by_std_in_grpo``) times the HA-DW weight Phi,
  with the difficulty anchor folded once per training step over the whole batch; and
  ``"hadw_rloo"`` and ``"hadw_james_stein"``, the leave-one-out and James-Stein
  baselines (docs/math.md, section 2a) with the same Phi (:data:`ADVANTAGE_ESTIMATORS`);
- the policy losses ``hadw_<name>`` of :data:`VERL_POLICY_LOSSES` (``hadw_vanilla``, also
  ``hadw``, and every verl 0.9.1 loss but bypass_mode): verl's losses of those names
  computed by :func:`hadw_kernels.fused_hadw_grpo_loss`, with
  verl's ActorConfig options, ``loss_agg_mode``, global-batch normalisation and rollout
  weights, so they return verl's loss, gradient and metrics on the same tensors, verl's
  aggregation included (its sapo and geo_mean ignore ``loss_agg_mode``);
  ``hadw_sapo_by_agg_mode`` and ``hadw_geo_mean_by_agg_mode`` are those two aggregated by
  ``loss_agg_mode`` and the global counts instead (docs/integrations/verl.md).

``pip install hadw-kernels[verl]`` declares this module as a ``verl.plugins`` entry point,
which verl imports in every process of a run: the names above are then known without
user code. The lines a verl user adds (docs/integrations/verl.md)::

    algorithm.adv_estimator=hadw
    actor_rollout_ref.actor.policy_loss.loss_mode=hadw_vanilla   # or hadw_gspo, hadw_sapo, ...
    trainer.checkpoint_callback_class=hadw_kernels.integrations.verl.HADWCheckpointCallback
    +algorithm.hadw.lambda_scale=1.3                             # optional, HADW_OPTIONS

The anchor lives in the driver process, where verl's trainer computes advantages; the
checkpoint callback writes it next to verl's ``data.pt`` in each ``global_step_N``
folder and restores it when verl resumes from one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from .versions import require_supported

# Before verl itself is imported: an unsupported release fails here, naming the range.
require_supported("verl")

import numpy as np
import torch
from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from ..advantage.anchor import DifficultyAnchor
from ..advantage.group import hadw_advantages
from ..config.loss_config import DEFAULT_LAMBDA_SCALE, DEFAULT_STD_EPS
from ..loss import fused_hadw_grpo_loss
from ..objectives.table import OBJECTIVES
from ..tables.bounds import check_finite_positive
from ..tables.estimators import ESTIMATORS
from .rewards import require_unit_interval
from .verl_metrics import CLIP_METRICS, verl_metrics

logger = logging.getLogger(__name__)

ADVANTAGE_ESTIMATOR = "hadw"
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


def outcome_advantage(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Mapping | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outcome advantage of ``estimator`` (docs/math.md, section 2a) times Phi,
    broadcast over each response's tokens.

    ``token_level_rewards`` [B, T] sum to one reward per response; ``index`` holds the
    ``uid`` of each row (its prompt): rows may come in any order, groups of any size of
    at least 2. With ``algorithm.hadw.enable`` the rewards must lie in [0, 1]; the
    anchor is updated once per call, which verl makes once per training step over the
    whole batch. The group mean's advantage is divided by the group's std as
    ``algorithm.norm_adv_by_std_in_grpo`` says; the other estimators' are r - b. Returns
    (advantages, returns), both [B, T], as verl's GRPO does.
    """
    if index is None:
        raise ValueError("the hadw advantage estimators group responses by their uid, which verl passes as index=")
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
    normalize_std = ESTIMATORS[estimator].takes_std and (
        True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True)))
    advantages = hadw_advantages(
        scores, group_index=group_index, anchor=belief, lambda_scale=options["lambda_scale"],
        normalize_std=normalize_std, std_eps=options["std_eps"], estimator=estimator,
    )
    advantages = advantages.to(scores.dtype)[:, None] * response_mask
    return advantages, advantages


def _registered_estimator(name: str, estimator: str):
    def compute_outcome_advantage(token_level_rewards, response_mask, index=None, config=None, **_unused):
        return outcome_advantage(estimator, token_level_rewards, response_mask, index, config)

    compute_outcome_advantage.__name__ = f"compute_{name}_outcome_advantage"
    compute_outcome_advantage.__doc__ = f"verl's ``{name}``: :func:`outcome_advantage` of {estimator!r}."
    return register_adv_est(name)(compute_outcome_advantage)


# verl's estimator call carries each row's uid, which names its prompt within one step
# only: the history estimators, which key prompts across steps, are not registered.
ADVANTAGE_ESTIMATORS = {("hadw" if row.name == "grpo" else f"hadw_{row.name}"): row.name
                        for row in ESTIMATORS.values() if row.scope != "history"}
ESTIMATOR_FUNCTIONS = {name: _registered_estimator(name, estimator)
                       for name, estimator in ADVANTAGE_ESTIMATORS.items()}
compute_hadw_outcome_advantage = ESTIMATOR_FUNCTIONS[ADVANTAGE_ESTIMATOR]


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


class VerlPolicyLoss(NamedTuple):
    """One of verl's policy losses as the fused surrogate computes it.

    ``loss_mode``: verl's name for it. ``objective`` and ``ratio_level``: the choices of
    LossConfig it is (docs/options.md). ``default_agg_mode``: the aggregation verl's
    function defaults to (verl's actor passes its ``loss_agg_mode`` always).
    ``options``: the LossConfig fields it reads from verl's ActorConfig, by key.
    ``rollout_weights``: how ``rollout_is_weights`` [B, T] enter: "token" (each token's
    loss times its weight) or "geometric_mean" (one weight per response, the geometric
    mean of its tokens', as verl's geo_mean). ``aggregation``: how verl's function
    aggregates (:data:`AGGREGATIONS`). ``metrics``: which of verl's metric rules it
    reports (:data:`CLIP_METRICS`; None: no metrics, as verl's gpg). ``absent``: the
    defaults verl's function reads for keys absent from the config, where they differ from
    ActorConfig's (:data:`ACTOR_DEFAULTS`)."""

    loss_mode: str
    objective: str
    ratio_level: str
    default_agg_mode: str
    options: dict
    metrics: str | None
    rollout_weights: str = "token"
    aggregation: str = "loss_agg_mode"
    absent: dict = {}


# How a verl policy loss aggregates its token losses: "loss_agg_mode" (verl's agg_loss with
# the actor's mode and global_batch_info, as most of its losses), "seq-mean-token-mean"
# (that agg_loss mode whatever loss_agg_mode says, as verl's sapo), or "row-mean" (the
# micro-batch's mean over its rows, empty ones counted, global_batch_info ignored, as
# verl's geo_mean).
AGGREGATIONS = ("loss_agg_mode", "seq-mean-token-mean", "row-mean")


# The fused versions of verl's policy losses, under verl's names prefixed "hadw_": each
# gives verl's loss, gradient and metrics. The two "_by_agg_mode" rows aggregate by
# loss_agg_mode and the global counts where verl's own function does not
# (docs/integrations/verl.md). A key "policy_loss.<name>" is read from the actor config's
# policy_loss.
VERL_POLICY_LOSSES = {
    "hadw_vanilla": VerlPolicyLoss("vanilla", "clip", "token", "token-mean", {"dual_clip": "clip_ratio_c"},
                                   metrics="vanilla"),
    "hadw_gspo": VerlPolicyLoss("gspo", "clip", "gspo_token", "seq-mean-token-mean", {}, metrics="gspo"),
    "hadw_sapo": VerlPolicyLoss("sapo", "sapo", "token", "seq-mean-token-mean",
                                {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"},
                                metrics="sapo", aggregation="seq-mean-token-mean"),
    "hadw_sapo_by_agg_mode": VerlPolicyLoss(
        "sapo", "sapo", "token", "seq-mean-token-mean",
        {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"}, metrics="sapo"),
    "hadw_gpg": VerlPolicyLoss("gpg", "gpg", "token", "token-mean", {}, metrics=None),
    "hadw_geo_mean": VerlPolicyLoss("geo_mean", "gmpo", "sequence", "token-mean", {}, metrics="geo_mean",
                                    rollout_weights="geometric_mean", aggregation="row-mean"),
    "hadw_geo_mean_by_agg_mode": VerlPolicyLoss("geo_mean", "gmpo", "sequence", "token-mean", {},
                                                metrics="geo_mean", rollout_weights="geometric_mean"),
    "hadw_cispo": VerlPolicyLoss("cispo", "cispo_clip", "token", "token-mean", {}, metrics="cispo"),
    # DPPO reads clip_ratio_c as its truncation, with its own default where the key is absent.
    "hadw_dppo_tv": VerlPolicyLoss("dppo_tv", "dppo_tv", "token", "token-mean", {"ratio_cap": "clip_ratio_c"},
                                   metrics="dppo_tv", absent={"clip_ratio_c": 20.0}),
    "hadw_dppo_kl": VerlPolicyLoss("dppo_kl", "dppo_kl", "token", "token-mean", {"ratio_cap": "clip_ratio_c"},
                                   metrics="dppo_kl", absent={"clip_ratio_c": 20.0}),
    "hadw_dro": VerlPolicyLoss("dro", "dro", "token", "token-mean", {"dro_beta": "policy_loss.dro_beta"},
                               metrics="dro"),
    "hadw_clip_cov": VerlPolicyLoss(
        "clip_cov", "clip_cov", "token", "token-mean",
        {"clip_cov_ratio": "policy_loss.clip_cov_ratio", "clip_cov_lb": "policy_loss.clip_cov_lb",
         "clip_cov_ub": "policy_loss.clip_cov_ub"}, metrics="clip_cov"),
    "hadw_kl_cov": VerlPolicyLoss(
        "kl_cov", "kl_cov", "token", "token-mean",
        {"kl_cov_ratio": "policy_loss.kl_cov_ratio", "ppo_kl_coef": "policy_loss.ppo_kl_coef"}, metrics="kl_cov"),
}
# verl's ActorConfig defaults of the keys the rows read, for a config given as a plain
# mapping that lacks them.
ACTOR_DEFAULTS = {"clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05, "policy_loss.dro_beta": None,
                  "policy_loss.clip_cov_ratio": 2e-4, "policy_loss.clip_cov_lb": 1.0, "policy_loss.clip_cov_ub": 5.0,
                  "policy_loss.kl_cov_ratio": 2e-4, "policy_loss.ppo_kl_coef": 0.1}
# What verl's functions take where a policy_loss key holds None: ActorConfig's default,
# except kl_cov's coefficient (1, not 0.1); dro_beta has none (verl refuses it).
NONE_DEFAULTS = {**{key: value for key, value in ACTOR_DEFAULTS.items()
                    if key.startswith("policy_loss.") and value is not None},
                 "policy_loss.ppo_kl_coef": 1.0}
# Other names of the same losses: "hadw", the first name of hadw_vanilla.
VERL_POLICY_LOSS_ALIASES = {"hadw": "hadw_vanilla"}
ROLLOUT_WEIGHTS = ("token", "geometric_mean")


def _check_rows(losses: dict) -> None:
    """Each row reads keys ActorConfig has defaults for, and names a rollout weighting, an
    aggregation and a metric rule that exist (an error, not an ``assert``, which
    ``python -O`` skips)."""
    for name, loss in losses.items():
        unknown = [key for key in loss.options.values() if key not in ACTOR_DEFAULTS]
        if unknown:
            raise ValueError(f"{name} reads {unknown}, which ACTOR_DEFAULTS does not hold")
        if loss.rollout_weights not in ROLLOUT_WEIGHTS or loss.aggregation not in AGGREGATIONS \
                or (loss.metrics is not None and loss.metrics not in CLIP_METRICS):
            raise ValueError(f"{name}: rollout_weights {loss.rollout_weights!r}, aggregation {loss.aggregation!r} "
                             f"and metrics {loss.metrics!r} must be of {ROLLOUT_WEIGHTS}, {AGGREGATIONS} and "
                             "CLIP_METRICS")


_check_rows(VERL_POLICY_LOSSES)


def geometric_mean_per_response(weights: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token weights to one per response [B], the geometric mean over its valid
    tokens (verl's geo_mean; 1 for a response without valid tokens). A zero weight makes
    it 0, where verl's log(w + 1e-10) leaves (1e-10)^(1/T_i)."""
    mask = response_mask.bool()
    log_weights = torch.where(mask, weights.log(), torch.zeros_like(weights))
    return torch.exp(log_weights.sum(dim=1) / mask.sum(dim=1).clamp(min=1))


def _actor_option(config, key: str, absent: dict):
    """The actor config's ``key`` ("policy_loss.<name>" inside policy_loss) as verl's
    function reads it: absent, the row's or ActorConfig's default; None, the function's."""
    if key.startswith("policy_loss."):
        section = config.get("policy_loss", None) or {}
        value = section.get(key.split(".", 1)[1], absent.get(key, ACTOR_DEFAULTS[key]))
    else:
        value = config.get(key, absent.get(key, ACTOR_DEFAULTS[key]))
    return NONE_DEFAULTS.get(key) if value is None else value


def _fused_policy_loss(
    loss: VerlPolicyLoss, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    if config is None:
        raise ValueError("the hadw policy losses read the clip ratios from the actor config verl passes as config=")
    mask = response_mask.bool()
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages have shape {tuple(advantages.shape)}, response_mask {tuple(mask.shape)}: "
                         "verl passes both as [B, T]")
    if rollout_is_weights is not None and loss.rollout_weights == "geometric_mean":
        rollout_is_weights = geometric_mean_per_response(rollout_is_weights, mask)
    clip_ratio = config.get("clip_ratio", 0.2)
    epsilon_low = config.get("clip_ratio_low", None)
    epsilon_high = config.get("clip_ratio_high", None)
    epsilon_low = clip_ratio if epsilon_low is None else epsilon_low
    epsilon_high = clip_ratio if epsilon_high is None else epsilon_high
    options = {field: _actor_option(config, key, loss.absent) for field, key in loss.options.items()}
    if loss.aggregation == "row-mean":
        # Every row counts, a response without valid tokens adding 0 to the sum.
        loss_agg_mode, normalizer, max_length = "seq-mean-token-mean", float(mask.shape[0]) or None, None
    else:
        if loss.aggregation != "loss_agg_mode":
            loss_agg_mode = loss.aggregation
        normalizer, max_length = batch_normalizer(loss_agg_mode, mask, config.get("global_batch_info", None) or {})
    # The loss's own metrics only where verl's rule reads one: the share its selection took.
    selects_tokens = OBJECTIVES[loss.objective].selects_tokens
    value = fused_hadw_grpo_loss(
        log_prob, old_log_prob, None, mask, advantages=advantages, loss_agg_mode=loss_agg_mode,
        objective=loss.objective, ratio_level=loss.ratio_level, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        importance_weights=rollout_is_weights, loss_normalizer=normalizer, max_response_length=max_length,
        return_metrics=selects_tokens, **options,
    )
    selected_frac = None
    if selects_tokens:
        value, metrics = value
        selected_frac = metrics["selected_frac"]
    return value, verl_metrics(loss, old_log_prob, log_prob, advantages, mask, epsilon_low, epsilon_high, options,
                               selected_frac)


def _policy_loss(name: str, loss: VerlPolicyLoss):
    """``loss`` as a verl policy loss, with verl's signature (``get_policy_loss_fn``'s)."""

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = loss.default_agg_mode,
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        return _fused_policy_loss(
            loss, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    policy_loss.__name__ = policy_loss.__qualname__ = f"compute_policy_loss_{name}"
    policy_loss.__doc__ = (
        f"verl's ``{loss.loss_mode}`` policy loss by the fused surrogate: objective {loss.objective!r}, ratio form "
        f"{loss.ratio_level!r}, verl's clip_ratio_low/high, {sorted(loss.options.values()) or 'no other keys'}, "
        "loss_agg_mode, global_batch_info and rollout_is_weights (docs/integrations/verl.md)."
    )
    return policy_loss


# Every name's function, registered in verl's registry.
POLICY_LOSS_FUNCTIONS = {name: register_policy_loss(name)(_policy_loss(name, loss))
                         for name, loss in VERL_POLICY_LOSSES.items()}
for _alias, _name in VERL_POLICY_LOSS_ALIASES.items():
    POLICY_LOSS_FUNCTIONS[_alias] = register_policy_loss(_alias)(POLICY_LOSS_FUNCTIONS[_name])


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
