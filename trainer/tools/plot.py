"""Draw a run's curves from its ``metrics.jsonl``: ``python -m trainer.tools.plot runs/<name>``.

A run draws ``curves.png`` when it ends; one that was killed, or is still running, has none
(or an old one). This draws it from the steps logged so far, with the run's own title
(from its ``config.yaml``), into ``curves.png`` of the run (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a file, Python puts this file's folder on the path, not the checkout that holds
# the package: the wheel installs the library only, the trainer runs from its checkout
# (docs/trainer.md).
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hadw_kernels.tools.cli import HelpFormatter, output_file, summary
from trainer.config import ConfigError, load_config
from trainer.engine.metrics_log import read_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.plot", description=summary(__doc__),
                                     formatter_class=HelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's directory (run.output_dir/run.name)")
    parser.add_argument("--out", type=output_file, default=None, help="the PNG (default: <run_dir>/curves.png)")
    args = parser.parse_args(argv)
    try:
        rows = read_metrics(args.run_dir / "metrics.jsonl")
    except ValueError as error:
        parser.error(f"argument run_dir: {error}")
    if not rows:
        parser.error(f"argument run_dir: {args.run_dir / 'metrics.jsonl'} holds no step yet")
    from trainer.engine.plotting import plot_run, run_title

    try:
        config = load_config(args.run_dir / "config.yaml")
        title = run_title(config, config.rollout.engine)  # saved resolved
    except ConfigError:  # no config.yaml (or another trainer's): the steps still plot
        title = args.run_dir.name
    path = args.out or args.run_dir / "curves.png"
    plot_run(rows, path, f"{title} (steps {rows[0]['step']}-{rows[-1]['step']})")
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
