"""GRPO against GRPO + HA-DW (the default Kalman anchor, and the authors' preset), same
seeds and prompts, curves side by side and a markdown table.

    python trainer/tools/compare.py                                     # the CPU default task, 3 seeds
    python trainer/tools/compare.py --seeds 0 2 --lr-scale 1.3          # two of these side by side,
    python trainer/tools/compare.py --seeds 1 3 --lr-scale 1.3          # on disjoint seeds, then one
    python trainer/tools/compare.py --seeds 0 1 2 3 --lr-scale 1.3      # call for the table (reuses all)
    python trainer/tools/compare.py --config trainer/configs/smollm2_arithmetic.yaml \\
        --seeds 0 1 --name compare-smollm2 --table docs/smollm2-experiment.md \\
        --plot docs/figures/smollm2-experiment.png

Each run is ``trainer/run.py`` in its own process (one engine per process), named
``<name>/<variant>-seed<k>`` under ``run.output_dir``. A seed fixes the prompts of every
step (drawn from (seed, step)), so the variants of a seed train on the same prompts.
Finished runs are reused and unfinished ones resumed, so an interrupted comparison picks
up where it stopped. The PNG (``<name>/comparison.png`` unless ``--plot``) shows the training reward and, where the
task has a held-out set (eval.every > 0), the held-out greedy accuracy of each level
(otherwise the training accuracy per level): the mean over seeds with the min-max band.

"GRPO (lr x mean Phi)" is GRPO at the learning rate times HA-DW's mean Phi: by default the
mean of ``phi_mean`` over the steps and seeds of this call's "GRPO+HA-DW (kalman)" runs
(which then run first), or ``--lr-scale``. HA-DW multiplies every advantage by Phi, whose
mean is above 1; under AdamW that constant part cancels in the update, so this variant
takes a larger step than HA-DW does and measures the task's sensitivity to the learning
rate (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hadw_kernels.cli import NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, HelpFormatter, output_file, summary
from trainer.config import load_config
from trainer.engine.metrics_log import read_metrics

LR_SCALED = "GRPO (lr x mean Phi)"
KALMAN = "GRPO+HA-DW (kalman)"
VARIANTS = {
    "GRPO": ["algorithm.hadw=false"],
    LR_SCALED: ["algorithm.hadw=false"],  # and train.learning_rate, set in main()
    KALMAN: ["algorithm.hadw=true", "algorithm.anchor_preset=kalman"],
    "GRPO+HA-DW (authors)": ["algorithm.hadw=true", "algorithm.anchor_preset=authors_code"],
}


def run_name(name: str, label: str, seed: int) -> str:
    slug = label.lower().replace("+", "-").replace(" (", "-").replace(")", "").replace("'", "").replace(" ", "-")
    return f"{name}/{slug}-seed{seed}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=summary(__doc__), formatter_class=HelpFormatter)
    parser.add_argument("--seeds", type=NON_NEGATIVE_INT, nargs="+", default=[0, 1, 2], help="train.seed of each run")
    parser.add_argument("--steps", type=POSITIVE_INT, help="rollout batches per run (default: the config's train.steps)")
    parser.add_argument("--config", help="a YAML config for every run (default: the trainer's CPU default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--name", default="compare", help="directory under run.output_dir")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="LABEL",
                        help=f"which of {list(VARIANTS)}")
    parser.add_argument("--lr-scale", type=POSITIVE_FLOAT,
                        help=f"the factor on the learning rate of {LR_SCALED!r} (default: the mean Phi of this "
                             f"call's {KALMAN!r} runs, to 2 decimals)")
    parser.add_argument("--table", type=output_file, help="also write the results as markdown to this file (default: none)")
    parser.add_argument("--plot", type=output_file, help="where the PNG goes (default: <run.output_dir>/<name>/comparison.png)")
    args = parser.parse_args(argv)
    if LR_SCALED in args.variants and args.lr_scale is None and KALMAN not in args.variants:
        parser.error(f"{LR_SCALED!r} needs --lr-scale, or {KALMAN!r} among the variants to measure it on")

    shared = list(args.overrides) + ["run.plot=false"]
    if args.steps is not None:
        shared.append(f"train.steps={args.steps}")
    base = load_config(args.config, shared)
    output = Path(base.run.output_dir)
    runs: dict[str, list[dict]] = {}
    started = time.perf_counter()
    total = len(args.variants) * len(args.seeds)
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
            name = run_name(args.name, label, seed)
            _check_learning_rate(output / name, learning_rate)
            rows = read_metrics(output / name / "metrics.jsonl")
            if not rows or rows[-1]["step"] < base.train.steps:
                command = [sys.executable, "-m", "trainer.run"]
                if args.config:
                    command += ["--config", args.config]
                overrides = shared + variant + [f"train.seed={seed}", f"run.name={name}"]
                command += [arg for override in overrides for arg in ("--set", override)]
                command += ["--resume", "--start-if-missing"]
                done = sum(len(seeds) for seeds in runs.values()) - 1
                print(f"== run {done + 1}/{total}: {label}, seed {seed} ({time.perf_counter() - started:.0f} s "
                      f"so far): {' '.join(command[2:])}", flush=True)
                subprocess.run(command, check=True)
                rows = read_metrics(output / name / "metrics.jsonl")
            evaluations = read_metrics(output / name / "eval.jsonl")
            runs[label].append({"metrics": rows, "eval": evaluations})
            print(f"   {label} seed {seed}: reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}"
                  + (f", held-out {evaluations[0]['eval/mean']:.3f} -> {evaluations[-1]['eval/mean']:.3f}"
                     if evaluations else ""), flush=True)
    runs = {label: runs[label] for label in args.variants}

    from trainer.engine.plotting import plot_comparison

    path = args.plot or output / args.name / "comparison.png"
    title = f"{base.model.path or 'tiny model'}, {base.data.task} task, {len(args.seeds)} seeds, {base.train.steps} steps"
    plot_comparison(runs, path, title)
    table = results_table(runs, base.train.steps)
    print(table)
    if args.table is not None:
        command = "python trainer/tools/compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.table.write_text(
            f"# {title}\n\nWritten by `{command}` ({time.perf_counter() - started:.0f} s for the runs this call "
            f"made). Plot: `{path}`.\n\n{table}\n"
        )
        print(f"table: {args.table}")
    print(f"plot: {path}")
    return 0


def _check_learning_rate(run_dir: Path, learning_rate: float) -> None:
    """A run is reused or resumed only at the learning rate asked for: the scaled variant's
    name does not hold its factor, and a second factor must not mix into its seeds."""
    saved = run_dir / "config.yaml"
    if saved.exists() and load_config(saved).train.learning_rate != learning_rate:
        raise SystemExit(f"{run_dir} ran at learning rate {load_config(saved).train.learning_rate:g}, this call asks "
                         f"for {learning_rate:g}: pass the --lr-scale it ran with, or another --name")


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


if __name__ == "__main__":
    sys.exit(main())
