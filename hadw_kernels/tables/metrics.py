"""The metrics a loss returns: their names in order (the kernels index them by name),
and what each is a mean over, so that calls sharing a batch combine them."""

from __future__ import annotations

# The metrics every implementation returns, in this order (kernels index them by name).
METRIC_NAMES = (
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "approx_kl",
    "phi_mean",
    "zero_std_frac",
    "ref_kl",
    "entropy_mean",
)
# The metrics of the rollout correction and token masks (correction.py), after the
# kernels' in a loss's metrics, each present when its rule is on: the rollout weights' mean
# (after the rule, before batch normalisation), the shares of counted tokens whose weight
# the rule changed, that the rejection filters removed, that the off-policy and entropy
# masks zeroed, and that the objective's batch statistic selected (OBJECTIVES' selects_tokens).
CORRECTION_METRIC_NAMES = (
    "rollout_is_mean",
    "rollout_is_corrected_frac",
    "rollout_rejected_frac",
    "off_policy_masked_frac",
    "entropy_masked_frac",
    "selected_frac",
)


def ordered_metrics(metrics: dict) -> dict:
    """The metrics a call returns: those present, in the order METRIC_NAMES then
    CORRECTION_METRIC_NAMES give (every loss and the reference return them so)."""
    return {name: metrics[name] for name in METRIC_NAMES + CORRECTION_METRIC_NAMES if name in metrics}


# Metrics that describe the groups: unknown when the advantages come from the caller.
GROUP_METRICS = ("phi_mean", "zero_std_frac")
# What each metric is a mean over: "tokens" (the valid tokens), "ratios" (the importance
# ratios: the valid tokens, or at sequence level the responses with a valid token),
# "responses" or "groups". Calls that share a batch (micro-batches) combine a metric by
# weighing each call's value by its count, not by averaging the values.
METRIC_MEAN_OVER = {
    "clip_frac_low": "ratios",
    "clip_frac_high": "ratios",
    "ratio_mean": "ratios",
    "approx_kl": "tokens",
    "phi_mean": "responses",
    "zero_std_frac": "groups",
    "ref_kl": "tokens",
    "entropy_mean": "tokens",
    **{name: "tokens" for name in CORRECTION_METRIC_NAMES},
}
