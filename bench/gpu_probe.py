"""The GPU check's train steps through the trainer (``python -m trainer.tools.probe``, one
child process a question) and their report lines, the memory planner's budget beside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from gpu_progress import ROOT, say


@dataclass
class ProbeRun:
    label: str
    arguments: list[str]
    result: dict | None = None
    error: str = ""


def probe_runs(dry_run: bool, seconds: float | None = None) -> list[ProbeRun]:
    """``python -m trainer.tools.probe`` in child processes, one a question (a crash or an
    out-of-memory error stays in its own process)."""
    if dry_run:
        common = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--zero-stage", "2", "-P", "4",
                  "--threads", "1"]
        # Two runs, one a loss, through the same code paths: steps, then the bisection.
        runs = [(f"G=4 x 16 tokens and the largest budget, {loss}",
                 ["--loss", loss, "-G", "4", "-L", "16", "--micro-batch-tokens", "40", "--find-max-budget",
                  "--memory-limit-gib", "64", "--max-budget-tokens", "160", "--steps-at-largest-budget", "2"], 1)
                for loss in ("eager", "fused")]
    else:
        common = ["--preset", "Qwen3-1.7B", "--device", "cuda", "--dtype", "bfloat16", "--zero-stage", "2",
                  "-P", "512"]
        # (label, arguments, weight: its share of a time limit, the bisection the largest).
        # G = 64 responses of 4096 tokens in micro-batches of 16 sequences, in each layout
        # the trainer lays out (the same tokens); then the largest budget that trains
        # repeatedly (two-step trials, to within 10%: the planner is held to 10%).
        group = ["--loss", "fused", "-G", "64", "-L", "4096", "--micro-batch-tokens", str(16 * (512 + 4096)),
                 "--steps", "2"]
        runs = [
            *[(f"G=64 x 4096 tokens, {layout.replace('_', ' ')}", [*group, "--layout", layout], 1)
              for layout in ("padded", "packed", "shared_prompt", "prefix_tree")],
            ("the largest budget, fused, padded", ["--loss", "fused", "-L", "4096", "--layout", "padded", "--steps", "0",
                                                   "--find-max-budget", "--budget-tolerance", "0.1"], 3),
        ]
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    environment.pop("TRITON_INTERPRET", None)
    # A time limit is shared by the runs' weights; what a run leaves goes to the next.
    out = []
    started = time.time()
    for index, (label, arguments, weight) in enumerate(runs):
        run = ProbeRun(label, [*common, *arguments])
        remaining = None
        if seconds is not None:
            remaining = (seconds - (time.time() - started)) * weight / sum(later for *_, later in runs[index:])
        if remaining is not None and remaining < 30:
            run.error = "not run: the check's time limit was reached"
            out.append(run)
            continue
        json_path = ROOT / f".probe-{len(out)}.json"
        command = [sys.executable, "-m", "trainer.tools.probe", *run.arguments, "--json", str(json_path)]
        say(f"probe {label}: {' '.join(command[3:-2])}")
        try:
            completed = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                                       check=False, timeout=remaining or 1800)
        except subprocess.TimeoutExpired as timeout:
            said = timeout.stderr.decode(errors="replace") if isinstance(timeout.stderr, bytes) else timeout.stderr
            completed = subprocess.CompletedProcess(command, -9, stdout="",
                                                    stderr=f"{(said or '')[-1200:]}\nstopped at the time limit")
        if json_path.exists():  # written at the end of the run: complete even if its exit was cut short
            run.result = json.loads(json_path.read_text())
            say(f"probe {label}: " + ", ".join(f"{key} {run.result[key]}" for key in (
                "fits", "peak_memory_gib", "tokens_per_second", "largest_budget_tokens",
                "largest_budget_tokens_per_second") if key in run.result))
        else:
            run.error = (completed.stderr or completed.stdout)[-1500:]
            say(f"probe {label} FAILED (exit {completed.returncode}):\n{run.error}")
        json_path.unlink(missing_ok=True)
        out.append(run)
    return out


def _planned_budget(run: ProbeRun, gpu_gib: float | None) -> str:
    """The planner's budget view for the probe's setting (one GPU, no fixed overhead:
    max_memory_allocated counts no CUDA context), or n/a."""
    from hadw_kernels.tools import plan

    result = run.result or {}
    if result.get("preset") not in plan.PRESETS or gpu_gib is None:
        return "n/a"
    step = plan.MicroStep(group_size=1, prompts=1, response_length=result["response_length"],
                          prompt_length=result["prompt_length"], gpus=1, zero_stage=result["zero_stage"],
                          gradient_checkpointing=result["gradient_checkpointing"], overhead_gib=0.0,
                          share_prompt=result.get("layout") == "shared_prompt")
    return str(plan.largest_token_budget(plan.PRESETS[result["preset"]], step, fused=result["loss"] == "fused",
                                         gpu_gib=gpu_gib))


def probe_lines(runs: list[ProbeRun], dry_run: bool) -> list[str]:
    gpu_gib = None
    if not dry_run:
        import torch

        if torch.cuda.is_available():
            gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    model = "the tiny preset on the CPU" if dry_run else "Qwen3-1.7B (random weights), bf16, ZeRO-2, one GPU"
    lines = ["## Train steps through the trainer: `python -m trainer.tools.probe`", "",
             f"{model}; gradient checkpointing; responses cut by tokens into micro-batches, laid out as the "
             "layout column says (padded rows; packed: one row, the segment attention; shared prompt: packed, "
             "each group's prompt once); forward, loss, `engine.backward`, `engine.step` (AdamW). Peak: " +
             ("process RSS (sampled)" if dry_run else "`max_memory_allocated`, model states included") +
             "; budget: prompt + response tokens of the micro-batch's sequences (fed: the tokens through the "
             "model in its layout); tokens/s: prompt + response tokens of every sequence over the median step "
             "after a warm-up one, so layouts compare on the same work. Planner: "
             "`hadw_kernels.tools.plan.largest_token_budget` for the same setting (no fixed overhead).", "",
             "| run | loss | layout | budget tokens (fed) | fits | peak GiB | tokens/s | largest budget (fed) | "
             "tokens/s at it | planner budget |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        if run.result is None:
            lines.append(f"| {run.label} | | | | FAILED: {run.error.strip().splitlines()[-1][:150] if run.error else ''} "
                         "| | | | | |")
            continue
        result = run.result

        def number(key, form, result=result):
            return form.format(result[key]) if result.get(key) is not None else ""

        fits = {True: "yes", False: "no (" + result.get("note", "over the limit")[:60] + ")"}.get(result.get("fits"), "")
        planned = _planned_budget(run, gpu_gib) if "largest_budget_tokens" in result else ""
        budget = (f"{result['micro_batch_tokens']} ({result['micro_batch_fed_tokens']})" if "step_seconds" in result
                  else "")  # steps 0: bisection only
        largest = (f"{result['largest_budget_tokens']} ({result['largest_budget_fed_tokens']})"
                   if "largest_budget_tokens" in result else "")
        lines.append(f"| {run.label} | {result['loss']} | {result.get('layout', '')} | {budget} | {fits} | "
                     f"{number('peak_memory_gib', '{:.2f}')} | {number('tokens_per_second', '{:.0f}')} | "
                     f"{largest} | {number('largest_budget_tokens_per_second', '{:.0f}')} | {planned} |")
        lines += [f"  - trial: {trial['rows']} sequences ({trial['fed_tokens']} fed tokens): "
                  + (f"fits, peak {trial['peak_bytes'] / 2**30:.2f} GiB" if trial.get("fits")
                     else trial.get("note", "does not fit")[:80])
                  for trial in result.get("budget_trials", [])]
    lines += ["", "A measured largest budget belongs in docs/measured-budgets.json (tests/test_plan.py holds the "
              "planner to it within 10%)." if not dry_run else "Dry run: the figures mean nothing.", ""]
    return lines
