"""The GPU check's one markdown report (``--report``), written after every stage: the
environment, then each section's lines."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

from gpu_correctness import TestRun, correctness_lines
from gpu_loss_step import loss_step_lines, paper_lines, surrogate_lines
from gpu_probe import ProbeRun, probe_lines
from gpu_progress import say
from gpu_trainer import TrainerCheck, trainer_lines


def environment_lines() -> list[str]:
    import torch
    import triton

    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}"]
    if torch.cuda.is_available():
        lines.append(f"- device: {torch.cuda.get_device_name()}, "
                     f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
            lines.append(f"- driver {smi}, CUDA {torch.version.cuda}")
        except (OSError, subprocess.SubprocessError):
            pass
    for package in ("liger_kernel", "cut_cross_entropy"):
        try:
            module = __import__(package)
            lines.append(f"- {package} {getattr(module, '__version__', 'installed')}")
        except ImportError:
            lines.append(f"- {package}: not installed (its rows are empty)")
    return lines


def write_report(path: Path, tests: TestRun, bench, surrogate, paper, dry_run: bool, crashed: list[str],
                 probes: list[ProbeRun] = (), trainer: TrainerCheck | None = None) -> None:
    lines = ["# GPU check report", ""]
    if dry_run:
        lines += ["DRY RUN on the CPU (interpreter, tiny shapes): proves the command runs, measures nothing.", ""]
    lines += ["Written by `bash scripts/gpu_check.sh` (bench/gpu_check.py).", "", *environment_lines(), ""]
    lines += correctness_lines(tests, dry_run)
    for crash in crashed:
        lines += ["", "## A section crashed", "", "```", crash, "```"]
    if bench:
        lines += loss_step_lines(bench)
    if surrogate:
        lines += surrogate_lines(surrogate)
    if paper:
        lines += paper_lines(paper, dry_run)
    if trainer is not None:
        lines += trainer_lines(trainer, dry_run)
    if probes:
        lines += probe_lines(list(probes), dry_run)
    path.write_text("\n".join(lines) + "\n")
    say(f"report written to {path}")
