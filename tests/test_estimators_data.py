"""docs/estimators.md's sweep tables from the per-seed data file beside them
(docs/data/estimators-sweep.csv): each table is the output of the command written above
it, and each of its means and 95% t intervals is recomputed here from the file's rows;
and trainer/tools/sweep_data.py's extraction of finished runs."""

import contextlib
import io
import json
import math
import re
import shlex
import statistics
from pathlib import Path

import pytest

pytest.importorskip("yaml", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

from trainer.tools.intervals import t_critical
from trainer.tools.sweep_data import (
    SWEPT_GROUP_SIZES,
    extract,
    main,
    read_rows,
    recommendation_table,
    refresh,
    write_rows,
)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "estimators.md"
README = REPO / "README.md"
COMMAND = re.compile(r"```bash\n(python -m trainer\.tools\.sweep_data tables [^\n]+)\n```\n\n((?:\|[^\n]*\n)+)")


def _documented_tables() -> list[tuple[list[str], str]]:
    return [(shlex.split(command)[4:], table.rstrip("\n")) for command, table in COMMAND.findall(DOC.read_text())]


def _interval(values: list[float], signed: bool = False) -> str:
    """The mean [95% t interval] as the tables print it, computed here from first principles."""
    values = [value for value in values if not math.isnan(value)]
    mean = statistics.fmean(values)
    sign = "+" if signed else ""
    if len(values) < 2:
        return f"{mean:{sign}.3f}"
    half = t_critical(0.95, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:{sign}.3f} [{mean - half:{sign}.3f}, {mean + half:{sign}.3f}]"


def test_each_table_is_its_command_s_output():
    assert _documented_tables(), "docs/estimators.md quotes no sweep_data table"
    text = DOC.read_text()
    assert refresh(text) == text, "a table differs from its command's output: python -m trainer.tools.sweep_data refresh"


def test_each_mean_and_interval_is_recomputed_from_the_data_file():
    checked = 0
    for arguments, table in _documented_tables():
        rows = read_rows(REPO / arguments[0])
        header, _, *lines = table.splitlines()
        names = [cell.strip() for cell in header.strip("|").split("|")]
        for line in lines:
            cells = dict(zip(names, (cell.strip() for cell in line.strip("|").split("|"))))
            chosen = [row for row in rows if row["task"] == cells["task"] and row["group_size"] == int(cells["G"])]
            if "difference" in cells:
                arm, baseline = cells["difference"].split(" - ")
                of = {row["seed"]: row for row in chosen if row["arm"] == arm}
                base = {row["seed"]: row for row in chosen if row["arm"] == baseline}
                seeds = sorted(set(of) & set(base))
                assert int(cells["pairs"]) == len(seeds)
                values = {name: [of[seed][name] - base[seed][name] for seed in seeds] for name in rows[0]
                          if name not in ("task", "arm", "fingerprint")}
                signed = True
            else:
                chosen = [row for row in chosen if row["arm"] == cells["arm"]]
                assert int(cells["seeds"]) == len(chosen)
                values = {name: [row[name] for row in chosen] for name in rows[0] if name not in ("task", "arm",
                                                                                                 "fingerprint")}
                signed = False
            for name, shown in cells.items():
                column = {"reward": "reward"}.get(name) or (
                    f"eval_{name.removesuffix(' (held-out)')}" if name.endswith("(held-out)") else f"acc_{name}")
                if column in values:
                    assert shown == _interval(values[column], signed), (line, name)
                    checked += 1
    assert checked > 0


def _run(directory: Path, overrides: list[str], reward: float, steps: int = 10, finished: bool = True) -> None:
    """A run as the trainer leaves it: its resolved config.yaml and its metrics."""
    from trainer.config import load_config, save_config

    directory.mkdir(parents=True)
    save_config(load_config(None, overrides + [f"train.steps={steps}"]), directory / "config.yaml")
    last = steps if finished else steps - 3
    rows = [{"step": s, "reward/mean": reward if s > 8 else 0.0, "acc/copy": 1.0, "acc/add": None if s == 10 else 0.5,
             "entropy_mean": 0.4} for s in range(1, last + 1)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_extract_takes_each_finished_run_s_last_fifth(tmp_path):
    root = tmp_path / "sweep"
    _run(root / "recurring/group_size-2/grpo-seed0", ["rollout.group_size=2", "algorithm.hadw=false"], 0.5)
    _run(root / "recurring/group_size-2/dr.grpo-seed1", ["rollout.group_size=2", "algorithm.hadw=false",
                                                          "algorithm.normalize_std=false", "train.seed=1"], 0.25)
    _run(root / "rare/group_size-4/prompt-history-phi-seed0", ["rollout.group_size=4", "data.prompt_pool=50",
                                                               "algorithm.advantage_estimator=prompt_history",
                                                               "algorithm.hadw=true"], 0.75)
    _run(root / "rare/group_size-4/grpo-seed3", ["rollout.group_size=4", "algorithm.hadw=false"], 0.9, finished=False)
    rows = extract(root)
    assert [(row["task"], row["group_size"], row["arm"], row["seed"], row["prompt_pool"]) for row in rows] == [
        ("rare", 4, "prompt history+Phi", 0, 50), ("recurring", 2, "GRPO", 0, 0), ("recurring", 2, "Dr.GRPO", 1, 0)]
    # the last fifth of 10 steps: steps 9 and 10; add logged at step 9 alone
    assert rows[1]["reward"] == 0.5 and rows[1]["acc_add"] == 0.5 and rows[1]["acc_copy"] == 1.0
    assert len(rows[0]["fingerprint"]) == 16
    write_rows(rows, tmp_path / "data.csv")
    back = read_rows(tmp_path / "data.csv")
    assert back == rows
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["tables", str(tmp_path / "data.csv"), "--differences", "--baseline", "Dr.GRPO"])
    assert len(printed.getvalue().splitlines()) == 2  # seeds 0 and 1 make no pair: the header alone
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["tables", str(tmp_path / "data.csv"), "--arms", "Dr.GRPO", "prompt history+Phi"])
    assert [line.split(" | ")[2] for line in printed.getvalue().splitlines()[2:]] == ["prompt history+Phi", "Dr.GRPO"]


def test_extract_reads_one_task_s_sweep_and_its_held_out_accuracy(tmp_path):
    """A compare.py sweep of one task (ROOT/<key>-<value>/<run>): ROOT's name is the task,
    and each level's held-out accuracy at the run's end is a column."""
    run_dir = tmp_path / "estimators-smollm2" / "group_size-4" / "grpo-seed2"
    _run(run_dir, ["rollout.group_size=4", "algorithm.hadw=false", "train.seed=2"], 0.5)
    evaluations = [{"step": 0, "eval/plus": 0.5, "eval/two-digit": 0.1}, {"step": 10, "eval/plus": 0.75,
                                                                          "eval/two-digit": 0.25}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in evaluations))
    (row,) = extract(tmp_path / "estimators-smollm2")
    assert (row["task"], row["group_size"], row["seed"]) == ("estimators-smollm2", 4, 2)
    assert (row["eval_plus"], row["eval_two-digit"]) == (0.75, 0.25)


def test_a_run_whose_settings_are_not_its_arm_s_is_refused(tmp_path):
    """The arm is read from the directory's name; the run's config must hold that arm's
    settings, or its figures would be quoted under another arm's name."""
    _run(tmp_path / "sweep/recurring/group_size-2/dr.grpo-seed0", ["rollout.group_size=2", "algorithm.hadw=false"], 0.5)
    with pytest.raises(ValueError, match=r"dr.grpo-seed0 is named for Dr.GRPO, whose algorithm.normalize_std=false "
                                         r"it did not run \(it ran None\)"):
        extract(tmp_path / "sweep")


def _low(shown: str) -> float:
    return float(shown.split("[")[1].split(",")[0]) if "[" in shown else math.nan


def test_the_recommendation_takes_the_best_arm_clear_of_grpo_not_the_best_mean():
    """An arm of larger mean difference but an interval across 0 does not hide an arm
    that is clear of GRPO; where none is clear, GRPO stays beside the best mean; every
    swept G has a row per task, run or not, and one seed makes no interval."""
    gains = {"noisy": [0.5, -0.3, 0.4, -0.2], "steady": [0.05, 0.06, 0.04, 0.05], "worse": [-0.1, -0.1, -0.2, -0.1]}
    rows = [dict(task="t", group_size=2, arm="GRPO", seed=seed, reward=0.3) for seed in range(4)]
    rows += [dict(task="t", group_size=2, arm=arm, seed=seed, reward=0.3 + gain)
             for arm, values in gains.items() for seed, gain in enumerate(values)]
    rows += [dict(row, task="u") for row in rows if row["arm"] != "steady"]
    rows += [dict(task="u", group_size=4, arm=arm, seed=0, reward=0.5) for arm in ("GRPO", "noisy")]
    table = recommendation_table(rows).splitlines()[2:]
    assert table[0].startswith("| t | 2 | steady | steady: +0.050 [")
    assert table[1:4] == [f"| t | {size} | GRPO (the default) | not yet run | 0 |" for size in (4, 8, 16)]
    assert table[4].startswith("| u | 2 | GRPO (no arm clear of it) | noisy: +0.100 [")
    assert table[5] == "| u | 4 | GRPO (the default) | 1 paired seed: no interval yet | 1 |"
    assert len(table) == 8


def test_the_readme_s_recommendation_is_the_data_file_s():
    """The README's estimator table is ``sweep_data recommend``'s output on the data file,
    and each row's difference is recomputed here: that arm's reward minus GRPO's on the
    seeds both ran; where the row recommends it, its interval above 0 and no other such
    arm's mean difference above it; where GRPO stays, no arm's interval above 0 and the
    arm shown the one of largest mean difference."""
    text = README.read_text()
    block = text.split("<!-- estimator-recommendation:start -->", 1)[1].split("<!-- estimator-recommendation:end -->")[0]
    assert "sweep_data recommend docs/data/estimators-sweep.csv" in block
    assert refresh(text) == text, "the README's table differs from its command's output"
    rows = read_rows(REPO / "docs" / "data" / "estimators-sweep.csv")
    lines = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith(("| task", "| ---"))]
    shown_cells = set()

    def arms_of(task, size):
        return {row["arm"] for row in rows if (row["task"], row["group_size"]) == (task, size)}

    for line in lines:
        task, size, use, against, pairs = (cell.strip() for cell in line.strip("|").split("|"))

        def differences(name, task=task, size=size):
            of = {row["seed"]: row["reward"] for row in rows
                  if (row["task"], row["group_size"], row["arm"]) == (task, int(size), name)}
            base = {row["seed"]: row["reward"] for row in rows
                    if (row["task"], row["group_size"], row["arm"]) == (task, int(size), "GRPO")}
            return [of[seed] - base[seed] for seed in sorted(set(of) & set(base))]

        if against == "not yet run" or against.endswith("no interval yet"):
            # no arm has two seeds paired with GRPO's: GRPO stays, beside the most pairs any arm has
            most = max((len(differences(arm)) for arm in arms_of(task, int(size)) - {"GRPO"}), default=0)
            assert most < 2 and int(pairs) == most and use == "GRPO (the default)"
            assert against == ("not yet run" if most == 0 else f"{most} paired seed: no interval yet")
            shown_cells.add((task, int(size)))
            continue
        arm, shown = against.split(": ")
        values = differences(arm)
        assert shown == _interval(values, signed=True) and int(pairs) == len(values)
        others = {other for other in arms_of(task, int(size)) - {"GRPO"} if len(differences(other)) >= 2}
        clear = {other for other in others if _low(_interval(differences(other), signed=True)) > 0}
        if use == arm:
            assert arm in clear
            assert all(statistics.fmean(differences(other)) <= statistics.fmean(values) for other in clear)
        else:
            assert use.startswith("GRPO") and not clear
            assert all(statistics.fmean(differences(other)) <= statistics.fmean(values) for other in others)
        shown_cells.add((task, int(size)))
    tasks = {row["task"] for row in rows}
    sizes = set(SWEPT_GROUP_SIZES) | {row["group_size"] for row in rows}
    assert shown_cells == {(task, size) for task in tasks for size in sizes} and len(lines) == len(shown_cells)
