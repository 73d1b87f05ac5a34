"""GRPO against GRPO + HA-DW (the default Kalman anchor, and the authors' preset), same
seeds and prompts, curves side by side and a markdown table.

    python trainer/compare.py                                     # the CPU default task, 3 seeds
    python trainer/compare.py --config trainer/configs/smollm2_arithmetic.yaml \\
        --seeds 0 1 --name compare-smollm2 --table docs/smollm2-experiment.md \\
        --plot docs/figures/smollm2-experiment.png

Each run is ``trainer/run.py`` in its own process (one engine per process), named
``<name>/<variant>-seed<k>`` under ``run.output_dir``. A seed fixes the prompts of every
step (drawn from (seed, step)), so the variants of a seed train on the same prompts.
Finished runs are reused and unfinished ones resumed, so an interrupted comparison picks
up where it stopped. The PNG (``<name>/comparison.png`` unless ``--plot``) shows the training reward and, where the
task has a held-out set (eval.every > 0), the held-out greedy accuracy of each level
(otherwise the training accuracy per level): the mean over seeds with the min-max band.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.metrics_log import read_metrics  # noqa: E402

VARIANTS = {
    "GRPO": ["algorithm.hadw=false"],
    "GRPO+HA-DW (kalman)": ["algorithm.hadw=true", "algorithm.anchor_preset=kalman"],
    "GRPO+HA-DW (authors)": ["algorithm.hadw=true", "algorithm.anchor_preset=authors_code"],
}


def run_name(name: str, label: str, seed: int) -> str:
    slug = label.lower().replace("+", "-").replace(" (", "-").replace(")", "").replace("'", "")
    return f"{name}/{slug}-seed{seed}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="rollout batches per run (default: the config's)")
    parser.add_argument("--config", help="a YAML config for every run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--name", default="compare", help="directory under run.output_dir (default compare)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="LABEL",
                        help=f"which of {list(VARIANTS)} (default all)")
    parser.add_argument("--table", type=Path, help="also write the results as markdown to this file")
    parser.add_argument("--plot", type=Path, help="where the PNG goes (default <run.output_dir>/<name>/comparison.png)")
    args = parser.parse_args(argv)

    shared = list(args.overrides) + ["run.plot=false"]
    if args.steps is not None:
        shared.append(f"train.steps={args.steps}")
    base = load_config(args.config, shared)
    output = Path(base.run.output_dir)
    runs: dict[str, list[dict]] = {}
    started = time.perf_counter()
    total = len(args.variants) * len(args.seeds)
    for label in args.variants:
        runs[label] = []
        for seed in args.seeds:
            name = run_name(args.name, label, seed)
            rows = read_metrics(output / name / "metrics.jsonl")
            if not rows or rows[-1]["step"] < base.train.steps:
                command = [sys.executable, str(Path(__file__).with_name("run.py"))]
                if args.config:
                    command += ["--config", args.config]
                overrides = shared + VARIANTS[label] + [f"train.seed={seed}", f"run.name={name}"]
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

    from trainer.plotting import plot_comparison

    path = args.plot or output / args.name / "comparison.png"
    title = f"{base.model.path or 'tiny model'}, {base.data.task} task, {len(args.seeds)} seeds, {base.train.steps} steps"
    plot_comparison(runs, path, title)
    table = results_table(runs, base.train.steps)
    print(table)
    if args.table is not None:
        command = "python trainer/compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.table.write_text(
            f"# {title}\n\nWritten by `{command}` ({time.perf_counter() - started:.0f} s for the runs this call "
            f"made). Plot: `{path}`.\n\n{table}\n"
        )
        print(f"table: {args.table}")
    print(f"plot: {path}")
    return 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def results_table(runs: dict[str, list[dict]], steps: int) -> str:
    """Per variant: the held-out accuracy per level at the start and the end (mean over
    seeds, each seed's value after it), the training reward over the last fifth of the
    steps, and the wall time of a run."""
    last = max(1, steps // 5)
    first = next(iter(runs.values()))[0]
    levels = [key.split("/", 1)[1] for key in first["eval"][0] if key.startswith("eval/")] if first["eval"] else []
    header = ["variant"] + [f"held-out {level}: start -> end" for level in levels]
    header += [f"train reward, last {last} steps", "minutes a run"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for label, seeds in runs.items():
        cells = [label]
        for level in levels:
            start = [seed["eval"][0][f"eval/{level}"] for seed in seeds]
            end = [seed["eval"][-1][f"eval/{level}"] for seed in seeds]
            cells.append(f"{_mean(start):.2f} -> {_mean(end):.2f} ({', '.join(f'{v:.2f}' for v in end)})")
        rewards = [_mean([row["reward/mean"] for row in seed["metrics"][-last:]]) for seed in seeds]
        cells.append(f"{_mean(rewards):.3f} ({', '.join(f'{v:.3f}' for v in rewards)})")
        minutes = [(sum(row["time/step"] for row in seed["metrics"])
                    + sum(row["time/eval"] for row in seed["eval"])) / 60 for seed in seeds]
        cells.append(f"{_mean(minutes):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
