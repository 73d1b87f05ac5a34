"""Measured figures are quoted from one place: where the README or another page repeats a
figure, it is the figure of the table that holds the measurement (the CPU default run's
in docs/trainer.md, the sweep over G in docs/hadw-evidence.md, the TRL drop-in's layouts
in docs/benchmarks.md)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_cell(text: str, row: str) -> str:
    """The shared-prompt (last) cell of the CPU default table's row starting ``row``."""
    table = text.split("| CPU default, 200 steps | padded | packed | shared prompt |", 1)[1].split("\n\n", 1)[0]
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {row} ")]
    return line.strip("| ").split(" | ")[-1]


def test_the_cpu_default_figures_are_the_table_s():
    trainer = (ROOT / "docs" / "trainer.md").read_text()
    fastest = table_cell(trainer, "wall time").split("-")[0]  # "1 min 21 s" of "1 min 21 s-1 min 22 s"
    reward_row = next(line for line in trainer.splitlines() if line.startswith("| mean reward, last 40 steps"))
    first = float(re.search(r"first step (\d\.\d+)", reward_row).group(1))
    last = float(reward_row.strip("| ").split(" | ")[-1])
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"2 cores: {fastest}; mean reward {first:.2f} at the first step, {last:.2f} over the last 40" in readme
    trainer = " ".join(trainer.split())
    assert f"It finished in {fastest} on 2 cores" in trainer
    assert f"the mean reward going from {first:.2f} at the first step to {last:.2f} over the last 40" in trainer


def test_the_readme_s_hadw_evidence_is_the_sweep_table_s():
    """The README's result of the sweep over G quotes docs/hadw-evidence.md's table of
    HA-DW minus GRPO (the reward over the last 40 steps, 95% interval) at every G, and the
    page's rows are those compare.py wrote."""
    evidence = (ROOT / "docs" / "hadw-evidence.md").read_text()
    rows = re.findall(r"^\| (\d+) \| GRPO\+HA-DW \(kalman\) - GRPO \| ([^|]+) \|", evidence, re.M)
    assert [size for size, _ in rows] == ["2", "4", "8", "16"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    for size, reward in rows:
        assert f"{reward.strip()} at G = {size}" in readme, (size, reward)
    assert "(docs/hadw-evidence.md)" in readme
    # and the page's tables are compare.py's output, which docs/hadw-sweep-group-size.md holds whole
    output = (ROOT / "docs" / "hadw-sweep-group-size.md").read_text()
    table_rows = [line for line in evidence.splitlines() if line.startswith("| 2 | ") or " at 8 - GRPO at 16 |" in line]
    assert table_rows and all(line in output.splitlines() for line in table_rows)


def test_the_trl_layout_figures_are_the_benchmark_table_s():
    """The README's and docs/integrations/trl.md's step-time ratios of the TRL drop-in are
    those of docs/benchmarks.md's table ("The TRL drop-in's layouts", its "x stock" column)."""
    table = (ROOT / "docs" / "benchmarks.md").read_text().split("## The TRL drop-in's layouts", 1)[1]

    def ratio(case: str, trainer: str) -> str:
        (line,) = [line for line in table.splitlines() if line.startswith(f"| {case} | {trainer} |")]
        return line.strip("| ").split(" | ")[3]

    readme = " ".join((ROOT / "README.md").read_text().split())
    trl = " ".join((ROOT / "docs" / "integrations" / "trl.md").read_text().split())
    at_8, at_16 = ratio("long-prompt-8", "shared_prompt"), ratio("long-prompt-16", "shared_prompt")
    assert f"{at_8}x of stock TRL's time at G = 8 and {at_16}x at G = 16" in readme
    assert f"{at_8}x of stock TRL's time at G = 8 and {at_16}x at G = 16" in trl
    assert f"long-tailed completions, {ratio('long-tail', 'shared_prompt')}x, where the drop-in padded takes " \
           f"{ratio('long-tail', 'padded')}x" in trl
