"""The advantage estimators restated as float64 loops over plain lists, one response at a
time, straight from docs/math.md section 2a: the tests hold ``hadw_advantages`` (and the
losses and integrations through it) to these. Nothing in the package imports it."""

from __future__ import annotations

import math


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _variance(values: list[float]) -> float:
    mean = _mean(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def baseline(rewards: list[float], groups: list[int], i: int, estimator: str,
             prior: tuple[float, float] | None = None) -> float:
    """b_i of response ``i``; ``groups[j]`` is response j's group label."""
    own = [r for r, g in zip(rewards, groups) if g == groups[i]]
    others_in_group = [r for j, (r, g) in enumerate(zip(rewards, groups)) if g == groups[i] and j != i]
    if estimator == "grpo":
        return _mean(own)
    leave_one_out = _mean(others_in_group)
    if estimator == "rloo":
        return leave_one_out
    if estimator == "prompt_history":
        if prior is None:
            raise ValueError("estimator 'prompt_history' needs prior, the prompt's pseudo-counts (alpha, beta)")
        alpha, beta = prior
        return (alpha + sum(others_in_group)) / (alpha + beta + len(others_in_group))
    assert estimator == "james_stein"
    labels = list(dict.fromkeys(g for g in groups if g != groups[i]))
    if not labels:
        return leave_one_out
    members = [[r for r, g in zip(rewards, groups) if g == label] for label in labels]
    means = [_mean(m) for m in members]
    noise = _mean([_variance(m) / (len(m) - 1) for m in members])
    centre = _mean(means)
    spread = _mean([(m - centre) ** 2 for m in means])
    shrinkage = noise / (noise + spread) if noise + spread > 0 else 0.0
    other_mean = _mean([r for m in members for r in m])
    return (1 - shrinkage) * leave_one_out + shrinkage * other_mean


def advantages(rewards: list[float], groups: list[int], estimator: str, *, normalize_std: bool = False,
               std_eps: float = 1e-6, priors: list[tuple[float, float]] | None = None,
               anchor: float | None = None, lambda_scale: float = 1.0) -> list[float]:
    """A_i (times Phi_i with an anchor) for every response."""
    result = []
    for i, reward in enumerate(rewards):
        own = [r for r, g in zip(rewards, groups) if g == groups[i]]
        value = reward - baseline(rewards, groups, i, estimator, priors[i] if priors else None)
        if estimator == "grpo" and max(own) == min(own):
            value = 0.0
        if normalize_std:
            value /= math.sqrt(_variance(own)) + std_eps
        if anchor is not None:
            difficulty = _mean(own) - anchor
            sign = (value > 0) - (value < 0)
            value *= lambda_scale * math.exp(-sign * ((difficulty > 0) - (difficulty < 0)) * abs(difficulty))
        result.append(value)
    return result


def history_replay(batches: list[tuple[list[float], list[int]]], discount: float, prior_strength: float
                   ) -> list[list[tuple[float, float]]]:
    """Each batch's per-response (alpha, beta) read before it, from the batches' (rewards,
    prompt keys) alone: every earlier reward of a prompt weighed discount ** (batches since)."""
    reads = []
    for t, (_, keys) in enumerate(batches):
        past = [(r, k, s) for s, (rs, ks) in enumerate(batches[:t]) for r, k in zip(rs, ks)]
        weights = [discount ** (t - 1 - s) for _, _, s in past]
        seen = sum(weights)
        mean = sum(w * r for w, (r, _, _) in zip(weights, past)) / seen if seen else 0.5
        row = []
        for key in keys:
            alpha = prior_strength * mean + sum(w * r for w, (r, k, _) in zip(weights, past) if k == key)
            beta = prior_strength * (1 - mean) + sum(w * (1 - r) for w, (r, k, _) in zip(weights, past) if k == key)
            row.append((alpha, beta))
        reads.append(row)
    return reads
