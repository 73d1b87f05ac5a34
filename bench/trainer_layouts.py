"""The trainer in each layout on prompts that share a long prefix (docs/benchmarks.md, "The
trainer's layouts"): the synthetic task with ``data.exemplars`` solved problems before
every prompt (the same for every prompt of a run, a few-shot preamble), G = 8, 64-token
responses. Each run is ``python -m trainer.run`` in a fresh process (HF rollouts, so no
rollout engine's start-up), the layouts in a shuffled order each round; the figures are
the median train time a step (steps 2 onwards: the first warms up), the tokens the
layout fed the model a mini-batch (the trainer's ``fed_tokens``) and the process's peak
resident set.

    .venv/bin/python bench/trainer_layouts.py                    # 125 exemplars (about 1,000 tokens), twice
    .venv/bin/python bench/trainer_layouts.py --exemplars 8 --steps 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fresh_process import REPO_ROOT, worker_env

LAYOUTS = ("padded", "packed", "shared_prompt", "prefix_tree")


def run_trainer(layout: str, exemplars: int, steps: int, run_dir: Path) -> dict:
    """One run of the trainer; its per-step figures and its peak RSS."""
    settings = [
        f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", f"train.layout={layout}",
        f"data.exemplars={exemplars}", "rollout.engine=hf", "rollout.group_size=8", "rollout.max_new_tokens=64",
        "train.prompts_per_step=8", "train.mini_batch_prompts=8", "train.micro_batch_tokens=100000",
        f"train.steps={steps}", "run.plot=false", "run.export_hf=false", "run.checkpoint_every=1000",
    ]
    command = [sys.executable, "-m", "trainer.run", *(part for setting in settings for part in ("--set", setting))]
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, env=worker_env(threads=1), cwd=REPO_ROOT, stdout=output,
                                   stderr=subprocess.STDOUT)
        # Reaped here, not by Popen: the child's own rusage holds its peak resident set
        # (the driver's RUSAGE_CHILDREN would hold the largest child's so far).
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{layout} failed:\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"train_seconds": [row["time/train"] for row in rows], "fed_tokens": rows[-1]["fed_tokens"],
            "peak_rss_gb": usage.ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exemplars", type=int, default=125, help="solved problems before every prompt")
    parser.add_argument("--steps", type=int, default=4, help="rollout batches a run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each layout")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {LAYOUTS}")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            parser.error(f"unknown layout {name!r}")
    runs = []
    order = list(layouts)
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            random.Random(repeat).shuffle(order)
            for layout in order:
                print(f"[{repeat + 1}/{args.repeats}] {layout} ...", file=sys.stderr, flush=True)
                result = run_trainer(layout, args.exemplars, args.steps, Path(scratch) / f"{layout}-{repeat}")
                runs.append(dict(layout=layout, repeat=repeat, **result))
    if args.json:
        args.json.write_text(json.dumps({"exemplars": args.exemplars, "runs": runs}, indent=1))
    padded = [statistics.median(run["train_seconds"][1:] or run["train_seconds"]) for run in runs
              if run["layout"] == "padded"]
    print("| layout | train time a step (s), median of steps 2+ per run | x padded | fed tokens a mini-batch | "
          "peak RSS GB |")
    print("| --- | --- | ---: | ---: | ---: |")
    for layout in layouts:
        mine = [run for run in runs if run["layout"] == layout]
        times = [statistics.median(run["train_seconds"][1:] or run["train_seconds"]) for run in mine]
        ratio = f"{statistics.mean(times) / statistics.mean(padded):.2f}" if padded else ""
        peaks = ", ".join(f"{run['peak_rss_gb']:.2f}" for run in mine)
        print(f"| {layout} | {', '.join(f'{t:.2f}' for t in times)} | {ratio} | {round(mine[0]['fed_tokens'])} | "
              f"{peaks} |")


if __name__ == "__main__":
    main()
