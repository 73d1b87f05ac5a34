"""The session summary: a markdown table per input and shape, and a plot against G.

A row is a dict with the case (input, impl, shape fields, threads, dense, which of its
processes), its status and, when it ran, its times (seconds) and peaks (MB). The rows of
one case's processes are combined into one (``combine_processes``) before anything is
shown. Ratios are to the bound (the three bare GEMMs) and to the eager row of the same
input, shape, threads and kind: the physical limit and the baseline every trainer starts
from.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import matrix
from loss_impls import BASELINE, BOUND

INPUT_TITLES = {
    "hidden": "Loss from hidden states (LM head + log-probs + surrogate)",
    "logprobs": "Loss from log-probs (surrogate only)",
}
SHAPE_KEYS = ("prompts", "length", "hidden", "vocab")
CASE_KEYS = ("input", "impl", "group_size", *SHAPE_KEYS, "threads", "dense", "long_tail", "packed", "loss_type")
LEGEND = f"""\
Time: forward+backward of one loss step on the case process's own clock, min [median] over
the timed rounds (at least {matrix.FULL_ROUNDS}, more until {matrix.FULL_TIMED_SECONDS:g} s of steps \
are timed; up to {matrix.MOST_ROUNDS}).
The min leads, and the ratios and tokens/s use it: on a shared 2-core machine a step is often
preempted, and the min is the least disturbed figure.
A dense case runs each implementation in {matrix.DENSE_PROCESSES} fresh processes \
({matrix.QUICK_DENSE_PROCESSES} in the quick run),
in turns with the other implementations', each timing at least {matrix.DENSE_ROUNDS} rounds \
and {matrix.DENSE_TIMED_SECONDS:g} s: its time
is the median of the processes' mins [the median of their medians], and {{lo-hi}} the range
of the processes' mins (here a whole process can run 5-15% slow). (pytest-benchmark drives
the rounds and also times them from outside, a pipe round trip included: its own table.)
tokens/s: B*T token positions (padding included: every position is computed) / min time;
in a long-tailed case, the valid tokens / min time (its padded and packed rows share a table:
"(packed)" marks the packed ones, whose bound row is the valid tokens' three GEMMs as the
padded bound's is, and whose ratio to eager is to eager on the padded batch).
Peak alloc: the allocator's view, peak of live tensor bytes above the inputs during one step
(PyTorch profiler memory events). Peak RSS: ru_maxrss over the timed steps minus the resident
set after imports and inputs (what the warm-up left resident, e.g. compiled code, counts).
Ratios: time to the bound (three bare GEMMs on preallocated buffers, same threads, same process
kind) and to eager of the same input, shape, G, threads and kind (dense on-policy or padded);
memory ratios to eager, left out when eager's peak is under 1 MB (page-granular noise).
load: the machine's 1-minute load average when the case ended. The case's own threads
make ~1-2; well above that, other work shared the two cores and the times are inflated (most for
implementations made of thousands of small parallel ops, whose threads wait at every barrier
for a descheduled partner)."""


def combine_processes(rows: list[dict]) -> list[dict]:
    """One row per case: a case timed in several fresh processes gets the median of their
    mins and of their medians, the list of their mins (``process_mins_s``), the memory
    figures of its first process (the one with the allocator's profile) and the highest
    load; a process that failed makes the case's status."""
    by_case = defaultdict(list)
    for row in rows:
        by_case[tuple(row.get(key) for key in CASE_KEYS)].append(row)
    combined = []
    for case_rows in by_case.values():
        if len(case_rows) == 1:
            combined.append(case_rows[0])
            continue
        case_rows.sort(key=lambda r: r.get("process", 0))
        failed = [r for r in case_rows if r["status"] != "ok"]
        if len(failed) == len(case_rows):  # unavailable, untimed, or failed every time
            combined.append(failed[0])
            continue
        if failed:
            combined.append({**failed[0], "processes_failed": f"{len(failed)} of {len(case_rows)}"})
            continue
        mins = [r["time_min_s"] for r in case_rows]
        combined.append({
            **case_rows[0],
            "time_min_s": statistics.median(mins),
            "time_median_s": statistics.median(r["time_median_s"] for r in case_rows),
            "time_rounds": sum(r["time_rounds"] for r in case_rows),
            "process_mins_s": mins,
            "load_1min": max(r["load_1min"] for r in case_rows),
        })
    return combined


def _fixed_shape(row: dict) -> tuple:
    """What a table holds fixed: the shape but G, the kind of lengths, the threads (a
    long-tailed table holds both layouts)."""
    kind = "dense" if row.get("dense", False) else "long_tail" if row.get("long_tail", False) else "padded"
    return tuple(row[key] for key in SHAPE_KEYS) + (kind, row.get("threads", 2))


KIND_TITLES = {
    "dense": "dense on-policy",
    "padded": "padded",
    "long_tail": "long-tailed lengths (lognormal, mean about T/10), padded and packed",
}


def _label(row: dict) -> str:
    label = row["impl"] if row.get("loss_type", "grpo") == "grpo" else f"{row['impl']} {row['loss_type']}"
    return f"{label} (packed)" if row.get("packed") else label


def _number(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


# Below this, a peak is page-granular noise and a ratio of two of them means nothing.
SMALLEST_MEMORY_RATIO_BASE_MB = 1.0


def _megabytes(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2f}"


def _ratio(value: float | None, base: float | None, smallest_base: float = 0.0) -> str:
    if value is None or not base or base < smallest_base:
        return "—"
    return f"{value / base:.2f}x"


def _milliseconds(seconds: float) -> str:
    milliseconds = seconds * 1e3
    return f"{milliseconds:.0f}" if milliseconds >= 100 else f"{milliseconds:.3g}"


def _time_cell(row: dict) -> str:
    if row.get("time_min_s") is None:
        return "—"
    cell = f"{_milliseconds(row['time_min_s'])} [{_milliseconds(row['time_median_s'])}]"
    if row.get("process_mins_s"):
        mins = row["process_mins_s"]
        cell += f" {{{_milliseconds(min(mins))}-{_milliseconds(max(mins))}}}"
    return cell


def markdown_tables(rows: list[dict]) -> str:
    """One table per (input, shape without G), rows ordered by G then as run."""
    sections = defaultdict(list)
    for row in combine_processes(rows):
        sections[(row["input"], _fixed_shape(row))].append(row)
    out = []
    for (input_kind, fixed), section in sections.items():
        prompts, length, hidden, vocab, kind, threads = fixed
        out.append(f"#### {INPUT_TITLES[input_kind]}: P={prompts} prompts x G, T={length}, H={hidden}, V={vocab}, "
                   f"{KIND_TITLES[kind]}, {threads} thread{'s' if threads > 1 else ''}")
        # With several loss types, each row is also rated against its implementation's GRPO.
        objectives = len({r.get("loss_type", "grpo") for r in section}) > 1
        grpo_rows = {(r["impl"], r["group_size"]): r for r in section
                     if r.get("loss_type", "grpo") == "grpo" and r["status"] == "ok" and not r.get("packed")}
        out.append("")
        out.append(
            "| G | implementation | status | time min [median] (ms) | tokens/s | peak alloc (MB) "
            "| peak RSS (MB) | time vs bound | time vs eager | alloc vs eager | RSS vs eager | load |"
            + (" time vs its grpo |" if objectives else "")
        )
        out.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if objectives else ""))
        baselines = {r["group_size"]: r for r in section
                     if r["impl"] == BASELINE and r["status"] == "ok" and not r.get("packed")}
        bounds = {(r["group_size"], r.get("packed", False)): r for r in section
                  if r["impl"] == BOUND and r["status"] == "ok"}
        for row in sorted(section, key=lambda r: r["group_size"]):
            base = baselines.get(row["group_size"], {})
            bound = bounds.get((row["group_size"], row.get("packed", False)), {})
            status = row["status"]
            if row.get("processes_failed"):
                status += f" ({row['processes_failed']} processes)"
            if row.get("reason"):
                status += f": {row['reason']}"
            tokens_per_s = None
            if row.get("time_min_s"):
                tokens_per_s = row["tokens"] / row["time_min_s"]
            out.append(
                f"| {row['group_size']} | {_label(row)} | {status} | {_time_cell(row)} "
                f"| {_number(tokens_per_s, 0)} | {_megabytes(row.get('alloc_peak_mb'))} "
                f"| {_megabytes(row.get('rss_peak_mb'))} "
                f"| {_ratio(row.get('time_min_s'), bound.get('time_min_s'))} "
                f"| {_ratio(row.get('time_min_s'), base.get('time_min_s'))} "
                f"| {_ratio(row.get('alloc_peak_mb'), base.get('alloc_peak_mb'), SMALLEST_MEMORY_RATIO_BASE_MB)} "
                f"| {_ratio(row.get('rss_peak_mb'), base.get('rss_peak_mb'), SMALLEST_MEMORY_RATIO_BASE_MB)} "
                f"| {_number(row.get('load_1min'), 1)} |"
                + (f" {_ratio(row.get('time_min_s'), grpo_rows.get((row['impl'], row['group_size']), {}).get('time_min_s'))} |"
                   if objectives else "")
            )
        out.append("")
    return "\n".join(out)


def plot_against_group_size(rows: list[dict], path: Path) -> Path | None:
    """Peak memory (RSS and allocator) and min time against G, one line per implementation, for every input
    whose shape was swept over more than one G. None if nothing was swept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = defaultdict(list)
    for row in combine_processes(rows):
        if row["status"] == "ok":
            swept[(row["input"], _fixed_shape(row))].append(row)
    swept = {key: section for key, section in swept.items() if len({r["group_size"] for r in section}) > 1}
    if not swept:
        return None
    figure, axes = plt.subplots(2, len(swept), figsize=(6.5 * len(swept), 8), squeeze=False)
    for column, ((input_kind, fixed), section) in enumerate(swept.items()):
        by_impl = defaultdict(list)
        for row in sorted(section, key=lambda r: r["group_size"]):
            by_impl[_label(row)].append(row)
        memory_axis, time_axis = axes[0][column], axes[1][column]
        for impl, impl_rows in by_impl.items():
            groups = [r["group_size"] for r in impl_rows]
            (line,) = memory_axis.plot(groups, [r["rss_peak_mb"] for r in impl_rows], marker="o", label=f"{impl} RSS")
            memory_axis.plot(
                groups, [r["alloc_peak_mb"] for r in impl_rows], marker="x", linestyle="--",
                color=line.get_color(), label=f"{impl} alloc",
            )
            time_axis.plot(groups, [r["time_min_s"] for r in impl_rows], marker="o", label=impl)
        prompts, length, hidden, vocab, _kind, threads = fixed
        memory_axis.set_title(f"{input_kind}: P={prompts}, T={length}, H={hidden}, V={vocab}, {threads} threads")
        memory_axis.set_ylabel("peak above baseline (MB): RSS solid, allocator dashed")
        time_axis.set_ylabel("forward+backward, min of rounds (s)")
        # Linear memory: a peak can be 0 (nothing allocated beyond the inputs).
        time_axis.set_yscale("log")
        for axis in (memory_axis, time_axis):
            axis.set_xscale("log", base=2)
            axis.set_xticks(sorted({r["group_size"] for r in section}))
            axis.set_xticklabels([str(g) for g in sorted({r["group_size"] for r in section})])
            axis.set_xlabel("group size G")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_reports(rows: list[dict], meta: dict, results_dir: Path, stem: str) -> dict[str, Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    header = "\n".join(f"- {key}: {value}" for key, value in meta.items())
    table_path = results_dir / f"{stem}.md"
    table_path.write_text(f"# Loss step benchmark\n\n{header}\n\n{markdown_tables(rows)}\n{LEGEND}\n")
    json_path = results_dir / f"{stem}.json"
    # Every process's own row, uncombined.
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    paths = {"table": table_path, "json": json_path}
    plot_path = plot_against_group_size(rows, results_dir / f"{stem}_vs_G.png")
    if plot_path is not None:
        paths["plot"] = plot_path
    return paths
