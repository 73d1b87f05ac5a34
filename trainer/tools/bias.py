"""The group-relative advantage's bias in a run, and what HA-DW's Phi does to it:
``python -m trainer.tools.bias runs/cpu-default --steps 40 120 200``.

The paper's appendix C.1 on a run's own checkpoints. For each checkpoint, for every
prompt of a fixed set (the arithmetic task's held-out problems; on the synthetic task
distinct problems of each level drawn from a fixed seed, which training draws too), it
samples ``--groups`` groups of G responses for each G of ``--group-sizes`` (4 and 8) and
``--reference`` more (128), as the run samples (its temperature, top-p and response
length); the rewards must be 0 or 1 (right or wrong, as both tasks' verifiers score).
The reference draws' accuracy p is the prompt's true accuracy. Only the groups that
update count (not all rewards equal: the set S of the paper). It reports, per G:

- how the groups with one correct response, and those with one wrong response, spread
  over p: a one-correct group's baseline 1/G is above a prompt's p < 1/G, whose correct
  response then gets less than its true advantage (the paper's Theorem 2), and a
  one-wrong group's is below a prompt's p > 1 - 1/G, whose wrong response is punished
  more than its true advantage says;
- per band of p and per outcome (the correct responses, the wrong ones), the true
  advantage and the errors of three estimates of it, each the mean over the band's
  responses with a 95% interval that takes each prompt's responses as a cluster: GRPO's A_hat
  (``group_advantages``), HA-DW's A_hat * Phi (``hadw_weights`` with the run's anchor:
  restored from the checkpoint, ``DifficultyAnchor.update`` with the drawn batch as the
  run's next batch, the run's lambda), and A_hat * Phi / lambda (Phi's shape alone:
  AdamW cancels a constant factor on every advantage). Two scales: centred, A_hat =
  r - p_hat against r - p; std-normalised (the grpo preset's), (r - p_hat) / (s + eps)
  against (r - p) / sqrt(p (1 - p)), with p moved half a draw off 0 and 1 so that the
  true std is never 0.

The tables go to stdout (``--output`` also writes them as markdown), every draw to
``--json``, and per checkpoint a plot of the mean error against p (``--plot``). Progress
goes to stderr. A GRPO run's anchor is logged and checkpointed too, so its Phi is what
HA-DW would have applied at that point.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Run as a file, Python puts this file's folder on the path, not the checkout that holds
# the package: the wheel installs the library only, the trainer runs from its checkout
# (docs/trainer.md).
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.checkpoint_files import CheckpointError, completed_checkpoints, verify_checkpoint
from trainer.config import ConfigError, load_config
from trainer.engine.settings import resolve_engine
from trainer.tasks.problem import Problem
from trainer.tasks.registry import TASKS
from trainer.tools.estimator_scores import COLUMNS, band_index, band_name, replayed_priors, score, table
from trainer.tools.estimator_scores import summary as estimator_summary
from trainer.tools.intervals import clustered_mean_interval, format_interval, mean_interval

# Bands of the true accuracy p (lower edge inclusive; the last includes 1).
BANDS = (0.0, 0.1, 0.3, 0.7, 0.9, 1.0)
# Bins of p for the spread of the one-correct and one-wrong groups.
SPREAD_BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0)
# Rows over several bands: the hard prompts (where a correct response is the rare one),
# the easy ones (where a wrong one is), and every prompt.
AGGREGATES = {"p < 0.3": lambda p: p < 0.3, "p >= 0.7": lambda p: p >= 0.7, "all": lambda p: True}
ESTIMATES = ("GRPO", "HA-DW", "HA-DW / lambda")
SCALES = ("centred", "std-normalised")
OUTCOMES = ("correct", "wrong")
# Synthetic problems are drawn from this seed (the arithmetic task has its own held-out seed).
PROBLEM_SEED = 20261127


@dataclass
class Draws:
    """One checkpoint's samples: per prompt its level and the reference draws' correct
    count; per G, ``groups[G][r][i]`` the rewards of repeat r's group for prompt i; and
    the belief the run's anchor gives each repeat's batch; for the estimators' scores
    (``estimator_scores.py``; none without ``batch_prompts``), the run's rollout batch in
    prompts and, per history, each prompt's (alpha, beta) as the run's next batch reads it."""
    levels: list[str]
    reference_correct: list[int]
    reference: int
    groups: dict[int, list[list[list[float]]]]
    beliefs: dict[int, list[float]]
    batch_prompts: int = 0
    priors: dict[str, list[list[float]]] = field(default_factory=dict)


def true_accuracy(correct: int, reference: int) -> float:
    return correct / reference


def true_std(correct: int, reference: int) -> float:
    """sqrt(p (1 - p)) with p = (k + 1/2) / (K + 1): half a draw off 0 and 1."""
    p = (correct + 0.5) / (reference + 1)
    return math.sqrt(p * (1 - p))


def anchor_beliefs(anchor, groups: dict[int, list[list[list[float]]]]) -> dict[int, list[float]]:
    """The belief the run's anchor (as checkpointed) gives each repeat's batch, had it been
    the run's next rollout batch: a copy of the anchor updated with the batch's rewards."""
    import torch

    return {size: [float(copy.deepcopy(anchor).update(torch.tensor([r for group in batch for r in group])))
                   for batch in repeats] for size, repeats in groups.items()}


def analyse(draws: Draws, lambda_scale: float) -> dict:
    """Every table's figures from one checkpoint's draws (see the module's docstring)."""
    import torch

    from hadw_kernels import all_equal_groups, group_advantages, hadw_weights

    prompts = len(draws.levels)
    accuracy = [true_accuracy(k, draws.reference) for k in draws.reference_correct]
    result: dict[str, Any] = {"prompts": prompts, "reference": draws.reference, "sizes": {}}
    for size, repeats in draws.groups.items():
        # per scale, estimate, outcome and prompt: the errors of its responses in groups of S
        errors: dict[tuple[str, str, str], list[list[float]]] = {
            (scale, estimate, outcome): [[] for _ in range(prompts)]
            for scale in SCALES for estimate in ESTIMATES for outcome in OUTCOMES}
        truths: dict[tuple[str, str], list[list[float]]] = {
            (scale, outcome): [[] for _ in range(prompts)] for scale in SCALES for outcome in OUTCOMES}
        one_correct, one_wrong, updating, total = [], [], [0] * prompts, 0
        for batch, belief in zip(repeats, draws.beliefs[size]):
            rewards = torch.tensor([r for group in batch for r in group], dtype=torch.float64)
            phi = hadw_weights(rewards, size, belief, lambda_scale=lambda_scale).view(prompts, size)
            all_equal = all_equal_groups(rewards, size).tolist()
            for scale in SCALES:
                advantage = group_advantages(rewards, size, normalize_std=scale != "centred").view(prompts, size)
                estimates = {"GRPO": advantage, "HA-DW": advantage * phi, "HA-DW / lambda": advantage * phi / lambda_scale}
                for index, group in enumerate(batch):
                    if all_equal[index]:
                        continue
                    p = accuracy[index]
                    scale_by = 1.0 if scale == "centred" else true_std(draws.reference_correct[index], draws.reference)
                    for position, reward in enumerate(group):
                        outcome = "correct" if reward > 0.5 else "wrong"
                        truth = (reward - p) / scale_by
                        truths[scale, outcome][index].append(truth)
                        for estimate, values in estimates.items():
                            errors[scale, estimate, outcome][index].append(float(values[index, position]) - truth)
            for index, group in enumerate(batch):
                total += 1
                correct = sum(r > 0.5 for r in group)
                if 0 < correct < size:
                    updating[index] += 1
                if correct == 1:
                    one_correct.append(accuracy[index])
                if correct == size - 1:
                    one_wrong.append(accuracy[index])
        result["sizes"][size] = {
            "beliefs": draws.beliefs[size],
            "updating_share": sum(updating) / total,
            "spread": _spread(one_correct, one_wrong, size),
            "bands": _bands(accuracy, errors, truths, updating, len(repeats), BANDS, with_aggregates=True),
            "bins": _bands(accuracy, errors, truths, updating, len(repeats), SPREAD_BINS, with_aggregates=False),
        }
    result["levels"] = {level: statistics_of([a for a, name in zip(accuracy, draws.levels) if name == level])
                        for level in dict.fromkeys(draws.levels)}
    if draws.batch_prompts:

        result["estimators"] = score(draws, accuracy, draws.batch_prompts, draws.priors, BANDS, AGGREGATES)
    return result


def statistics_of(values: list[float]) -> dict:
    mean, half = mean_interval(values)
    return {"prompts": len(values), "mean": mean, "half_width": half}


def _spread(one_correct: list[float], one_wrong: list[float], size: int) -> dict:
    """How the one-correct and one-wrong groups spread over p (counts per SPREAD_BINS bin),
    and the share whose baseline is on the wrong side of p: 1/G > p for one correct,
    1 - 1/G < p for one wrong."""
    def counts(values):
        bins = [0] * (len(SPREAD_BINS) - 1)
        for value in values:
            bins[band_index(value, SPREAD_BINS)] += 1
        return bins

    return {
        "one_correct": {"groups": len(one_correct), "counts": counts(one_correct),
                        "mean_p": statistics_of(one_correct)["mean"],
                        "baseline_above_p": sum(p < 1 / size for p in one_correct) / max(1, len(one_correct))},
        "one_wrong": {"groups": len(one_wrong), "counts": counts(one_wrong),
                      "mean_p": statistics_of(one_wrong)["mean"],
                      "baseline_below_p": sum(p > 1 - 1 / size for p in one_wrong) / max(1, len(one_wrong))},
    }


def _bands(accuracy, errors, truths, updating, repeats, edges: tuple[float, ...], with_aggregates: bool) -> dict:
    """Per scale, band of ``edges`` (and the ``AGGREGATES``) and outcome (``any``: both
    outcomes): the prompts, the responses, the true advantage and each estimate's signed
    and absolute error: the mean over the responses and its 95% half-width, each prompt's
    responses a cluster (they share its p and, within a group, their baseline)."""
    def in_band(index: int) -> Callable[[float], bool]:
        return lambda p: band_index(p, edges) == index

    groups = [(band_name(index, edges), in_band(index)) for index in range(len(edges) - 1)]
    if with_aggregates:
        groups += list(AGGREGATES.items())
    prompts = range(len(accuracy))
    bands = {}
    for scale in SCALES:
        # per outcome, per prompt: the true advantages and each estimate's errors
        truth = {outcome: [truths[scale, outcome][i] for i in prompts] for outcome in OUTCOMES}
        error = {(estimate, outcome): [errors[scale, estimate, outcome][i] for i in prompts]
                 for estimate in ESTIMATES for outcome in OUTCOMES}
        truth["any"] = [truth["correct"][i] + truth["wrong"][i] for i in prompts]
        for estimate in ESTIMATES:
            error[estimate, "any"] = [error[estimate, "correct"][i] + error[estimate, "wrong"][i] for i in prompts]
        for band, belongs in groups:
            members = [i for i in prompts if belongs(accuracy[i])]
            row = {"prompts": len(members),
                   "updating_share": sum(updating[i] for i in members) / max(1, repeats * len(members))}
            for outcome in OUTCOMES + ("any",):
                present = [i for i in members if truth[outcome][i]]
                counts = [len(truth[outcome][i]) for i in present]
                cell = {"prompts": len(present), "responses": sum(counts),
                        "truth": clustered_mean_interval([sum(truth[outcome][i]) for i in present], counts)}
                for estimate in ESTIMATES:
                    values = [error[estimate, outcome][i] for i in present]
                    cell[estimate] = {
                        "signed": clustered_mean_interval([sum(v) for v in values], counts),
                        "absolute": clustered_mean_interval([sum(abs(x) for x in v) for v in values], counts)}
                row[outcome] = cell
            bands[f"{scale}|{band}"] = row
    return bands


def report(step: int, result: dict, anchor_line: str) -> str:
    """One checkpoint's tables as markdown."""
    lines = [f"## Step {step}", "",
             f"{result['prompts']} prompts, {result['reference']} reference draws each; {anchor_line}. True "
             "accuracy per level (mean over its prompts [95% t interval]): "
             + ", ".join(f"{level} {format_interval(figures['mean'], figures['half_width'], digits=2)}"
                         for level, figures in result["levels"].items()) + "."]
    for size, figures in result["sizes"].items():
        spread = figures["spread"]
        beliefs = figures["beliefs"]
        lines += ["", f"### G = {size}", "",
                  f"Groups that update (not all equal): {figures['updating_share']:.0%}. The anchor's belief C for "
                  f"the drawn batches: {min(beliefs):.3f}-{max(beliefs):.3f}.", "",
                  f"Groups with one correct response ({spread['one_correct']['groups']}, mean p "
                  f"{spread['one_correct']['mean_p']:.3f}; baseline 1/G above p in "
                  f"{spread['one_correct']['baseline_above_p']:.0%}) and with one wrong response "
                  f"({spread['one_wrong']['groups']}, mean p {spread['one_wrong']['mean_p']:.3f}; baseline 1 - 1/G "
                  f"below p in {spread['one_wrong']['baseline_below_p']:.0%}), by their prompt's p:", "",
                  "| groups | " + " | ".join(band_name(i, SPREAD_BINS) for i in range(len(SPREAD_BINS) - 1)) + " |",
                  "|" + " --- |" * len(SPREAD_BINS)]
        for key, name in (("one_correct", "one correct"), ("one_wrong", "one wrong")):
            lines.append(f"| {name} | " + " | ".join(str(count) for count in spread[key]["counts"]) + " |")
        for scale in SCALES:
            lines += ["", f"{scale.capitalize()} advantage, G = {size}: the true advantage and each estimate's "
                          "error (estimate - true; mean over the band's prompts [95% t interval]):", "",
                      "| p | responses | prompts (updating) | true | " + " | ".join(
                          f"{estimate} error | {estimate} abs error" for estimate in ESTIMATES) + " |",
                      "|" + " --- |" * (4 + 2 * len(ESTIMATES))]
            for key, row in figures["bands"].items():
                if not key.startswith(scale + "|"):
                    continue
                band = key.split("|", 1)[1]
                for outcome in OUTCOMES:
                    cell = row[outcome]
                    if not cell["prompts"]:
                        continue
                    cells = [band, f"{outcome} ({cell['responses']})",
                             f"{cell['prompts']} ({row['updating_share']:.0%})",
                             format_interval(*cell["truth"], signed=True)]
                    for estimate in ESTIMATES:
                        cells += [format_interval(*cell[estimate]["signed"], signed=True),
                                  format_interval(*cell[estimate]["absolute"])]
                    lines.append("| " + " | ".join(cells) + " |")
    if "estimators" in result:

        header = ["p", "G", "estimator"] + [title for title, *_ in COLUMNS]
        lines += ["", "Every estimator against the truth, per band of p (centred; mean [95% interval], prompts as "
                      "clusters; docs/estimators.md):", "", "| " + " | ".join(header) + " |",
                  "|" + " --- |" * len(header)]
        for band in next(iter(result["estimators"].values())):
            lines += table(band, {size: {band: bands[band]} for size, bands in result["estimators"].items()}, band)
    return "\n".join(lines)


def summary_table(figures: dict[int, dict]) -> str:
    """Every checkpoint's headline figures, one table a scale: per step and G, the anchor's
    belief C, each estimate's mean absolute error over every response of the groups that
    update, and its signed error on the rare outcomes: the correct responses to the hard
    prompts (p < 0.3) and the wrong responses to the easy ones (p >= 0.7). Mean ± 95%
    half-width, to 2 decimals (the full tables have 3)."""
    def cell(figure, signed):
        mean, half = figure
        text = f"{mean:+.2f}" if signed else f"{mean:.2f}"
        return text if math.isnan(half) else f"{text} ± {half:.2f}"

    columns = [("all", "any", "absolute", "abs error, all"), ("p < 0.3", "correct", "signed", "correct, p < 0.3"),
               ("p >= 0.7", "wrong", "signed", "wrong, p ≥ 0.7")]
    short = {"GRPO": "GRPO", "HA-DW": "HA-DW", "HA-DW / lambda": "HA-DW / λ"}
    lines = []
    for scale in SCALES:
        header = ["step", "G", "C"] + [f"{title}: {short[estimate]}" if index == 0 else short[estimate]
                                       for *_, title in columns for index, estimate in enumerate(ESTIMATES)]
        lines += ["", f"{scale.capitalize()} scale:", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for step, result in figures.items():
            for size, per_size in result["sizes"].items():
                beliefs = per_size["beliefs"]
                belief = f"{beliefs[0]:.2f}" if max(beliefs) - min(beliefs) < 0.005 else \
                    f"{min(beliefs):.2f}-{max(beliefs):.2f}"
                cells = [str(step), str(size), belief]
                for band, outcome, kind, _ in columns:
                    row = per_size["bands"][f"{scale}|{band}"][outcome]
                    for estimate in ESTIMATES:
                        cells.append(cell(row[estimate][kind], kind == "signed") if row["prompts"] else "-")
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines[1:])


# -- drawing ---------------------------------------------------------------------------


def fixed_problems(config, per_level: int):
    """The prompt set: the task's held-out problems where it has a set (the arithmetic
    task), else ``per_level`` distinct problems of each level drawn from the task (fewer
    where a level has fewer: the synthetic task's copy and next have 10)."""
    import numpy as np

    data = config.data
    task = TASKS[data.task]
    levels = list(data.levels) or list(task.levels)
    if task.held_out is not None:
        return task.held_out(levels, per_level, data)
    if task.draw is None or data.context_tokens:
        drawn = ", ".join(name for name, row in TASKS.items() if row.draw is not None)
        raise ConfigError(f"the bias tool needs a task that draws its problems by level ({drawn}; without "
                          f"data.context_tokens, which makes every prompt distinct); this run's is {data.task!r}")
    rng = np.random.default_rng(PROBLEM_SEED)
    problems: list[Problem] = []
    for level in levels:
        chosen: dict[str, Problem] = {}
        for _ in range(50 * per_level):
            (problem,) = task.draw([level], 1, rng, data, frozenset())
            chosen.setdefault(problem.prompt, problem)
            if len(chosen) == per_level:
                break
        problems.extend(chosen.values())
    return problems


def checkpoint_weights(checkpoint: Path, zero_stage: int) -> dict:
    """The policy's weights in a checkpoint (DeepSpeed's model states; under ZeRO-3,
    gathered from the partitions). A checkpoint is trusted input (docs/trainer.md)."""
    import torch

    from trainer.engine.checkpoint import DEEPSPEED_TAG

    if zero_stage < 3:
        return torch.load(checkpoint / DEEPSPEED_TAG / "mp_rank_00_model_states.pt", map_location="cpu",
                          weights_only=True)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_TAG)


def draw(engine, rollout_config, prompt_ids: list[list[int]], responses_per_prompt: int, seed_key: list[int],
         reward, problems, tokenizer, chunk: int, label: str) -> list[list[float]]:
    """Each prompt's ``responses_per_prompt`` rewards, sampled ``chunk`` prompts at a time
    (progress after each chunk but the last), each prompt's draw seeded from ``seed_key``
    and its index."""
    import numpy as np

    engine.config = replace(rollout_config, group_size=responses_per_prompt)
    seeds = [int(s) for s in np.random.SeedSequence(seed_key).generate_state(len(prompt_ids))]
    rewards = []
    started = time.perf_counter()
    for start in range(0, len(prompt_ids), chunk):
        if start:
            _progress(f"{label}: {start}/{len(prompt_ids)} prompts ({time.perf_counter() - started:.0f} s)")
        ids = prompt_ids[start:start + chunk]
        responses, _ = engine.generate(ids, seeds[start:start + chunk])
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        per_response = [problem for problem in problems[start:start + chunk] for _ in range(responses_per_prompt)]
        scored = reward(texts, per_response).rewards
        other = next((value for value in scored if value not in (0.0, 1.0)), None)
        if other is not None:
            raise ValueError(f"the bias tool counts right and wrong answers, so it needs rewards of 0 or 1; this "
                             f"run's reward gave {other!r}")
        rewards += [scored[i:i + responses_per_prompt] for i in range(0, len(scored), responses_per_prompt)]
    return rewards


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _prepare_environment_first(argv: list[str]) -> None:
    """The run's thread count and engine settings into the environment before torch loads
    (importing the library loads it, and the argument types come from the library): the
    run is the first argument naming a directory with a config.yaml, its overrides the
    --set values. Anything wrong is left to the full parse to report."""
    from trainer.engine.environment import prepare_environment

    overrides = [value for flag, value in zip(argv, argv[1:]) if flag == "--set"]
    overrides += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--set=")]
    runs = [Path(arg) for arg in argv if not arg.startswith("-") and (Path(arg) / "config.yaml").is_file()]
    if runs:
        try:
            prepare_environment(load_config(runs[0] / "config.yaml", overrides))
        except ConfigError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _prepare_environment_first(argv)
    from hadw_kernels.tools.cli import POSITIVE_INT, HelpFormatter, int_at_least, output_file, summary

    parser = argparse.ArgumentParser(description=summary(__doc__), formatter_class=HelpFormatter)
    parser.add_argument("run", type=Path, help="a run directory (runs/<run.name>) with checkpoints")
    parser.add_argument("--steps", type=POSITIVE_INT, nargs="+",
                        help="the checkpoints' steps (default: the newest checkpoint)")
    parser.add_argument("--group-sizes", type=int_at_least(2), nargs="+", default=[4, 8], metavar="G",
                        help="the group sizes to draw")
    parser.add_argument("--groups", type=POSITIVE_INT, default=4, help="groups of each G a prompt")
    parser.add_argument("--reference", type=int_at_least(2), default=128,
                        help="reference draws a prompt (its true accuracy)")
    parser.add_argument("--prompts-per-level", type=POSITIVE_INT, default=64,
                        help="prompts of each level (the arithmetic task: its held-out problems)")
    parser.add_argument("--chunk", type=POSITIVE_INT, default=64,
                        help="prompts per engine call (progress is shown after each)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seeds the draws")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override the run's config (run.threads, rollout.engine; repeatable)")
    parser.add_argument("--history-discounts", type=float, nargs="+", default=[], metavar="RHO",
                        help="also score the prompt history rebuilt from the run's outcomes.jsonl at these discounts "
                             "(default: only the run's own history, from the checkpoint)")
    parser.add_argument("--output", type=output_file, help="also write the tables as markdown here (default: none)")
    parser.add_argument("--json", type=output_file, help="write every draw and figure as JSON here (default: none)")
    parser.add_argument("--plot", type=output_file, help="the error plot, one PNG per checkpoint: <stem>-step<k>.png "
                                                  "(default: none)")
    args = parser.parse_args(argv)
    saved = args.run / "config.yaml"
    if not saved.is_file():
        parser.error(f"argument run: {args.run} holds no run (no config.yaml)")
    available = dict(completed_checkpoints(args.run / "checkpoints"))
    if not available:
        parser.error(f"argument run: {args.run} has no checkpoint")
    steps = args.steps or [max(available)]
    missing = [step for step in steps if step not in available]
    if missing:
        parser.error(f"argument --steps: no checkpoint at step(s) {missing} in {args.run}; it has {sorted(available)}")
    try:
        config = load_config(saved, args.overrides)
        for step in steps:
            verify_checkpoint(available[step])
    except (ConfigError, CheckpointError) as error:
        parser.error(str(error))

    started = time.perf_counter()
    try:
        problems = fixed_problems(config, args.prompts_per_level)
    except ConfigError as error:
        parser.error(f"argument run: {error}")
    figures, draws_out, tables = run_checkpoints(args, config, problems, steps, available)

    text = "\n\n".join(["## Summary", summary_table(figures),
                         "Every estimator against the truth over every prompt (centred; docs/estimators.md):",
                         estimator_summary(figures)] + tables)
    print(text)
    header = (f"# The advantage's bias in {args.run}\n\nWritten by `python -m trainer.tools.bias "
              + shlex.join(argv) + f"` ({time.perf_counter() - started:.0f} s).\n\n")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(header + text + "\n")
        _progress(f"tables: {args.output}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"run": str(args.run), "draws": draws_out, "figures": figures}))
        _progress(f"draws and figures: {args.json}")
    return 0


def run_checkpoints(args, config, problems, steps: list[int], available: dict[int, Path]):
    """Draws at each checkpoint, then analyses and tables them."""
    from transformers import AutoTokenizer

    from hadw_kernels import prompt_key
    from trainer.engine.checkpoint import TRAINER_STATE
    from trainer.engine.loop import build_anchor
    from trainer.tasks.problem import encode_prompt
    from trainer.tasks.rewards import build_reward
    from trainer.tools.calibrate import rollout_engine

    if config.model.path:
        from trainer.models.pretrained import ensure_converted, resolve_model_source

        model_dir = ensure_converted(resolve_model_source(config.model.path), config.model.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        model_dir = args.run / "initial_model"
        tokenizer = AutoTokenizer.from_pretrained(args.run / "tokenizer")
    engine_name = resolve_engine(config.rollout.engine)
    _progress(f"{len(problems)} prompts; engine {engine_name}; starting it")
    engine = rollout_engine(config, model_dir, tokenizer, engine_name)
    prompt_ids = [encode_prompt(tokenizer, problem.prompt, apply_chat_template=config.data.apply_chat_template,
                                max_prompt_tokens=config.data.max_prompt_tokens) for problem in problems]
    reward = build_reward(config.data, config.reward)
    figures, draws_out, tables = {}, {}, []
    try:
        for step in steps:
            checkpoint = available[step]
            weights = checkpoint_weights(checkpoint, config.train.zero_stage)
            if engine.needs_weight_sync:
                engine.sync_weights(iter(weights.items()))
            else:
                engine.module.load_state_dict(weights)
            anchor, lambda_scale = build_anchor(config.algorithm)
            trainer_state = json.loads((checkpoint / TRAINER_STATE).read_text())
            anchor.load_state_dict(trainer_state["anchor"])
            priors = history_priors(args, config, trainer_state, step, [prompt_key(ids) for ids in prompt_ids])
            began = time.perf_counter()
            total = len(args.group_sizes) * args.groups + 1
            groups: dict[int, list[list[list[float]]]] = {}
            done = 0
            for size in args.group_sizes:
                groups[size] = []
                for repeat in range(args.groups):
                    done += 1
                    _progress(f"step {step}: draw {done}/{total}: G = {size}, group {repeat + 1} of {args.groups} "
                              f"({time.perf_counter() - began:.0f} s)")
                    groups[size].append(draw(engine, config.rollout, prompt_ids, size, [args.seed, 1, size, repeat],
                                             reward, problems, tokenizer, args.chunk, f"step {step}: draw {done}"))
            _progress(f"step {step}: draw {total}/{total}: {args.reference} reference responses a prompt "
                      f"({time.perf_counter() - began:.0f} s)")
            reference = draw(engine, config.rollout, prompt_ids, args.reference, [args.seed, 2], reward, problems,
                             tokenizer, args.chunk, f"step {step}: draw {total}")
            draws = Draws(levels=[problem.level for problem in problems],
                          reference_correct=[int(round(sum(rewards))) for rewards in reference],
                          reference=args.reference, groups=groups, beliefs=anchor_beliefs(anchor, groups),
                          batch_prompts=config.train.prompts_per_step, priors=priors)
            result = analyse(draws, lambda_scale)
            figures[step] = result
            draws_out[step] = {"prompts": [problem.prompt for problem in problems], **draws.__dict__}
            preset = config.algorithm.anchor_preset
            anchor_line = (f"the run's anchor: {preset} (restored from the checkpoint), lambda {lambda_scale:g}; "
                           f"{'HA-DW' if config.algorithm.hadw else 'GRPO'} run, loss {config.algorithm.loss_type}")
            tables.append(report(step, result, anchor_line))
            _progress(f"step {step}: drawn and analysed in {time.perf_counter() - began:.0f} s")
            if args.plot is not None:
                from trainer.engine.plotting import plot_bias

                path = args.plot.with_name(f"{args.plot.stem}-step{step}{args.plot.suffix or '.png'}")
                path.parent.mkdir(parents=True, exist_ok=True)
                plot_bias(result, path, f"{args.run.name}, step {step}: estimate - true advantage")
                _progress(f"plot: {path}")
    finally:
        reward.close()
    return figures, draws_out, tables


def history_priors(args, config, trainer_state: dict, step: int, keys: list[int]) -> dict[str, list[list[float]]]:
    """Each prompt's (alpha, beta) as the run's next batch would read them: the run's own
    history, restored from the checkpoint (absent from checkpoints of before it), and the
    history rebuilt from outcomes.jsonl at each of ``--history-discounts``."""
    from trainer.engine.loop import build_history
    from trainer.engine.metrics_log import read_metrics

    priors = {}
    history = build_history(config.algorithm)
    if "history" in trainer_state:
        history.load_state_dict(trainer_state["history"])
        priors[f"run's, rho {history.discount:g}"] = history.read(keys).tolist()
    if args.history_discounts:
        outcomes = read_metrics(args.run / "outcomes.jsonl")
        if not outcomes:
            raise SystemExit(f"--history-discounts: {args.run} has no outcomes.jsonl to rebuild the history from")
        for discount in args.history_discounts:
            priors[f"rho {discount:g}"] = replayed_priors(outcomes, step, discount, history.prior_strength, keys)
    return priors


if __name__ == "__main__":
    sys.exit(main())
