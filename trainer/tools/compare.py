"""GRPO against GRPO + HA-DW (the default Kalman anchor, and the authors' preset), same
seeds and prompts, curves side by side and a markdown table.

    python trainer/tools/compare.py                                     # the CPU default task, 3 seeds
    python trainer/tools/compare.py --seeds 0 2 --lr-scale 1.3          # two of these side by side,
    python trainer/tools/compare.py --seeds 1 3 --lr-scale 1.3          # on disjoint seeds, then one
    python trainer/tools/compare.py --seeds 0 1 2 3 --lr-scale 1.3      # call for the table (reuses all)
    python trainer/tools/compare.py --config trainer/configs/smollm2_arithmetic.yaml \\
        --seeds 0 1 --name compare-smollm2 --table runs/compare-smollm2/table.md \\
        --plot docs/figures/smollm2-experiment.png
    python trainer/tools/compare.py --sweep rollout.group_size=2,4,8,16 --seeds 0 1 2 3 4 5 6 7 \\
        --variants GRPO "GRPO+HA-DW (kalman)" --name sweep-group-size    # every variant at each G

Each run is ``trainer/run.py`` in its own process (one engine per process), named
``<name>/<variant>-seed<k>`` under ``run.output_dir``. A seed fixes the prompts of every
step (drawn from (seed, step)), so the variants of a seed train on the same prompts.
Finished runs are reused and unfinished ones resumed, so an interrupted comparison picks
up where it stopped; only where they ran what this call asks: each run's fingerprint
(every setting of its resolved config but where it is, what it shows and the machine's
resources: ``UNFINGERPRINTED``) is compared with this call's, a mismatch refused naming
the differing keys, and stored beside the run (``fingerprint.json``). The PNG (``<name>/comparison.png`` unless ``--plot``) shows the training reward and, where the
task has a held-out set (eval.every > 0), the held-out greedy accuracy of each level
(otherwise the training accuracy per level): the mean over seeds with the min-max band.

``--sweep SECTION.KEY=V1,V2,...`` runs the comparison at each value of one setting (every
other setting as given, so ``rollout.group_size`` changes G at a fixed number of prompts a
step), each value's runs under ``<name>/<key>-<value>/``, and adds four tables: per value
and variant, the last fifth's mean over seeds with its 95% t interval; per value, each
variant minus the first variant (the baseline) on the same seeds (a seed fixes the model's
initial weights and the prompts, so the difference is paired); each variant at one value
minus the baseline at the next (with G = 2, 4, 8, 16: HA-DW at G against GRPO at 2G); and
how the HA-DW variants weighed their groups (``phi_balance``). Its plot (``--plot``,
default ``<name>/sweep.png``) shows the first three.

Every run's wall time is appended to ``<name>/run_times.jsonl``, resumed and failed
attempts included, and the output ends with their sum: the machine time the comparison
cost.

"GRPO (lr x mean Phi)" is GRPO at the learning rate times HA-DW's mean Phi: by default the
mean of ``phi_mean`` over the steps and seeds of this call's "GRPO+HA-DW (kalman)" runs
(which then run first), or ``--lr-scale``. HA-DW multiplies every advantage by Phi, whose
mean is above 1; under AdamW that constant part cancels in the update, so this variant
takes a larger step than HA-DW does and measures the task's sensitivity to the learning
rate (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Run as a file, Python puts this file's folder on the path, not the checkout that holds
# the package: the wheel installs the library only, the trainer runs from its checkout
# (docs/trainer.md).
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hadw_kernels.tools.cli import NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, HelpFormatter, output_file, summary
from trainer.config import RESUMABLE_KEYS, ConfigError, load_config, validate
from trainer.engine.metrics_log import read_metrics
from trainer.engine.settings import resolve_engine
from trainer.tools.intervals import format_interval, mean_interval

if TYPE_CHECKING:
    from trainer.engine.plotting import SweepSummary

RUN = Path(__file__).resolve().parents[1] / "run.py"
LR_SCALED = "GRPO (lr x mean Phi)"
KALMAN = "GRPO+HA-DW (kalman)"
VARIANTS = {
    "GRPO": ["algorithm.hadw=false"],
    LR_SCALED: ["algorithm.hadw=false"],  # and train.learning_rate, set in main()
    KALMAN: ["algorithm.hadw=true", "algorithm.anchor_preset=kalman"],
    "GRPO+HA-DW (authors)": ["algorithm.hadw=true", "algorithm.anchor_preset=authors_code"],
    # The estimators of docs/math.md section 2a, each without Phi and without the std; so
    # that the baseline's effect reads apart from the std's, GRPO's own baseline without
    # the std too (Dr.GRPO's advantage, at GRPO's aggregation: only the std differs).
    "Dr.GRPO": ["algorithm.hadw=false", "algorithm.normalize_std=false"],
    "RLOO": ["algorithm.hadw=false", "algorithm.advantage_estimator=rloo"],
    "James-Stein": ["algorithm.hadw=false", "algorithm.advantage_estimator=james_stein"],
    "prompt history": ["algorithm.hadw=false", "algorithm.advantage_estimator=prompt_history"],
    # HA-DW's Phi on the history's advantages.
    "prompt history+Phi": ["algorithm.hadw=true", "algorithm.anchor_preset=kalman",
                           "algorithm.advantage_estimator=prompt_history"],
}


def run_name(name: str, label: str, seed: int) -> str:
    slug = label.lower().replace("+", "-").replace(" (", "-").replace(")", "").replace("'", "").replace(" ", "-")
    return f"{name}/{slug}-seed{seed}"


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``rollout.group_size=2,4,8`` -> (``rollout.group_size``, ["2", "4", "8"]); the values
    are parsed as the config parses any override (YAML)."""
    key, sep, values = text.partition("=")
    parts = [value.strip() for value in values.split(",")]
    if not sep or "." not in key or not all(parts):
        raise argparse.ArgumentTypeError(f"expected SECTION.KEY=V1,V2,..., got {text!r}")
    if len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"a value is given twice in {text!r}")
    if key in ("train.seed", "run.name", "run.output_dir"):
        raise argparse.ArgumentTypeError(f"{key} cannot be swept (seeds are --seeds, the directories --name)")
    return key, parts


def sweep_directory(name: str, key: str, value: str) -> str:
    """Where one value's runs go: ``sweep/group_size-8`` for rollout.group_size=8."""
    slug = "".join(char if char.isalnum() or char in "._-" else "_" for char in value)
    return f"{name}/{key.rsplit('.', 1)[-1]}-{slug}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=summary(__doc__), formatter_class=HelpFormatter)
    parser.add_argument("--seeds", type=NON_NEGATIVE_INT, nargs="+", default=[0, 1, 2], help="train.seed of each run")
    parser.add_argument("--steps", type=POSITIVE_INT, help="rollout batches per run (default: the config's train.steps)")
    parser.add_argument("--config", help="a YAML config for every run (default: the trainer's CPU default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--sweep", type=parse_sweep, metavar="SECTION.KEY=V1,V2,...",
                        help="run the comparison at each of these values of one setting (default: none)")
    parser.add_argument("--name", default="compare", help="directory under run.output_dir")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS)[:4], metavar="LABEL",
                        help=f"which of {list(VARIANTS)}; the first is the baseline of a sweep's differences")
    parser.add_argument("--lr-scale", type=POSITIVE_FLOAT,
                        help=f"the factor on the learning rate of {LR_SCALED!r} (default: the mean Phi of this "
                             f"call's {KALMAN!r} runs, to 2 decimals)")
    parser.add_argument("--table", type=output_file, help="also write the results as markdown to this file (default: none)")
    parser.add_argument("--plot", type=output_file, help="where the PNG goes (default: <run.output_dir>/<name>/comparison.png, "
                                                         "or sweep.png with --sweep)")
    args = parser.parse_args(argv)
    if LR_SCALED in args.variants and args.lr_scale is None and KALMAN not in args.variants:
        parser.error(f"{LR_SCALED!r} needs --lr-scale, or {KALMAN!r} among the variants to measure it on")

    shared = list(args.overrides) + ["run.plot=false"]
    if args.steps is not None:
        shared.append(f"train.steps={args.steps}")
    levels: list[tuple[str, list[str]]]
    if args.sweep is None:
        levels = [(args.name, [])]
    else:
        key, values = args.sweep
        if any(override.partition("=")[0] == key for override in args.overrides):
            parser.error(f"argument --sweep: {key} is also given by --set")
        levels = [(sweep_directory(args.name, key, value), [f"{key}={value}"]) for value in values]
        for _, setting in levels:
            try:
                validate(load_config(args.config, shared + setting))
            except ConfigError as error:
                parser.error(f"argument --sweep: {setting[0]}: {error}")
    base = load_config(args.config, shared)
    output = Path(base.run.output_dir)
    started = time.perf_counter()
    progress = {"done": 0, "total": len(levels) * len(args.variants) * len(args.seeds), "started": started}
    # Per swept value (None: no sweep), the runs of each variant.
    results: dict[str | None, dict[str, list[dict]]] = {}
    for directory, setting in levels:
        runs = run_variants(args, shared + setting, output, directory, progress, output / args.name / "run_times.jsonl")
        results[setting[0].partition("=")[2] if setting else None] = runs

    from trainer.engine.plotting import plot_comparison, plot_sweep

    title = f"{base.model.path or 'tiny model'}, {base.data.task} task, {len(args.seeds)} seeds, {base.train.steps} steps"
    tables = []
    for (directory, setting), runs in zip(levels, results.values()):
        path = args.plot if args.sweep is None and args.plot else output / directory / "comparison.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_comparison(runs, path, f"{title}, {setting[0]}" if setting else title)
        print(f"plot: {path}")
        tables.append((f"## {setting[0]}\n\n" if setting else "") + results_table(runs, base.train.steps))
    if args.sweep is not None:
        path = args.plot or output / args.name / "sweep.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        summary_rows = sweep_summary({value: runs for value, runs in results.items() if value is not None},
                                     base.train.steps)
        plot_sweep(summary_rows, args.sweep[0], path, title)
        print(f"plot: {path}")
        tables.append(sweep_tables(summary_rows, args.sweep[0], base.train.steps))
    times = read_metrics(output / args.name / "run_times.jsonl")
    tables.append(f"Machine time: {duration(sum(row['seconds'] for row in times))} over {len(times)} run processes "
                  "(the sum of their wall times, resumed and failed attempts included).")
    table = "\n\n".join(tables)
    print(table)
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        command = "python trainer/tools/compare.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        args.table.write_text(
            f"# {title}\n\nWritten by `{command}` ({time.perf_counter() - started:.0f} s for the runs this call "
            f"made). Plot: `{path}`.\n\n{table}\n"
        )
        print(f"table: {args.table}")
    return 0


def run_variants(args, shared: list[str], output: Path, directory: str, progress: dict,
                 times: Path) -> dict[str, list[dict]]:
    """Every variant at every seed under ``output/directory``: finished runs read back,
    the others run (or resumed) in turn. Per label, one ``{"seed", "metrics", "eval"}`` per
    seed, in the order of ``args.variants``."""
    base = load_config(args.config, shared)
    runs: dict[str, list[dict]] = {}
    # The scaled variant's factor is measured on the Kalman runs, so those run before it.
    for label in sorted(args.variants, key=lambda label: label == LR_SCALED):
        variant = list(VARIANTS[label])
        if label == LR_SCALED:
            lr_scale = args.lr_scale if args.lr_scale is not None else round(mean_phi(runs[KALMAN]), 2)
            variant.append(f"train.learning_rate={base.train.learning_rate * lr_scale:g}")
            print(f"== {LR_SCALED}: learning rate {base.train.learning_rate:g} x {lr_scale:g}", flush=True)
        learning_rate = load_config(args.config, shared + variant).train.learning_rate
        runs[label] = []
        for seed in args.seeds:
            name = run_name(directory, label, seed)
            _check_learning_rate(output / name, learning_rate)
            asked = fingerprint(load_config(args.config, shared + variant + [f"train.seed={seed}", f"run.name={name}"]))
            check_fingerprint(output / name, asked)
            rows = read_metrics(output / name / "metrics.jsonl")
            if rows and rows[-1]["step"] > base.train.steps:
                raise SystemExit(f"{output / name} ran {rows[-1]['step']} steps, this call asks for {base.train.steps}: "
                                 "its last steps' figures would be read as this call's; use another --name")
            if not rows or rows[-1]["step"] < base.train.steps:
                # The file, not `-m trainer.run`: it finds its checkout from any directory.
                command = [sys.executable, str(RUN)]
                if args.config:
                    command += ["--config", args.config]
                overrides = shared + variant + [f"train.seed={seed}", f"run.name={name}"]
                command += [arg for override in overrides for arg in ("--set", override)]
                command += ["--resume", "--start-if-missing"]
                print(f"== run {progress['done'] + 1}/{progress['total']}: {label}, seed {seed} "
                      f"({time.perf_counter() - progress['started']:.0f} s so far): {' '.join(command[2:])}", flush=True)
                _timed_run(command, name, times)
                rows = read_metrics(output / name / "metrics.jsonl")
            write_fingerprint(output / name)
            progress["done"] += 1
            evaluations = read_metrics(output / name / "eval.jsonl")
            runs[label].append({"seed": seed, "metrics": rows, "eval": evaluations,
                                "samples": read_metrics(output / name / "samples.jsonl")})
            print(f"   {label} seed {seed}: reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}"
                  + (f", held-out {evaluations[0]['eval/mean']:.3f} -> {evaluations[-1]['eval/mean']:.3f}"
                     if evaluations else ""), flush=True)
    return {label: runs[label] for label in args.variants}


def _timed_run(command: list[str], name: str, times: Path) -> None:
    """One run's process, its wall time appended to ``times`` whether it finished or not."""
    started = time.perf_counter()
    returncode = None
    try:
        returncode = subprocess.run(command).returncode
    finally:
        times.parent.mkdir(parents=True, exist_ok=True)
        with times.open("a") as handle:
            handle.write(json.dumps({"run": name, "seconds": round(time.perf_counter() - started, 1),
                                     "returncode": returncode}) + "\n")
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, command)


def _check_learning_rate(run_dir: Path, learning_rate: float) -> None:
    """A run is reused or resumed only at the learning rate asked for: the scaled variant's
    name does not hold its factor, and a second factor must not mix into its seeds."""
    saved = run_dir / "config.yaml"
    if saved.exists() and load_config(saved).train.learning_rate != learning_rate:
        raise SystemExit(f"{run_dir} ran at learning rate {load_config(saved).train.learning_rate:g}, this call asks "
                         f"for {learning_rate:g}: pass the --lr-scale it ran with, or another --name")


# The settings left out of a run's fingerprint: where the run is, and those that change
# neither what a step computes nor what this tool reads of it. That is the trainer's own
# list of what a resume may change (what it shows and logs, how often it saves, machine
# resources), less the evaluation's keys (they set the held-out figures the table
# reports) and run.log_samples (the groups phi_balance reads); train.steps among them,
# since a shorter run is resumed to the steps asked (a longer one is refused by its steps).
UNFINGERPRINTED = (RESUMABLE_KEYS - {"eval.every", "eval.problems_per_level", "run.log_samples"}) | {
    "run.name", "run.output_dir"}
FINGERPRINT_FILE = "fingerprint.json"


def fingerprint(config) -> dict:
    """What a run computes, for its reuse: ``{"settings": {section.key: value}, "sha256"}``,
    every key of the resolved config (rollout.engine resolved, as the run saves it) but
    :data:`UNFINGERPRINTED`, and the SHA-256 of their canonical JSON."""
    resolved = copy.deepcopy(config)
    resolved.rollout.engine = resolve_engine(resolved.rollout.engine)
    settings = {f"{section}.{key}": value for section, keys in resolved.to_dict().items()
                for key, value in keys.items() if f"{section}.{key}" not in UNFINGERPRINTED}
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return {"settings": settings, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def saved_fingerprint(run_dir: Path) -> dict | None:
    """The fingerprint of what ``run_dir`` ran, from the config.yaml the trainer wrote when
    it started (a key an older trainer did not write reads as its default); None before."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return None
    try:
        return fingerprint(load_config(saved))
    except ConfigError as error:  # a key since renamed or removed: what it ran cannot be compared
        raise SystemExit(f"{saved} does not read as this trainer's config ({error}): what the run ran cannot be "
                         "compared with this call; use another --name") from None


def check_fingerprint(run_dir: Path, asked: dict) -> None:
    """A run is reused or resumed only where it ran what this call asks: otherwise refused,
    one line naming each differing key with the run's value and this call's (the run is
    never removed here: another --name runs the new settings beside it)."""
    saved = saved_fingerprint(run_dir)
    if saved is None or saved["sha256"] == asked["sha256"]:
        return
    ran, wanted = saved["settings"], asked["settings"]
    differing = ", ".join(f"{key} {ran.get(key)!r} -> {wanted.get(key)!r}"
                          for key in sorted(set(ran) | set(wanted)) if ran.get(key) != wanted.get(key))
    raise SystemExit(f"{run_dir} ran with other settings than this call asks ({differing}): "
                     "use another --name, or move that run away to rerun it")


def write_fingerprint(run_dir: Path) -> None:
    """The run's fingerprint stored beside it (what the data files quote)."""
    saved = saved_fingerprint(run_dir)
    if saved is not None:
        (run_dir / FINGERPRINT_FILE).write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")


# A seed has collapsed when, over the last fifth of its steps, its policy is nearly
# deterministic while still wrong on half the prompts or more: groups of identical responses
# give no gradient, so it has stopped learning short of where the healthy seeds end (the
# CPU default ends at entropy ~0.3 and reward ~0.75; the collapses seen there ended at
# entropy 0.08-0.15 and reward 0.39-0.47).
COLLAPSE_ENTROPY = 0.2  # nats per token
COLLAPSE_REWARD = 0.5


def final_window_steps(steps: int) -> int:
    """The last fifth of the steps: the window every training figure of the table is over."""
    return max(1, steps // 5)


def final_window(rows: list[dict], steps: int) -> list[dict]:
    return rows[-final_window_steps(steps):]


def window_mean(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the rows that have it (a skipped update logs no entropy or Phi,
    a level no prompt drew this step logs None)."""
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def collapsed(rows: list[dict], steps: int) -> bool:
    window = final_window(rows, steps)
    return window_mean(window, "entropy_mean") < COLLAPSE_ENTROPY and window_mean(window, "reward/mean") < COLLAPSE_REWARD


def mean_phi(seeds: list[dict]) -> float:
    """HA-DW's mean Phi: the logged phi_mean over every step, averaged over the seeds."""
    return statistics.fmean(window_mean(seed["metrics"], "phi_mean") for seed in seeds)


def spread(values: list[float]) -> str:
    """Mean +- sample standard deviation over the seeds, then their range."""
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {deviation:.3f} ({min(values):.2f}-{max(values):.2f})"


def duration(seconds: float) -> str:
    """Seconds under ten minutes, minutes to one decimal beyond."""
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.1f} min"


def results_table(runs: dict[str, list[dict]], steps: int) -> str:
    """Per variant: the learning rate; the held-out accuracy per level at the start and
    the end (mean over seeds, each seed's value after it) where the runs were evaluated;
    over the last fifth of the steps, the training reward, the training accuracy per level
    and the entropy (each the mean over seeds +- their sd, and their range); how many seeds
    collapsed; and the time a run spent in its steps and evaluations (its start-up, the
    model's load and the engine's, left out)."""
    last = final_window_steps(steps)
    first = next(iter(runs.values()))[0]
    held_out = [key.split("/", 1)[1] for key in first["eval"][0] if key.startswith("eval/")] if first["eval"] else []
    trained = [key.split("/", 1)[1] for key in first["metrics"][0] if key.startswith("acc/")]
    header = ["variant", "learning rate"] + [f"held-out {level}: start -> end" for level in held_out]
    header += [f"train reward, last {last} steps"] + [f"train {level}" for level in trained]
    header += ["entropy", f"collapsed (entropy < {COLLAPSE_ENTROPY}, reward < {COLLAPSE_REWARD})",
               "steps + evals a run"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, seeds in runs.items():
        rates = sorted({row["lr"] for seed in seeds for row in seed["metrics"] if row.get("lr") is not None})
        cells = [label, ", ".join(f"{rate:g}" for rate in rates)]
        for level in held_out:
            start = [seed["eval"][0][f"eval/{level}"] for seed in seeds]
            end = [seed["eval"][-1][f"eval/{level}"] for seed in seeds]
            cells.append(f"{statistics.fmean(start):.2f} -> {statistics.fmean(end):.2f} "
                         f"({', '.join(f'{v:.2f}' for v in end)})")
        windows = [final_window(seed["metrics"], steps) for seed in seeds]
        for key in ["reward/mean"] + [f"acc/{level}" for level in trained] + ["entropy_mean"]:
            cells.append(spread([window_mean(window, key) for window in windows]))
        cells.append(f"{sum(collapsed(seed['metrics'], steps) for seed in seeds)} of {len(seeds)}")
        seconds = [sum(row["time/step"] for row in seed["metrics"]) + sum(row["time/eval"] for row in seed["eval"])
                   for seed in seeds]
        cells.append(duration(statistics.fmean(seconds)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _figure_name(key: str) -> str:
    return "reward" if key == "reward/mean" else key.split("/", 1)[1]


def _paired(first: dict[int, float], second: dict[int, float]) -> list[float]:
    """first - second on the seeds both have."""
    return [first[seed] - second[seed] for seed in first if seed in second]


def sweep_summary(results: dict[str, dict[str, list[dict]]], steps: int) -> SweepSummary:
    """The figures of a sweep's tables and plot, each a (mean, 95% half-width) pair over
    the seeds of each run's mean over the last fifth of the steps: ``means[value][label][key]``;
    ``differences[value][label][key]``, label minus the baseline (the first label) on the
    same seeds; ``next_differences[value][label][key]``, label at ``value`` minus the
    baseline at the next value (none for the last). Keys: the reward, then each level's
    training accuracy."""
    values = list(results)
    labels = list(results[values[0]])
    first = results[values[0]][labels[0]][0]["metrics"][0]
    keys = ["reward/mean"] + [key for key in first if key.startswith("acc/")]
    per_seed = {value: {label: {key: {seed["seed"]: window_mean(final_window(seed["metrics"], steps), key)
                                      for seed in seeds} for key in keys}
                        for label, seeds in runs.items()} for value, runs in results.items()}
    baseline = labels[0]
    summary: SweepSummary = {
        "values": values, "labels": labels, "baseline": baseline, "keys": keys, "means": {},
        "differences": {}, "next_differences": {},
        "seeds": {value: {label: len(seeds) for label, seeds in runs.items()} for value, runs in results.items()},
        "weighing": {
            value: {label: {"belief": mean_interval([window_mean(seed["metrics"], "anchor/belief") for seed in seeds]),
                            "balance": mean_interval([phi_balance(seed) for seed in seeds])}
                    for label, seeds in runs.items()
                    if "algorithm.hadw=true" in VARIANTS[label] and _grpo_baseline(label)}
            for value, runs in results.items()},
    }
    for index, value in enumerate(values):
        figures = per_seed[value]
        summary["means"][value] = {label: {key: mean_interval(list(figures[label][key].values())) for key in keys}
                                   for label in labels}
        summary["differences"][value] = {
            label: {key: mean_interval(_paired(figures[label][key], figures[baseline][key])) for key in keys}
            for label in labels[1:]}
        if index + 1 < len(values):
            following = per_seed[values[index + 1]][baseline]
            summary["next_differences"][value] = {
                label: {key: mean_interval(_paired(figures[label][key], following[key])) for key in keys}
                for label in labels[1:]}
    return summary


def _grpo_baseline(label: str) -> bool:
    """Whether a variant keeps GRPO's baseline, whose advantages phi_balance forms."""
    return not any(setting.startswith("algorithm.advantage_estimator=") for setting in VARIANTS[label])


def phi_balance(seed: dict) -> float:
    """How HA-DW's Phi weighed a run's logged groups (samples.jsonl: every rollout batch's
    first groups, their rewards whole) that update: the sum of Phi * |A_hat| over the
    responses below their group's mean over that over the responses above it, Phi from
    each step's logged belief. Without Phi the two sums are equal (the advantages of a
    group sum to 0): above 1, the update pushes the below-mean responses down harder than
    it pulls the above-mean ones up. Nan where no logged group updates."""
    import torch

    from hadw_kernels import all_equal_groups, group_advantages, hadw_weights

    beliefs = {row["step"]: row["anchor/belief"] for row in seed["metrics"]}
    below = above = 0.0
    for sample in seed["samples"]:
        rewards = torch.tensor(sample["group_rewards"], dtype=torch.float64)
        if rewards.numel() < 2 or all_equal_groups(rewards, rewards.numel()).item():
            continue
        weighted = group_advantages(rewards, rewards.numel()) * hadw_weights(rewards, rewards.numel(),
                                                                           beliefs[sample["step"]])
        below -= float(weighted[weighted < 0].sum())
        above += float(weighted[weighted > 0].sum())
    return below / above if above else math.nan


def sweep_tables(summary: SweepSummary, key: str, steps: int) -> str:
    """The sweep's three markdown tables (``sweep_summary``'s figures)."""
    last = final_window_steps(steps)
    names = [_figure_name(figure) for figure in summary["keys"]]
    baseline, values = summary["baseline"], summary["values"]
    lines = [f"## Over {key}\n",
             f"Each figure: a run's mean over the last {last} steps, then the mean over the seeds [its 95% t "
             f"interval]; the reward, then each level's training accuracy (sampled).\n",
             "| " + " | ".join([key, "variant", "seeds"] + names) + " |", "|" + " --- |" * (3 + len(names))]
    for value in values:
        for label, figures in summary["means"][value].items():
            cells = [value, label, str(summary["seeds"][value][label])]
            lines.append("| " + " | ".join(cells + [format_interval(*figures[k]) for k in summary["keys"]]) + " |")
    lines += ["", f"Each variant minus {baseline} on the same seeds (paired) [95% t interval]:\n",
              "| " + " | ".join([key, "difference"] + names) + " |", "|" + " --- |" * (2 + len(names))]
    for value in values:
        for label, figures in summary["differences"][value].items():
            cells = [value, f"{label} - {baseline}"]
            lines.append("| " + " | ".join(
                cells + [format_interval(*figures[k], signed=True) for k in summary["keys"]]) + " |")
    if summary["next_differences"]:
        lines += ["", f"Each variant at one value minus {baseline} at the next, on the same seeds [95% t interval]:\n",
                  "| " + " | ".join(["difference"] + names) + " |", "|" + " --- |" * (1 + len(names))]
        for index, value in enumerate(values[:-1]):
            for label, figures in summary["next_differences"][value].items():
                cells = [f"{label} at {value} - {baseline} at {values[index + 1]}"]
                lines.append("| " + " | ".join(
                    cells + [format_interval(*figures[k], signed=True) for k in summary["keys"]]) + " |")
    weighing = [(value, label, figures) for value, per_label in summary["weighing"].items()
                for label, figures in per_label.items()]
    if weighing:
        lines += ["", "How HA-DW weighed the groups: the anchor's belief C (mean over the steps), and Phi's weight on "
                      "the responses below their group's mean over its weight on those above (the logged groups that "
                      "update; 1: as GRPO), mean over the seeds [95% t interval]:\n",
                  f"| {key} | variant | belief C | below-mean / above-mean weight |", "| --- | --- | --- | --- |"]
        for value, label, figures in weighing:
            lines.append(f"| {value} | {label} | {format_interval(*figures['belief'])} | "
                         f"{format_interval(*figures['balance'], digits=2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
