"""Exact figures for binary rewards (paper section 2 and appendix C).

A group of ``G`` responses to a prompt of accuracy ``p`` has R ~ Binomial(G, p) correct
ones and baseline p_hat = R / G. Training only learns from non-degenerate groups,
S = {1 <= R <= G-1}, so every quantity here is conditioned on S.

Everything is float64 numpy. P(S) is summed term by term over k = 1..G-1 rather than
taken as 1 - (1-p)^G - p^G, which loses its relative precision near p = 0 and p = 1.
"""

from __future__ import annotations

import math

import numpy as np

# Gauss-Legendre nodes on each piece between breakpoints k/G. The integrand is a ratio
# of two polynomials (not a polynomial: the denominator is P(S)), but both share the
# factor p(1-p), so it has no pole on [0, 1] and the rule converges geometrically:
# 8 nodes already agree with 96 nodes and with 30-digit mpmath quadrature to ~1e-14.
NODES_PER_PIECE = 32


def _check_group_size(group_size: int) -> None:
    if int(group_size) != group_size or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2, got {group_size}")


def _open_unit_interval(p) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if np.any((p <= 0.0) | (p >= 1.0)):
        # At p = 0 or 1 every group is degenerate: P(S) = 0 and nothing is conditioned.
        raise ValueError("p must lie strictly inside (0, 1)")
    return p


def binomial_pmf(p, trials: int) -> np.ndarray:
    """P(Binomial(trials, p) = k) for k = 0..trials, shape p.shape + (trials + 1,)."""
    p = np.asarray(p, dtype=np.float64)[..., None]
    k = np.arange(trials + 1)
    binomials = np.array([math.comb(trials, int(j)) for j in k], dtype=np.float64)
    return binomials * p**k * (1.0 - p) ** (trials - k)


def nondegenerate_probability(p, group_size: int) -> np.ndarray:
    """P(S) = P(1 <= R <= G-1) = 1 - (1-p)^G - p^G."""
    _check_group_size(group_size)
    return binomial_pmf(p, group_size)[..., 1:group_size].sum(axis=-1)


def baseline_bias(p, group_size: int) -> np.ndarray:
    """The Lemma: E[p_hat | S] - p = (p(1-p)^G + p^(G+1) - p^G) / (1 - (1-p)^G - p^G).

    Since A_hat - A = p - p_hat for every response, this is E[A - A_hat | S]: positive
    for p < 1/2 (Theorem 1: advantages underestimated), negative for p > 1/2, zero at
    1/2. The numerator is regrouped as p(1-p)^G - (1-p)p^G, which makes
    bias(1-p) = -bias(p) hold exactly.
    """
    p = _open_unit_interval(p)
    numerator = p * (1.0 - p) ** group_size - (1.0 - p) * p**group_size
    return numerator / nondegenerate_probability(p, group_size)


def prob_baseline_above(p, group_size: int, epsilon: float = 0.0) -> np.ndarray:
    """Theorem 2, hard form: P(p_hat - p > epsilon | S)
    = sum_{k = floor(G(p + epsilon)) + 1}^{G-1} P(R = k) / P(S).

    With epsilon = 0 this is P(A_hat < A | S), the probability that a response's
    advantage is underestimated (A_hat - A = p - p_hat whatever the response).
    """
    _check_group_size(group_size)
    p = _open_unit_interval(p)
    pmf = binomial_pmf(p, group_size)
    k = np.arange(group_size + 1)
    first = np.floor(group_size * (p + epsilon))[..., None] + 1
    counted = (k >= first) & (k >= 1) & (k <= group_size - 1)
    return (pmf * counted).sum(axis=-1) / pmf[..., 1:group_size].sum(axis=-1)


def prob_baseline_below(p, group_size: int, epsilon: float = 0.0) -> np.ndarray:
    """Theorem 2, easy form: P(p - p_hat > epsilon | S)
    = sum_{k=1}^{ceil(G(p - epsilon)) - 1} P(R = k) / P(S).

    With epsilon = 0 it is the complement of :func:`prob_baseline_above` except on the
    tie p_hat = p, which has positive probability only when Gp is an integer.
    """
    _check_group_size(group_size)
    p = _open_unit_interval(p)
    pmf = binomial_pmf(p, group_size)
    k = np.arange(group_size + 1)
    last = np.ceil(group_size * (p - epsilon))[..., None] - 1
    counted = (k <= last) & (k >= 1) & (k <= group_size - 1)
    return (pmf * counted).sum(axis=-1) / pmf[..., 1:group_size].sum(axis=-1)


def average_prob_baseline_above(
    group_size: int, low: float, high: float, *, nodes_per_piece: int = NODES_PER_PIECE
) -> float:
    """P(G, a, b): the mean of P(p_hat > p | S) over p uniform in (a, b), 0 <= a < b <= 1.

    The summation range of Theorem 2 jumps at every p = k/G, so the integral is split
    there; inside a piece the integrand is smooth and Gauss-Legendre is exact to
    rounding. The nodes are strictly inside each piece, never on a jump.
    """
    _check_group_size(group_size)
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"need 0 <= low < high <= 1, got ({low}, {high})")
    breakpoints = np.arange(1, group_size) / group_size
    edges = np.concatenate(([low], breakpoints[(breakpoints > low) & (breakpoints < high)], [high]))
    nodes, weights = np.polynomial.legendre.leggauss(nodes_per_piece)
    left, right = edges[:-1, None], edges[1:, None]
    half_width = (right - left) / 2.0
    points = left + half_width * (nodes + 1.0)
    integral = (half_width * weights * prob_baseline_above(points, group_size)).sum()
    return float(integral / (high - low))


def corollary2_average(group_size: int) -> float:
    """(G/2) * integral over (0, 2/G) of P(p_hat > p | S) dp, i.e. P(G, 0, 2/G)."""
    return average_prob_baseline_above(group_size, 0.0, 2.0 / group_size)


def sure_bias_direction(p, group_size: int) -> np.ndarray:
    """Corollary 3: +1 where p_hat > p surely given S (p < 1/G, since p_hat >= 1/G on S),
    -1 where p_hat < p surely (p > (G-1)/G, since p_hat <= (G-1)/G), 0 elsewhere."""
    _check_group_size(group_size)
    p = _open_unit_interval(p)
    return np.where(p < 1.0 / group_size, 1, np.where(p > (group_size - 1) / group_size, -1, 0))


def conditional_advantage(p, group_size: int, reward: int) -> np.ndarray:
    """E[r_i - p_hat | r_i = reward, S]: the mean un-normalised advantage of a correct
    (reward 1) or incorrect (reward 0) response in a non-degenerate group, to set
    against its true advantage reward - p.

    Given r_i, the other G-1 rewards sum to B ~ Binomial(G-1, p) and S means
    1 <= r_i + B <= G-1; p_hat = (r_i + B) / G. The response's own reward sits in its
    baseline, so even without S the mean is (G-1)/G * (reward - p), not reward - p.
    """
    if reward not in (0, 1):
        raise ValueError(f"reward must be 0 or 1, got {reward}")
    _check_group_size(group_size)
    p = _open_unit_interval(p)
    others = np.arange(group_size)
    pmf = binomial_pmf(p, group_size - 1)
    in_event = (reward + others >= 1) & (reward + others <= group_size - 1)
    mean_others = (pmf * others * in_event).sum(axis=-1) / (pmf * in_event).sum(axis=-1)
    return reward - (reward + mean_others) / group_size
