"""GRPO against GRPO+HA-DW on the synthetic task, same seeds, side-by-side curves.

    python trainer/compare.py                       # 3 seeds each, the CPU default otherwise
    python trainer/compare.py --seeds 0 1 --steps 80 --set rollout.engine=hf

Each run is ``trainer/run.py`` in its own process (one engine per process), named
``compare/<label>-seed<k>`` under ``run.output_dir``; finished runs are reused, so an
interrupted comparison picks up where it stopped. The plot is ``compare/comparison.png``:
mean over seeds with the min-max band, for the reward and each level's accuracy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.metrics_log import read_metrics  # noqa: E402

VARIANTS = {"GRPO": ["algorithm.hadw=false"], "GRPO+HA-DW": ["algorithm.hadw=true"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="rollout batches per run (default: the config's)")
    parser.add_argument("--config", help="a YAML config for every run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)

    shared = list(args.overrides) + ["run.plot=false"]
    if args.steps is not None:
        shared.append(f"train.steps={args.steps}")
    base = load_config(args.config, shared)
    root = Path(base.run.output_dir) / "compare"
    runs: dict[str, list[list[dict]]] = {}
    for label, variant in VARIANTS.items():
        runs[label] = []
        for seed in args.seeds:
            name = f"compare/{label.lower().replace('+', '-')}-seed{seed}"
            overrides = shared + variant + [f"train.seed={seed}", f"run.name={name}"]
            metrics = Path(base.run.output_dir) / name / "metrics.jsonl"
            rows = read_metrics(metrics)
            if not rows or rows[-1]["step"] < base.train.steps:
                command = [sys.executable, str(Path(__file__).with_name("run.py"))]
                if args.config:
                    command += ["--config", args.config]
                command += [arg for override in overrides for arg in ("--set", override)] + ["--resume"]
                print(f"== {label}, seed {seed}: {' '.join(command[2:])}", flush=True)
                subprocess.run(command, check=True)
                rows = read_metrics(metrics)
            runs[label].append(rows)
            print(f"   {label} seed {seed}: reward {rows[0]['reward/mean']:.3f} -> {rows[-1]['reward/mean']:.3f}")

    from trainer.plotting import plot_comparison

    path = root / "comparison.png"
    plot_comparison(runs, path, f"synthetic task, {len(args.seeds)} seeds, {base.train.steps} steps")
    last = max(1, base.train.steps // 5)
    for label, seeds in runs.items():
        finals = [sum(r["reward/mean"] for r in rows[-last:]) / len(rows[-last:]) for rows in seeds]
        print(f"{label}: mean reward over the last {last} steps, per seed: "
              + ", ".join(f"{value:.3f}" for value in finals))
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
