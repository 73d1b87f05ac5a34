"""A sweep's per-seed results as a small data file beside the docs, and the docs' tables
from that file alone, so a reader can recompute every mean and interval.

    python -m trainer.tools.sweep_data extract /work/runs-estimators/estimators-sweep \\
        --out docs/data/estimators-sweep.csv
    python -m trainer.tools.sweep_data tables docs/data/estimators-sweep.csv
    python -m trainer.tools.sweep_data tables docs/data/estimators-sweep.csv --differences --baseline Dr.GRPO
    python -m trainer.tools.sweep_data recommend docs/data/estimators-sweep.csv
    python -m trainer.tools.sweep_data refresh docs/estimators.md      # every quoted table, from its command

``extract`` reads every finished run under ``ROOT/<task>/<key>-<value>/<variant>-seed<k>/``
(compare.py's layout for ``--name <sweep>/<task> --sweep rollout.group_size=...``), or
under ``ROOT/<key>-<value>/<variant>-seed<k>/`` (one task: ROOT's name is its name): one
row per run with its task (the directory), its prompt pool, G, arm, seed and steps, then
compare.py's figures over the last fifth of its steps (the training reward, each level's
training accuracy, the entropy), the held-out greedy accuracy of each level at its end
where it was evaluated, and its fingerprint (compare.py: the SHA-256 of the settings it
ran). An unfinished run is left out. ``tables`` prints, per task, G and arm, the mean over
the seeds [95% t interval] (trainer/tools/intervals.py) of each figure; with
``--differences``, each arm minus ``--baseline`` on the seeds both ran (paired: a seed
fixes the initial weights and the prompts). ``recommend`` prints, per task and G, the arm
to use: the one whose reward exceeds the baseline's by the most with its paired
95% interval above 0, else the baseline (the README's table). ``refresh`` rewrites, in a
markdown file, each table that follows a fenced ``python -m trainer.tools.sweep_data
tables ...`` (or ``recommend ...``) command with that command's output (paths from the
repository's root), so the docs follow the data file.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import shlex
import sys
from pathlib import Path

from hadw_kernels.tools.cli import HelpFormatter, summary
from trainer.config import load_config
from trainer.engine.metrics_log import read_metrics
from trainer.tools.compare import VARIANTS, final_window, fingerprint, run_name, window_mean
from trainer.tools.intervals import format_interval, mean_interval

KEYS = ["task", "prompt_pool", "group_size", "arm", "seed", "steps"]
# Digits a figure keeps in the file: more than the tables' three, so that they round as
# the runs' own values would.
DIGITS = 6
_RUN = re.compile(r"^(?P<slug>.+)-seed(?P<seed>\d+)$")


def arm_of(slug: str) -> str | None:
    """The variant whose run directory is ``<slug>-seed<k>`` (compare.run_name's slug)."""
    for label in VARIANTS:
        if run_name("x", label, 0) == f"x/{slug}-seed0":
            return label
    return None


def extract(root: Path) -> list[dict]:
    """One row per finished run under ``root`` (module docstring), ordered by task, G,
    arm (compare.py's order) and seed."""
    rows = []
    for config_path in sorted([*root.glob("*/*/config.yaml"), *root.glob("*/*/*/config.yaml")]):
        run_dir = config_path.parent
        match = _RUN.match(run_dir.name)
        arm = arm_of(match["slug"]) if match else None
        if arm is None:
            continue
        config = load_config(config_path)
        for setting in VARIANTS[arm]:
            key, _, value = setting.partition("=")
            section, name = key.split(".")
            ran = getattr(getattr(config, section), name)
            if ran != getattr(getattr(load_config(None, [setting]), section), name):
                raise ValueError(f"{run_dir} is named for {arm}, whose {setting} it did not run (it ran {ran!r})")
        metrics = read_metrics(run_dir / "metrics.jsonl")
        steps = config.train.steps
        if not metrics or metrics[-1]["step"] < steps:
            continue  # unfinished: its last steps are not yet the last fifth of the run
        window = final_window(metrics, steps)
        row = {"task": run_dir.parent.parent.name, "prompt_pool": config.data.prompt_pool,
               "group_size": config.rollout.group_size, "arm": arm, "seed": config.train.seed, "steps": steps,
               "reward": round(window_mean(window, "reward/mean"), DIGITS)}
        for key in [key for key in metrics[0] if key.startswith("acc/")]:
            row[key.replace("/", "_")] = round(window_mean(window, key), DIGITS)
        row["entropy"] = round(window_mean(window, "entropy_mean"), DIGITS)
        evaluations = read_metrics(run_dir / "eval.jsonl")
        for key, value in (evaluations[-1].items() if evaluations else ()):
            if key.startswith("eval/"):
                row[key.replace("/", "_")] = round(value, DIGITS)
        row["fingerprint"] = fingerprint(config)["sha256"][:16]
        rows.append(row)
    order = {label: index for index, label in enumerate(VARIANTS)}
    return sorted(rows, key=lambda row: (row["task"], row["group_size"], order[row["arm"]], row["seed"]))


def write_rows(rows: list[dict], path: Path) -> None:
    """The rows as CSV: the keys, then every figure any row has (the levels' in the order
    first met); a figure a run lacks is left empty."""
    columns = list(KEYS)
    for row in rows:
        columns += [key for key in row if key not in columns and key != "fingerprint"]
    columns.append("fingerprint")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def read_rows(path: Path) -> list[dict]:
    """The CSV's rows, its numbers as numbers (an empty figure: nan)."""
    rows = []
    with path.open(newline="") as handle:
        for raw in csv.DictReader(handle):
            row = {}
            for key, value in raw.items():
                if key in ("task", "arm", "fingerprint"):
                    row[key] = value
                elif key in ("prompt_pool", "group_size", "seed", "steps"):
                    row[key] = int(value)
                else:
                    row[key] = float(value) if value != "" else math.nan
            rows.append(row)
    return rows


def figures_of(rows: list[dict]) -> list[str]:
    """The figure columns the tables show: the reward, each level's training accuracy,
    then each level's held-out accuracy."""
    columns = list(rows[0]) if rows else []
    return (["reward"] + [key for key in columns if key.startswith("acc_")]
            + [key for key in columns if key.startswith("eval_")])


def _name(column: str) -> str:
    return column.split("_", 1)[1] + (" (held-out)" if column.startswith("eval_") else "") if "_" in column else column


def _cells(rows: list[dict]) -> list[tuple]:
    """(task, G, arm) in the file's order."""
    seen = []
    for row in rows:
        cell = (row["task"], row["group_size"], row["arm"])
        if cell not in seen:
            seen.append(cell)
    return seen


def means_table(rows: list[dict]) -> str:
    """Per task, G and arm: the seeds, then each figure's mean over them [95% t interval]."""
    figures = figures_of(rows)
    lines = ["| " + " | ".join(["task", "G", "arm", "seeds"] + [_name(figure) for figure in figures]) + " |",
             "|" + " --- |" * (4 + len(figures))]
    for task, group_size, arm in _cells(rows):
        chosen = [row for row in rows if (row["task"], row["group_size"], row["arm"]) == (task, group_size, arm)]
        cells = [task, str(group_size), arm, str(len(chosen))]
        cells += [format_interval(*mean_interval([row[figure] for row in chosen])) for figure in figures]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def differences_table(rows: list[dict], baseline: str) -> str:
    """Per task and G, each other arm minus ``baseline`` on the seeds both ran: the pairs,
    then each figure's mean difference [95% t interval]."""
    figures = figures_of(rows)
    lines = ["| " + " | ".join(["task", "G", "difference", "pairs"] + [_name(figure) for figure in figures]) + " |",
             "|" + " --- |" * (4 + len(figures))]
    for task, group_size, arm in _cells(rows):
        if arm == baseline:
            continue
        differences = {figure: paired_differences(rows, task, group_size, arm, baseline, figure) for figure in figures}
        pairs = len(differences["reward"])
        if not pairs:
            continue
        cells = [task, str(group_size), f"{arm} - {baseline}", str(pairs)]
        cells += [format_interval(*mean_interval(differences[figure]), signed=True) for figure in figures]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The group sizes the sweep runs (scripts/estimators_sweep.sh): each has a row of the
# recommendation per task, measured or not yet.
SWEPT_GROUP_SIZES = (2, 4, 8, 16)


def paired_differences(rows: list[dict], task: str, group_size: int, arm: str, baseline: str,
                       figure: str = "reward") -> list[float]:
    """``arm``'s ``figure`` minus ``baseline``'s on each seed both ran, in seed order."""
    of = {row["seed"]: row[figure] for row in rows if (row["task"], row["group_size"], row["arm"]) ==
          (task, group_size, arm)}
    base = {row["seed"]: row[figure] for row in rows if (row["task"], row["group_size"], row["arm"]) ==
            (task, group_size, baseline)}
    return [of[seed] - base[seed] for seed in sorted(set(of) & set(base))]


def recommendation_table(rows: list[dict], baseline: str = "GRPO") -> str:
    """Per task and G (every swept G, and any other the file holds): the arm to use, by
    the training reward over the last 40 steps minus ``baseline``'s paired by seed: of the
    arms whose 95% t interval lies above 0, the one with the largest mean difference (an
    arm of larger mean but an interval across 0 does not displace it), else ``baseline``;
    beside it that difference (or, where the baseline stays, the best other arm's by
    mean), and the pairs. Where no arm has two seeds paired with ``baseline`` yet, the
    baseline stays, beside how many it has."""
    lines = ["| task | G | use | reward minus " + baseline + ", last 40 steps [95% interval] | seeds |",
             "| --- | --- | --- | --- | --- |"]
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    for task in tasks:
        measured = {row["group_size"] for row in rows if row["task"] == task}
        for group_size in sorted(measured | set(SWEPT_GROUP_SIZES)):
            arms = [arm for cell_task, size, arm in _cells(rows) if (cell_task, size) == (task, group_size)
                    and arm != baseline]
            paired = [(arm, paired_differences(rows, task, group_size, arm, baseline)) for arm in arms]
            scored = [(mean_interval(differences), arm, len(differences))
                      for arm, differences in paired if len(differences) >= 2]
            if not scored:
                pairs = max((len(differences) for _, differences in paired), default=0)
                against = "not yet run" if pairs == 0 else f"{pairs} paired seed: no interval yet"
                lines.append(f"| {task} | {group_size} | {baseline} (the default) | {against} | {pairs} |")
                continue
            clear = [item for item in scored if item[0][0] - item[0][1] > 0]
            (mean, half_width), arm, pairs = max(clear or scored, key=lambda item: item[0][0])
            use = arm if clear else f"{baseline} (no arm clear of it)"
            against = f"{arm}: {format_interval(mean, half_width, signed=True)}"
            lines.append(f"| {task} | {group_size} | {use} | {against} | {pairs} |")
    return "\n".join(lines)


REPO = Path(__file__).resolve().parents[2]
# A quoted table: its command in a bash block, a blank line, then the table's lines.
QUOTED = re.compile(r"(```bash\n(python -m trainer\.tools\.sweep_data (?:tables|recommend) [^\n]+)\n```\n\n)"
                    r"((?:\|[^\n]*\n)+)")


def table_of(arguments: list[str]) -> str:
    """What the command line ``arguments`` (tables or recommend, then theirs) print, the
    data file's path read from the repository's root."""
    return _table(_parser().parse_args(arguments), REPO)


def _table(args: argparse.Namespace, root: Path) -> str:
    rows = read_rows(root / args.data)
    if args.command == "recommend":
        return recommendation_table(rows, args.baseline)
    if args.arms:
        shown = set(args.arms) | ({args.baseline} if args.differences else set())
        rows = [row for row in rows if row["arm"] in shown]
    return differences_table(rows, args.baseline) if args.differences else means_table(rows)


def refresh(text: str) -> str:
    """``text`` with each quoted table replaced by its command's output."""
    return QUOTED.sub(lambda match: match[1] + table_of(shlex.split(match[2])[3:]) + "\n", text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=summary(__doc__), formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    extracting = commands.add_parser("extract", help="the finished runs under ROOT into a CSV")
    extracting.add_argument("root", type=Path, help="the sweep's directory (ROOT/<task>/<key>-<value>/<run>)")
    extracting.add_argument("--out", type=Path, required=True, help="the CSV to write")
    tabling = commands.add_parser("tables", help="the markdown tables of a CSV")
    tabling.add_argument("data", type=Path, help="a CSV that extract wrote")
    tabling.add_argument("--differences", action="store_true", help="each arm minus --baseline on the same seeds")
    tabling.add_argument("--baseline", default="GRPO", choices=list(VARIANTS), metavar="ARM",
                         help="the arm the differences are from (default: GRPO)")
    tabling.add_argument("--arms", nargs="+", choices=list(VARIANTS), metavar="ARM",
                         help="only these arms' rows (default: every arm)")
    recommending = commands.add_parser("recommend", help="the arm to use per task and G, as the README's table")
    recommending.add_argument("data", type=Path, help="a CSV that extract wrote")
    recommending.add_argument("--baseline", default="GRPO", choices=list(VARIANTS), metavar="ARM",
                              help="the arm to beat (default: GRPO)")
    refreshing = commands.add_parser("refresh", help="rewrite a markdown file's quoted tables from their commands")
    refreshing.add_argument("doc", type=Path, help="the markdown file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "refresh":
        args.doc.write_text(refresh(args.doc.read_text()))
        print(f"tables of {args.doc} rewritten from {REPO}")
        return 0
    if args.command == "extract":
        rows = extract(args.root)
        write_rows(rows, args.out)
        print(f"{len(rows)} finished runs -> {args.out}")
        return 0
    print(_table(args, Path.cwd()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
