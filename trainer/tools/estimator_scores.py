"""Every advantage estimator scored against the truth on the bias tool's draws
(``python -m trainer.tools.bias``; docs/estimators.md).

Each repeat of a checkpoint's draws is cut into rollout batches of the run's
``train.prompts_per_step`` prompts (a fixed shuffle, so a batch mixes the levels as the
run's do); each estimator forms the advantages of every group of a batch, all-equal
groups included (the estimators that borrow from outside the group give them an
advantage). Against a prompt's true accuracy p, per response: the baseline's squared
error (b - p)^2, over all groups and over the groups that update, and the centred
advantage's error A - (r - p), signed and absolute. Each figure is a mean over responses
with a 95% interval that takes a prompt's responses as a cluster.
"""

from __future__ import annotations

import math

from trainer.tools.intervals import clustered_mean_interval, format_interval

# The fixed shuffle of the prompts before they are cut into batches.
BATCH_SHUFFLE_SEED = 20261202
SUBSETS = ("all", "updating")
COLUMNS = (("baseline MSE, all groups", "all", "squared"), ("baseline MSE, updating", "updating", "squared"),
           ("A error, all groups", "all", "signed"), ("A abs error, all groups", "all", "absolute"),
           ("A error, updating", "updating", "signed"), ("A abs error, updating", "updating", "absolute"))
KINDS = tuple(f"{kind}|{subset}" for kind in ("squared", "signed", "absolute") for subset in SUBSETS)


def band_index(value: float, edges: tuple[float, ...]) -> int:
    """The index of the bin of ``edges`` holding ``value`` (the last bin includes its top)."""
    for index in range(len(edges) - 2, -1, -1):
        if value >= edges[index]:
            return index
    return 0


def band_name(index: int, edges: tuple[float, ...]) -> str:
    """The name of bin ``index`` of ``edges``, closed at the top in the last bin."""
    close = "]" if index == len(edges) - 2 else ")"
    return f"[{edges[index]:g}, {edges[index + 1]:g}{close}"


def estimator_labels(history_discounts: dict[str, float]) -> list[tuple[str, str, str | None]]:
    """(label, estimator, history name) of every scored estimator: the batch estimators,
    then the prompt history at each discount given."""
    from hadw_kernels.tables.estimators import ESTIMATORS

    labels: list[tuple[str, str, str | None]] = [
        (row.name, row.name, None) for row in ESTIMATORS.values() if row.scope != "history"]
    labels += [(f"prompt_history ({name})", "prompt_history", name) for name in history_discounts]
    return labels


def score(draws, accuracy: list[float], batch_prompts: int, priors: dict[str, list[list[float]]],
          edges: tuple[float, ...], aggregates: dict) -> dict:
    """Per G, label, band (of ``edges`` and the ``aggregates``) and subset: each column's
    mean and half-width. ``priors[name][i]``: prompt i's (alpha, beta) under that history."""
    import numpy as np
    import torch

    from hadw_kernels import all_equal_groups, hadw_advantages


    prompts = len(accuracy)
    order = np.random.default_rng(BATCH_SHUFFLE_SEED).permutation(prompts).tolist()
    batches = [order[start:start + batch_prompts] for start in range(0, prompts, batch_prompts)]
    labels = estimator_labels({name: 0.0 for name in priors})
    bands = [(band_name(index, edges), lambda p, index=index: band_index(p, edges) == index)
             for index in range(len(edges) - 1)] + list(aggregates.items())
    result = {}
    for size, repeats in draws.groups.items():
        # per (label, kind): per prompt, its responses' values
        values: dict[tuple[str, str], list[list[float]]] = {
            (label, kind): [[] for _ in range(prompts)] for label, *_ in labels for kind in KINDS}
        for repeat in repeats:
            for members in batches:
                rewards = torch.tensor([r for i in members for r in repeat[i]], dtype=torch.float64)
                updating = (~all_equal_groups(rewards, size)).tolist()
                for label, estimator, history in labels:
                    prior = None
                    if history is not None:
                        prior = torch.tensor([priors[history][i] for i in members for _ in range(size)],
                                             dtype=torch.float64)
                    advantage = hadw_advantages(rewards, group_size=size, estimator=estimator, normalize_std=False,
                                                prior=prior).view(len(members), size)
                    for row, i in enumerate(members):
                        group = repeat[i]
                        subsets = SUBSETS if updating[row] else SUBSETS[:1]
                        for position, reward in enumerate(group):
                            a = float(advantage[row, position])
                            error = a - (reward - accuracy[i])  # = p - b
                            for subset in subsets:
                                values[label, f"squared|{subset}"][i].append(error * error)
                                values[label, f"signed|{subset}"][i].append(error)
                                values[label, f"absolute|{subset}"][i].append(abs(error))
        per_size = {}
        for band, belongs in bands:
            members = [i for i in range(prompts) if belongs(accuracy[i])]
            columns: dict[str, dict[str, tuple[float, float]]] = {}
            for label, *_ in labels:
                columns[label] = {}
                for kind in KINDS:
                    lists = [values[label, kind][i] for i in members]
                    columns[label][kind] = clustered_mean_interval([sum(v) for v in lists], [len(v) for v in lists])
            per_size[band] = columns
        result[size] = per_size
    return result


def table(step: int, scores: dict, band: str) -> list[str]:
    """One markdown table row a (G, estimator) of ``band``."""
    lines = []
    for size, per_size in scores.items():
        for label, cells in per_size[band].items():
            figures = [cells[f"{kind}|{subset}"] for _, subset, kind in COLUMNS]
            lines.append(f"| {step} | {size} | {label} | " + " | ".join(
                "-" if math.isnan(mean) else format_interval(mean, half, signed=kind == "signed")
                for (mean, half), (_, _, kind) in zip(figures, COLUMNS)) + " |")
    return lines


def summary(figures: dict[int, dict], band: str = "all") -> str:
    """Every checkpoint's scores over every prompt (``band``), as markdown."""
    header = ["step", "G", "estimator"] + [title for title, *_ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for step, result in figures.items():
        if "estimators" in result:
            lines += table(step, result["estimators"], band)
    return "\n".join(lines)


def replayed_priors(outcomes: list[dict], step: int, discount: float, prior_strength: float,
                    keys: list[int]) -> list[list[float]]:
    """Each key's (alpha, beta) after the run's first ``step`` rollout batches, rebuilt from
    its outcomes.jsonl at ``discount``."""
    import torch

    from hadw_kernels import PromptHistory

    history = PromptHistory(discount=discount, prior_strength=prior_strength)
    for row in outcomes:
        if row["step"] > step:
            break
        size = row["size"]
        rewards = [float(successes >= position + 1) for successes in row["successes"] for position in range(size)]
        # The successes' order within a group does not change its counts.
        history.update(torch.tensor(rewards, dtype=torch.float64), [key for key in row["keys"] for _ in range(size)])
    return history.read(keys).tolist()
