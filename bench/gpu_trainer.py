"""The GPU check's run of the main job (``trainer/run.py``) on the device: a short run, the
same run killed inside a step and resumed, both curves compared; and its report lines."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_progress import ROOT, say

CURVE_KEYS = ("reward/mean", "anchor/belief", "loss", "grad_norm")


@dataclass
class TrainerCheck:
    steps: int = 0
    every: int = 0
    crash_step: int = 0
    reference: list[dict] = field(default_factory=list)
    resumed: list[dict] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    error: str = ""


def trainer_check(dry_run: bool, seconds: float | None) -> TrainerCheck:
    """The main job on this device: a run of the CPU default's task with rollouts from the
    HF engine (no vLLM here), checkpoints every few steps; the same run killed inside a
    step after a checkpoint and resumed; both curves compared step by step."""
    import shutil
    import tempfile

    from trainer.checkpoint_files import completed_checkpoints
    from trainer.engine.metrics_log import read_metrics

    check = TrainerCheck()
    steps, every, crash_after = (3, 1, 2) if dry_run else (20, 5, 12)
    check.steps, check.every, check.crash_step = steps, every, crash_after + 1
    output = Path(tempfile.mkdtemp(prefix="gpu-check-trainer-"))
    started = time.time()
    # The CPU default's batch on the device; a quarter of it in a dry run.
    prompts, mini_batch, micro_batch, group_size = (8, 4, 2, 4) if dry_run else (64, 16, 16, 8)
    common = ["rollout.engine=hf", f"train.steps={steps}", f"run.checkpoint_every={every}",
              f"train.prompts_per_step={prompts}", f"train.mini_batch_prompts={mini_batch}",
              f"train.micro_batch_prompts={micro_batch}", f"rollout.group_size={group_size}",
              "reward.timeout_seconds=0", "run.progress=false", "run.plot=false", "run.export_hf=false",
              f"run.output_dir={output}"]

    def run(name: str, label: str, extra: list[str], resume: bool = False, env: dict | None = None) -> int:
        command = [sys.executable, str(ROOT / "trainer" / "run.py")]
        for override in [*common, f"run.name={name}", *extra]:
            command += ["--set", override]
        if resume:
            command.append("--resume")
        remaining = None if seconds is None else max(10.0, seconds - (time.time() - started))
        say(f"trainer: {label}")
        begun = time.time()
        completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=remaining,
                                   env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
                                        **(env or {})})
        check.seconds[label] = time.time() - begun
        # The trainer's own messages go to stdout without a progress bar (run.progress=false).
        check.log_lines += [f"{label}: {line}" for line in (completed.stdout + completed.stderr).splitlines()
                            if "micro-batches:" in line or "resumed from" in line][:3]
        if completed.returncode not in (0, 17):
            check.error = f"{label} exited {completed.returncode}: {completed.stderr[-1200:]}"
        return completed.returncode

    try:
        if run("reference", "uninterrupted", []) != 0:
            return check
        check.reference = read_metrics(output / "reference" / "metrics.jsonl")
        check.checkpoints = [f"step-{step}" for step, _ in completed_checkpoints(output / "reference" / "checkpoints")]
        # The resume keeps the reward function (a resume may not change the training); it then
        # never crashes, and scores as the synthetic verifier of the uninterrupted run.
        crashing = ["reward.function=test_trainer_helpers:synthetic_then_crash"]
        crashed = run("resumed", "killed inside a step", crashing,
                      env={"CRASH_AFTER_RESPONSES": str(crash_after * prompts * group_size)})
        if crashed != 17:
            check.error = check.error or f"the run meant to die inside step {crash_after + 1} exited {crashed}"
            return check
        if run("resumed", "resumed", crashing, resume=True, env={"CRASH_AFTER_RESPONSES": str(10**9)}) != 0:
            return check
        check.resumed = read_metrics(output / "resumed" / "metrics.jsonl")
    except subprocess.TimeoutExpired:
        check.error = f"stopped at the time limit ({seconds:.0f} s)"
    finally:
        shutil.rmtree(output, ignore_errors=True)
    return check


def _largest_difference(check: TrainerCheck, key: str) -> float | None:
    pairs = [(ours.get(key), theirs.get(key)) for ours, theirs in zip(check.resumed, check.reference)]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs or len(check.resumed) != len(check.reference):
        return None
    return max(abs(a - b) / max(abs(b), 1e-6) for a, b in pairs)


def trainer_lines(check: TrainerCheck, dry_run: bool) -> list[str]:
    lines = ["## The trainer on this device: `trainer/run.py`", "",
             f"The CPU default's task and model (the tiny model, the synthetic task), rollouts from "
             f"the HF engine (vLLM is not installed here), DeepSpeed ZeRO-2, {check.steps} steps, a checkpoint every "
             f"{check.every}; micro-batches laid out as the log below says; then the same run killed inside "
             f"step {check.crash_step} (its reward function exits the process) "
             "and resumed from its last checkpoint.", ""]
    if check.error:
        lines += ["FAILED:", "", "```", check.error, "```", ""]
    if check.reference:
        first, last = check.reference[:5], check.reference[-5:]

        def mean(rows, key):
            values = [row[key] for row in rows if row.get(key) is not None]
            return statistics.fmean(values) if values else float("nan")

        lines += [f"- steps logged: {len(check.reference)}; checkpoints kept: {', '.join(check.checkpoints)}",
                  f"- reward/mean: first 5 steps {mean(first, 'reward/mean'):.3f}, "
                  f"last 5 {mean(last, 'reward/mean'):.3f}",
                  f"- time/step (median): {statistics.median(row['time/step'] for row in check.reference):.2f} s; "
                  f"tokens/s (median): {statistics.median(row.get('tokens_per_s', 0) for row in check.reference):.0f}",
                  "- wall time per run: " + ", ".join(f"{name} {value:.0f} s" for name, value in check.seconds.items())]
        lines += [f"- log: {line}" for line in check.log_lines]
        lines += ["", "| step | reward/mean | anchor/belief | loss | grad_norm |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {row['step']} | " + " | ".join(f"{row.get(key, float('nan')):.4g}" for key in CURVE_KEYS) + " |"
                  for row in check.reference]
        lines.append("")
    if check.resumed:
        differences = {key: _largest_difference(check, key) for key in CURVE_KEYS}
        lines += [f"Resumed run: steps {[row['step'] for row in check.resumed]}; largest relative difference from "
                  "the uninterrupted run, over every step: " + ", ".join(
                      f"{key} {'n/a' if value is None else f'{value:.2e}'}" for key, value in differences.items()), ""]
    if dry_run:
        lines += ["Dry run: the CPU, a few steps.", ""]
    return lines
