"""Measured figures are quoted from one place, the measurement log (docs/results/, a page a
day): the README's and docs/trainer.md's opening figures of the CPU default run are those of
the log's table of the trainer's layouts (its shared-prompt column, the layout that run
used), the README's sweep over G and estimators' evidence are their pages' tables and those
tables compare.py's output (which the log keeps whole), the README's CPU benchmark, GPU loss
step and the TRL drop-in's layout ratios (README and docs/integrations/trl.md) are the log's
tables, and the code's comments quote none (docs/ holds them)."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def log_section(date: str, title: str) -> str:
    """The text of the log's section ``## title`` of ``date``'s page, up to the next ``## ``."""
    return (RESULTS / f"{date}.md").read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def table_cell(text: str, row: str) -> str:
    """The shared-prompt (last) cell of the CPU default table's row starting ``row``."""
    table = text.split("| CPU default, 200 steps | padded | packed | shared prompt |", 1)[1].split("\n\n", 1)[0]
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {row} ")]
    return line.strip("| ").split(" | ")[-1]


def test_the_cpu_default_figures_are_the_table_s():
    table = log_section("2026-11-26", "The trainer's layouts on the CPU default")
    trainer = (ROOT / "docs" / "trainer.md").read_text()
    fastest = table_cell(table, "wall time").split("-")[0]  # "1 min 21 s" of "1 min 21 s-1 min 22 s"
    reward_row = next(line for line in table.splitlines() if line.startswith("| mean reward, last 40 steps"))
    first = float(re.search(r"first step (\d\.\d+)", reward_row).group(1))
    last = float(reward_row.strip("| ").split(" | ")[-1])
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"2 cores: {fastest}; mean reward {first:.2f} at the first step, {last:.2f} over the last 40" in readme
    assert "shared-prompt layout" in readme  # the layout it was measured in, no longer the default
    trainer = " ".join(trainer.split())
    assert f"It finished in {fastest} on 2 cores" in trainer
    assert f"the mean reward going from {first:.2f} at the first step to {last:.2f} over the last 40" in trainer


# The log's sections that keep trainer/tools/compare.py's output whole, one an evidence page.
HADW_OUTPUT = ("2026-11-28", "Appendix: compare.py's output, whole (HA-DW over G)")
ESTIMATORS_OUTPUT = ("2026-12-02", "Appendix: compare.py's output, whole (estimators)")


def test_the_readme_s_hadw_evidence_is_the_sweep_table_s():
    """The README's result of the sweep over G quotes docs/hadw-evidence.md's table of
    HA-DW minus GRPO (the reward over the last 40 steps, 95% interval) at every G, and the
    page's rows are those compare.py wrote (the log keeps its output whole)."""
    evidence, output = (ROOT / "docs" / "hadw-evidence.md").read_text(), log_section(*HADW_OUTPUT)
    rows = re.findall(r"^\| (\d+) \| GRPO\+HA-DW \(kalman\) - GRPO \| ([^|]+) \|", evidence, re.M)
    assert [size for size, _ in rows] == ["2", "4", "8", "16"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    for size, reward in rows:
        assert f"{reward.strip()} at G = {size}" in readme, (size, reward)
    assert "(docs/hadw-evidence.md)" in readme
    # and the page's tables are compare.py's output, which its appendix holds whole
    table_rows = [line for line in evidence.splitlines() if line.startswith("| 2 | ") or " at 8 - GRPO at 16 |" in line]
    assert table_rows and all(line in output.splitlines() for line in table_rows)


def test_the_trl_layout_figures_are_the_benchmark_table_s():
    """The README's and docs/integrations/trl.md's step-time ratios of the TRL drop-in are
    those of the log's table ("The TRL drop-in's layouts", its "x stock" column)."""
    table = log_section("2026-11-28", "The TRL drop-in's layouts")

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
    # The whole step with generation: a user's report, quoted from the page that labels it.
    report = log_section("2026-12-02", "A user's whole TRL step, with generation")
    whole = re.search(r"step took \*\*(\d\.\d+)x of stock TRL's with generation counted", " ".join(report.split()))
    assert f"a user's whole step with generation on a 300-token preamble at G = 8 took {whole.group(1)}x" in readme


# Measured figures live in docs/, never in the code's comments: a timing, a size, a ratio
# or a share quoted in a comment is copied from a measurement that the docs re-measure,
# and goes stale there unseen. A comment says why and names the doc that holds the figure.
CODE_DIRS = ("hadw_kernels", "csrc", "trainer", "bench")
MEASURED_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?"  # a number (the end of a range such as 3-6 too)
    r"(?:\s?(?:ns|us|µs|ms|s|sec|seconds?|min|minutes?|hours?|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"  # time, memory
    r"|x(?!\w)"  # a ratio, 1.6x (not "2 x 3", a shape)
    r"|%)"  # a share
)
# What the pattern matches and is no measurement: statistics' confidence levels, tolerances.
NOT_MEASURED = re.compile(r"95% (?:t )?(?:interval|half-width)|± 95%|within \d+%|held to \d+%")
# Constants that a comment states beside their definition (a default, a buffer's budget),
# by the phrase, wherever the comment moves. Each must still be found.
CONSTANTS_STATED = {
    "CUDA (Triton): 1 GiB": "LOGITS_BUFFER_BYTES['cuda']",
    "640 MiB and at most 1024 rows": "LOGITS_BUFFER_BYTES['cpu'] and MAX_BLOCK_ROWS['cpu']",
    "4 GiB unless told otherwise": "plan.DEFAULT_OVERHEAD_GIB",
}


def python_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every docstring (module, class, function)."""
    lines = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = node.body[0] if node.body else None
            if isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant) \
                    and isinstance(docstring.value.value, str):
                lines += [(docstring.lineno + i, line) for i, line in enumerate(docstring.value.value.splitlines())]
    return lines


def c_comments(source: str) -> list[tuple[int, str]]:
    return [(source.count("\n", 0, comment.start()) + 1 + i, line)
            for comment in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S)
            for i, line in enumerate(comment.group().splitlines())]


def yaml_comments(source: str) -> list[tuple[int, str]]:
    return [(number, line.split("#", 1)[1]) for number, line in enumerate(source.splitlines(), 1) if "#" in line]


COMMENTS = {".py": python_comments, ".cpp": c_comments, ".h": c_comments, ".cu": c_comments,
            ".yaml": yaml_comments}


def code_comments():
    for directory in CODE_DIRS:
        for path in sorted((ROOT / directory).rglob("*")):
            if path.suffix in COMMENTS and path.is_file():
                for line, text in COMMENTS[path.suffix](path.read_text()):
                    yield path.relative_to(ROOT), line, text


def test_code_comments_quote_no_measured_figures():
    found, stated = [], set()
    for path, line, text in code_comments():
        for phrase in CONSTANTS_STATED:
            if phrase in text:
                stated.add(phrase)
                text = text.replace(phrase, " ")
        figures = [match.group() for match in MEASURED_FIGURE.finditer(NOT_MEASURED.sub(" ", text))]
        if figures:
            found.append(f"{path}:{line}: {figures} in {text.strip()!r}")
    assert not found, ("measured figures in code comments; move each to the doc that owns it and say why "
                       "without the number:\n" + "\n".join(found))
    assert stated == set(CONSTANTS_STATED), f"no longer in any comment: {set(CONSTANTS_STATED) - stated}"


def test_the_figure_pattern_tells_measurements_from_the_rest():
    measured = ["1.8 ms a step", "~30 ms of system time", "(0.5-1 s, paid once)", "90 us", "64-600 MiB",
                "a 1 GB parent", "30x slower", "0.95x the bound", "3-6% of a loss step", "under 10 minutes"]
    not_measured = ["M x 2 x 2", "3 x 2736 rows", "(2h)", "a 95% interval", "Mean ± 95%", "to within 10%",
                    "0x7f", "1e-8", "sm_90", "log(1e-8)", "G = 8 responses", "three rewards of 0.9"]
    for text in measured:
        assert MEASURED_FIGURE.search(NOT_MEASURED.sub(" ", text)), text
    for text in not_measured:
        assert not MEASURED_FIGURE.search(NOT_MEASURED.sub(" ", text)), text


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header line starts with ``header``."""
    table = text.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in table]


def test_the_readme_s_cpu_benchmark_is_benchmarks_md_s():
    """The README's dense on-policy table quotes the log's latest full run: each
    shape's hadw[cpp] / bound, eager, TRL and Liger against hadw[cpp]."""
    bench = log_section("2026-11-24", "CPU benchmark: the full run on the AMD EPYC").split(
        "### Dense on-policy: the first mini-batch", 1)[1]
    source = {}
    for cells in table_rows(bench, "| shape, threads | bound (ms) |"):
        shape, threads = cells[0].rsplit(", ", 1)
        ours = re.search(r"\d+\.\d+x", cells[2]).group()
        source[shape, threads.split()[0]] = [ours, cells[4], cells[5], cells[6]]
    quoted, shape = {}, None
    for cells in table_rows((ROOT / "README.md").read_text(), "| shape, threads | hadw[cpp] / bound |"):
        place, threads = cells[0].rsplit(", ", 1)
        shape = shape if place == "same" else place
        quoted[shape, threads] = cells[1:5]
    assert quoted and quoted == {key: source[key] for key in quoted}


def test_the_gpu_loss_step_quoted_is_the_log_s():
    """The README's and docs/benchmarks.md's GPU loss step quote the log's H100 table (the loss
    step of 2026-11-23): the fused path's time and ratio to the bound, and eager's ratio."""
    doc = log_section("2026-11-23", "GPU: the loss step on an H100")
    source = {cells[0]: cells[1:] for cells in table_rows(doc, "| | ms | / bound | peak above inputs |")}
    ms, to_bound, _ = source["gradients in forward"]
    eager = source["eager (materialised logits)"][1]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{ms} ms, {to_bound} the bound, eager {eager} on the H100" in readme
    bench = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert f"{ms} ms, {to_bound} the bound (eager {eager}" in bench


def test_the_estimator_page_s_earlier_sweep_is_compare_py_s_output():
    """docs/estimators.md's paired differences to GRPO of its earlier sweep (the reward over
    the last 40 steps, 95% interval) at every G are rows compare.py wrote (the log keeps
    its output whole). The README's table is the data file's (tests/test_estimators_data.py)."""
    evidence = (ROOT / "docs" / "estimators.md").read_text()
    output = log_section(*ESTIMATORS_OUTPUT).splitlines()
    rows = re.findall(r"^\| (\d+) \| (prompt history|James-Stein) - GRPO \| ([^|]+) \|", evidence, re.M)
    assert {size for size, _, _ in rows} == {"2", "4", "8"} and len(rows) == 6
    table_rows = [line for line in evidence.splitlines() if re.match(r"^\| \d+ \| (prompt history|James-Stein) - GRPO", line)]
    assert table_rows and all(line in output for line in table_rows)
