"""The bias of the group baseline (paper section 2, appendices C and D): exact figures
for binary rewards, Monte Carlo checks through the library's own advantage code, and
``python -m hadw_kernels.theory``, which prints the paper's tables and draws the figures.
"""

from .exact import (
    average_prob_baseline_above,
    baseline_bias,
    binomial_pmf,
    conditional_advantage,
    corollary2_average,
    nondegenerate_probability,
    prob_baseline_above,
    prob_baseline_below,
    sure_bias_direction,
)
from .monte_carlo import correct_response_advantages, truncated_gaussian_baseline_bias

__all__ = [
    "average_prob_baseline_above",
    "baseline_bias",
    "binomial_pmf",
    "conditional_advantage",
    "correct_response_advantages",
    "corollary2_average",
    "nondegenerate_probability",
    "prob_baseline_above",
    "prob_baseline_below",
    "sure_bias_direction",
    "truncated_gaussian_baseline_bias",
]
