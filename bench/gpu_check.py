"""The GPU half, proven in one offline command: ``bash scripts/gpu_check.sh`` on a CUDA
machine (torch and Triton installed, no network), ``--dry-run`` on the CPU (CI).

1. runs the conformance suite, the Triton-specific tests (CUDA sync-debug, graph
   capture) and the compiled-graph tests with the Triton kernels compiled
   (HADW_TEST_DEVICE=cuda; dry run: the interpreter, a subset);
2. meanwhile runs the main job, ``trainer/run.py``, on the device (tiny model, HF-engine
   rollouts, DeepSpeed), kills a second run inside a step and resumes it, and compares
   the two curves;
3. runs real train steps through the trainer (``python -m trainer.tools.probe``: Qwen3-1.7B
   with random weights, bf16, ZeRO-2, gradient checkpointing): G = 64 responses of 4096
   tokens with the fused loss, the largest micro-batch token budget with each loss
   (bisection, catching out-of-memory) and the throughput at it, and whether one
   32k-token response fits with each; the memory planner's budget beside them (dry run:
   the tiny preset on the CPU);
4. times one loss step (forward + backward) against the bound (the three bare GEMMs any
   exact method needs, cuBLAS, preallocated), eager PyTorch (materialised logits),
   Liger's chunked loss and Triton GRPO op, Cut Cross-Entropy's kernel and TRL's chunked
   log-prob kernel (each + the surrogate), with CUDA events (warm-up, median), and the
   peak memory above the inputs; the surrogate alone; and at the paper's scale (Qwen3-4B
   head, responses of 4096 tokens, G = 8..64, bf16) the loss step's peak memory for eager
   and this library against the memory planner's loss part. The implementations, the
   bound and their inputs are the CPU benchmark's (bench/loss_impls.py), on CUDA in bf16
   or fp32;
5. writes one markdown report (``--report``) after every stage, and exits non-zero if a
   correctness test failed, a run failed or a section crashed. ``--time-limit`` shares
   a short lease among the stages.

Progress goes to stdout as it happens.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # loaded where the benchmarks run: it imports torch
    from loss_impls import Inputs, Shape, Step

ROOT = Path(__file__).resolve().parents[1]
START = time.time()


def say(message: str) -> None:
    print(f"[gpu_check {time.time() - START:6.1f}s] {message}", flush=True)


# --- 1. correctness -------------------------------------------------------------------


@dataclass
class TestRun:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_tests(dry_run: bool, junit: Path, seconds: float | None) -> TestRun:
    """The conformance suite, the Triton-specific tests (CUDA sync-debug, graph capture)
    and the compiled ones, in a child pytest (in parallel where pytest-xdist is there)."""
    environment = dict(os.environ)
    if dry_run:
        environment["HADW_TEST_DEVICE"] = "cpu"
        environment["TRITON_INTERPRET"] = "1"
        selection = ["tests/conformance/test_surrogate_op.py", "-k", "grpo and (plain or hadw) and float32"]
    else:
        environment["HADW_TEST_DEVICE"] = "cuda"
        environment.pop("TRITON_INTERPRET", None)
        selection = ["tests/conformance", "tests/test_triton_specific.py", "tests/test_compile.py",
                     "tests/test_segment_attention.py"]
        if importlib.util.find_spec("xdist") is not None:
            selection += ["-n", str(min(12, max(1, (os.cpu_count() or 2) - 4)))]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selection]
    say("tests: " + " ".join(command[3:]))
    started = time.time()
    output = junit.with_suffix(".log")
    with output.open("w") as log:
        try:
            subprocess.run(command, cwd=ROOT, env=environment, check=False, timeout=seconds, stdout=log,
                           stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            say(f"tests: stopped at the time limit ({seconds:.0f} s)")
    run = TestRun(seconds=time.time() - started)
    progress = output.read_text()
    output.unlink()
    if not junit.exists():
        # Stopped before pytest wrote its report (pytest-xdist's teardown can take the last
        # seconds): the outcomes as its progress lines printed them, one character a test.
        marks = "".join(line.split("[")[0] for line in progress.splitlines() if line.rstrip().endswith("%]"))
        run.passed, run.skipped = marks.count("."), marks.count("s")
        run.failed = marks.count("F") + marks.count("E")
        run.failures.append(f"no report: stopped at the time limit ({seconds:.0f} s); the counts are pytest's "
                            f"progress marks ({run.failed} F/E), the failures' names are not known")
        return run
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            run.failed += 1
            detail = next(child for child in case if child.tag in ("failure", "error"))
            run.failures.append(f"{case.get('name')}: {(detail.get('message') or '')[:300]}")
        elif "skipped" in outcome:
            run.skipped += 1
        else:
            run.passed += 1
    say(f"tests: {run.passed} passed, {run.failed} failed, {run.skipped} skipped in {run.seconds:.0f} s")
    return run


# --- 2. loss-step benchmark -----------------------------------------------------------
# The rows run the CPU benchmark's implementations, inputs and bound (bench/loss_impls.py,
# its PEERS the GPU's peers too): one copy, so a change to a call reaches both.


@dataclass(frozen=True)
class Case:
    name: str
    shape: Shape
    dtype: str
    padded: bool = False  # every response T/2 long
    block_rows: tuple = ()  # extra rows of this library at these block sizes

    def label(self) -> str:
        shape, pad = self.shape, ", half padding" if self.padded else ", dense on-policy"
        return f"{self.name}: B={shape.batch} T={shape.length} H={shape.hidden} V={shape.vocab} {self.dtype}{pad}"

    def inputs(self) -> Inputs:
        """On this machine's device; on-policy: the old log-probs are the current ones."""
        import torch

        from loss_impls import make_inputs

        return make_inputs(self.shape, "hidden", dense=True, lengths="half" if self.padded else "dense",
                           device=_device(), dtype=getattr(torch, self.dtype))


def implementations(case: Case) -> dict[str, tuple[str, dict]]:
    """The rows of a case's table: their labels (docs/gpu-report.md's) -> the loss_impls
    implementation (the peers: loss_impls.PEERS with a GPU label) and the keywords of
    this library's call."""
    from loss_impls import BASELINE, BOUND, PEERS, hadw_impl

    # No value checks: their host read would wait for the GPU inside the timed step.
    ours = dict(check_values=False)
    in_forward = hadw_impl("triton", "gradients_in_forward")
    return {
        "bound (3 GEMMs)": (BOUND, {}),
        "eager": (BASELINE, {}),
        "hadw[triton] gradients in forward": (in_forward, ours),
        **{f"hadw[triton] gradients in forward, block_rows={rows}": (in_forward, {**ours, "block_rows": rows})
           for rows in case.block_rows},
        "hadw[triton] recompute": (hadw_impl("triton", "recompute"), ours),
        **{peer.gpu_label: (peer.impl, {}) for peer in PEERS if peer.gpu_label is not None},
    }


def row_step(case: Case, name: str) -> Step:
    """The step of the row ``name`` (ImportError where its peer is missing)."""
    from loss_impls import build_step

    impl, options = implementations(case)[name]
    return build_step(impl, "hidden", case.shape, **options)


@dataclass
class Timing:
    milliseconds: float | None
    peak_mib: float | None
    note: str = ""


def _cuda_time(step: Callable, rounds: int) -> float:
    """Median milliseconds of ``step`` after two warm-up calls: CUDA events on a GPU, the
    process clock in a dry run on the CPU."""
    import torch

    step()  # warm-up: compiles, autotunes, fills caches
    step()
    if not torch.cuda.is_available():
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            step()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak_mib(step: Callable) -> float | None:
    """Peak allocated MiB above the memory held before ``step`` (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(case: Case, name: str, x: Inputs, rounds: int) -> Timing:
    """Row ``name`` of ``case`` on ``x``; a row that cannot run (a missing peer, a case it
    does not support, out of memory) says why, and the others still run."""
    import torch

    try:
        step = functools.partial(row_step(case, name), x)
        timing = Timing(_cuda_time(step, rounds), _peak_mib(step))
    except torch.cuda.OutOfMemoryError:
        timing = Timing(None, None, "out of memory")
    except Exception as error:
        timing = Timing(None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
    torch.cuda.empty_cache()
    return timing


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def benchmark(cases: list[Case], rounds: int) -> list[tuple[Case, dict[str, Timing]]]:
    import torch

    results = []
    for case in cases:
        say(f"bench: {case.label()}")
        x = case.inputs()
        row = {}
        for name in implementations(case):
            row[name] = timing = measure(case, name, x, rounds)
            say(f"  {name:34s} " + (f"{timing.milliseconds:9.2f} ms {_mib(timing.peak_mib):>9s} MiB"
                                    if timing.milliseconds is not None else timing.note))
        results.append((case, row))
        del x  # before the next case's inputs
        torch.cuda.empty_cache()
    return results


def surrogate_benchmark(shape: Shape, dtypes: list[str], rounds: int) -> list[tuple[str, dict]]:
    """The surrogate alone from log-probs [B, T] (lengths in [T/2, T], old log-probs a
    little off): wall time of the call (CUDA events), and GPU kernel time from a
    CUDA-graph replay (no launch overhead)."""
    import torch

    from loss_impls import BASELINE, build_step, hadw_impl, make_inputs

    calls = {
        "eager": build_step(BASELINE, "logprobs", shape),
        # No value checks: a host read cannot be captured in a CUDA graph.
        "hadw[triton]": build_step(hadw_impl("triton"), "logprobs", shape, check_values=False),
    }
    device = _device()
    results = []
    for dtype_name in dtypes:
        x = make_inputs(shape, "logprobs", device=device, dtype=getattr(torch, dtype_name))
        row = {}
        for name, call in calls.items():
            step = functools.partial(call, x)
            try:
                wall = _cuda_time(step, rounds)
            except Exception as error:
                say(f"  surrogate {name} FAILED: {type(error).__name__}: {str(error)[:300]}")
                row[name] = (None, None)
                continue
            graph_ms = None
            try:
                if device != "cuda":
                    raise RuntimeError("CUDA graphs need a GPU")
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step()
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph):
                    step()
                graph_ms = _cuda_time(graph.replay, rounds)
            except Exception as error:
                say(f"  {name}: no CUDA graph ({type(error).__name__}: {str(error)[:100]})")
            row[name] = (wall, graph_ms)
            say(f"  surrogate B={shape.batch} T={shape.length} {dtype_name} {name:14s} wall {wall * 1e3:8.1f} us"
                + (f", graph replay {graph_ms * 1e3:8.1f} us" if graph_ms is not None else ""))
        results.append((dtype_name, row))
    return results


# --- 3. the paper's scale ---------------------------------------------------------------


def paper_scale(group_sizes: list[int], width: int, hidden: int, vocab: int) -> list[dict]:
    """Peak memory of one loss step at Qwen3-4B's head, one prompt x G responses."""
    import torch

    from hadw_kernels import plan
    from loss_impls import Shape

    rows = []
    for group_size in group_sizes:
        case = Case(f"G={group_size}", Shape(1, group_size, width, hidden, vocab), "bfloat16")
        tokens = case.shape.tokens
        row = {"G": group_size, "tokens": tokens}
        try:
            x = case.inputs()
        except torch.cuda.OutOfMemoryError:
            rows.append({**row, "note": "inputs do not fit"})
            break
        for name in ("eager", "hadw[triton] gradients in forward"):
            try:
                row[name] = _peak_mib(functools.partial(row_step(case, name), x))
            except torch.cuda.OutOfMemoryError:
                row[name] = None
            torch.cuda.empty_cache()
        parts = plan.loss_part_bytes(tokens, hidden, vocab, fused=True, dtype_bytes=2)
        row["planner"] = sum(parts.values()) / 2**20
        row["planner eager"] = sum(plan.loss_part_bytes(tokens, hidden, vocab, fused=False,
                                                        dtype_bytes=2).values()) / 2**20
        say(f"paper scale G={group_size}: " + ", ".join(
            f"{key} {_mib(value)} MiB" if key not in ("G", "tokens") else f"{key} {value}"
            for key, value in row.items()))
        rows.append(row)
        del x  # before the next G's inputs
        torch.cuda.empty_cache()
    return rows


# --- 4. train steps through the trainer (trainer.tools.probe) ---------------------------------------


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
            *[(f"G=64 x 4096 tokens, {layout}", [*group, *flags], 1) for layout, flags in (
                ("padded", ["--no-packing"]), ("packed", ["--packing", "--no-share-prompt"]),
                ("shared prompt", ["--share-prompt"]))],
            ("the largest budget, fused, padded", ["--loss", "fused", "-L", "4096", "--no-packing", "--steps", "0",
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
    from hadw_kernels import plan

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
             "`hadw_kernels.plan.largest_token_budget` for the same setting (no fixed overhead).", "",
             "| run | loss | layout | budget tokens (fed) | fits | peak GiB | tokens/s | largest budget (fed) | "
             "tokens/s at it | planner budget |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        if run.result is None:
            lines.append(f"| {run.label} | | | | FAILED: {run.error.strip().splitlines()[-1][:150] if run.error else ''} "
                         "| | | | | |")
            continue
        result = run.result

        def number(key, form):
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


# --- 5. the trainer on this device (trainer/run.py) ------------------------------------------

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


# --- 6. the report ------------------------------------------------------------------------


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


def _ratio(value, reference) -> str:
    if value is None or reference is None:
        return "n/a"
    return f"{value / reference:.2f}x"


def write_report(path: Path, tests: TestRun, bench, surrogate, paper, dry_run: bool, crashed: list[str],
                 probes: list[ProbeRun] = (), trainer: TrainerCheck | None = None) -> None:
    lines = ["# GPU check report", ""]
    if dry_run:
        lines += ["DRY RUN on the CPU (interpreter, tiny shapes): proves the command runs, measures nothing.", ""]
    lines += ["Written by `bash scripts/gpu_check.sh` (bench/gpu_check.py).", "", *environment_lines(), "",
              "## Correctness (compiled Triton kernels)" if not dry_run else "## Correctness", "",
              f"{tests.passed} passed, {tests.failed} failed, {tests.skipped} skipped ({tests.seconds:.0f} s).", ""]
    lines += [f"- FAILED {failure}" for failure in tests.failures[:50]]
    for crash in crashed:
        lines += ["", "## A section crashed", "", "```", crash, "```"]
    if bench:
        lines += ["", "## Loss step: forward + backward from hidden states", "",
                  "Median of CUDA-event timings after two warm-up steps; peak = max_memory_allocated above the "
                  "inputs. Ratios are to the bound (three cuBLAS GEMMs on preallocated buffers) and to eager "
                  "(materialised logits) in the same run.", ""]
        for case, row in bench:
            bound = row["bound (3 GEMMs)"].milliseconds
            eager = row["eager"].milliseconds
            lines += [f"### {case.label()}", "", "| implementation | ms | / bound | / eager | peak MiB |",
                      "| --- | ---: | ---: | ---: | ---: |"]
            for name, timing in row.items():
                if timing.milliseconds is None:
                    lines.append(f"| {name} | {timing.note} | | | |")
                    continue
                peak = "" if name.startswith("bound") else _mib(timing.peak_mib)
                lines.append(f"| {name} | {timing.milliseconds:.2f} | {_ratio(timing.milliseconds, bound)} | "
                             f"{_ratio(timing.milliseconds, eager)} | {peak} |")
            lines.append("")
    if surrogate:
        lines += ["## The surrogate alone, from log-probs", "",
                  "Wall: one call + backward from Python (launch overhead included). Graph: the same replayed as "
                  "a CUDA graph (GPU time only).", "", "| dtype | implementation | wall us | graph us |",
                  "| --- | --- | ---: | ---: |"]
        for dtype_name, row in surrogate:
            for name, (wall, graph) in row.items():
                wall_text = "failed" if wall is None else f"{wall * 1e3:.1f}"
                graph_text = "n/a" if graph is None else f"{graph * 1e3:.1f}"
                lines.append(f"| {dtype_name} | {name} | {wall_text} | {graph_text} |")
        lines.append("")
    if paper:
        lines += ["## The paper's scale: Qwen3-4B head, one prompt x G responses of 4096 tokens, bf16", "",
                  "Peak memory of the loss step above its inputs; the planner's loss part "
                  "(`hadw_kernels.plan.loss_part_bytes`) beside it.", "",
                  "| G | tokens | eager MiB | hadw MiB | planner hadw MiB | planner eager MiB |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in paper:
            if "note" in row:
                lines.append(f"| {row['G']} | {row['tokens']} | {row['note']} | | | |")
                continue

            def cell(value):
                # None: out of memory on a GPU; nothing measured in a dry run.
                return ("n/a" if dry_run else "OOM") if value is None else f"{value:.0f}"

            lines.append(f"| {row['G']} | {row['tokens']} | {cell(row['eager'])} | "
                         f"{cell(row['hadw[triton] gradients in forward'])} | {row['planner']:.0f} | "
                         f"{row['planner eager']:.0f} |")
        fits = [row["G"] for row in paper if row.get("hadw[triton] gradients in forward") is not None]
        eager_fits = [row["G"] for row in paper if row.get("eager") is not None]
        lines += ["", f"Largest G measured whose loss step fits: hadw {max(fits) if fits else 'none'}, "
                      f"eager {max(eager_fits) if eager_fits else 'none'} (of those tried).", ""]
    if trainer is not None:
        lines += trainer_lines(trainer, dry_run)
    if probes:
        lines += probe_lines(list(probes), dry_run)
    path.write_text("\n".join(lines) + "\n")
    say(f"report written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes (CI)")
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "gpu-report.md")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-probe", action="store_true", help="no train steps through the trainer")
    parser.add_argument("--skip-trainer", action="store_true", help="no run of trainer/run.py")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole check: the tests and the trainer's runs get a third, the "
                             "probe's runs what is left but a reserve for the benchmarks (a lent GPU's time is short)")
    args = parser.parse_args(argv)
    if args.rounds < 1:  # not hadw_kernels.cli's type: this script loads the library only where it runs
        parser.error(f"argument --rounds: must be at least 1, got {args.rounds}")
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f"argument --time-limit: must be positive, got {args.time_limit}")
    if args.dry_run:
        # The Triton kernels on CPU tensors: the interpreter, before any kernel is defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    def left(share: float = 1.0) -> float | None:
        return None if args.time_limit is None else max(1.0, share * (args.time_limit - (time.time() - START)))

    tests, trainer, probes, crashed = TestRun(), None, [], []
    measured = {"bench": [], "surrogate": [], "paper": []}

    def report() -> None:  # after every stage: a check stopped later still leaves what it measured
        write_report(args.report, tests, measured["bench"], measured["surrogate"], measured["paper"], args.dry_run,
                     crashed, probes, trainer)

    # The trainer's run (a tiny model) beside the tests: neither is timed against anything.
    trainer_result: list[TrainerCheck] = []
    trainer_thread = None
    if not args.skip_trainer:
        import threading

        def trainer_stage() -> None:
            try:
                trainer_result.append(trainer_check(args.dry_run, left(0.35)))
            except Exception:
                crashed.append(f"trainer: {traceback.format_exc()[-1500:]}")

        trainer_thread = threading.Thread(target=trainer_stage)
        trainer_thread.start()
    junit = args.report.with_suffix(".junit.xml")
    if not args.skip_tests:
        tests = run_tests(args.dry_run, junit, left(0.3))
    if junit.exists():
        junit.unlink()
    if trainer_thread is not None:
        trainer_thread.join()
        trainer = trainer_result[0] if trainer_result else None
    report()
    if not args.skip_probe:
        try:
            # A reserve for the benchmarks, where they run.
            reserve = 0 if args.skip_bench else 150
            probes = probe_runs(args.dry_run, None if args.time_limit is None else left() - reserve)
        except Exception:
            crashed.append(f"probe: {traceback.format_exc()[-1500:]}")
            say(f"section probe CRASHED:\n{crashed[-1]}")
        report()
    if not args.skip_bench:
        from loss_impls import Shape

        if args.dry_run:
            # The same code on the CPU with tiny shapes (Triton in its interpreter), so that
            # it cannot rot; the figures mean nothing.
            tiny = Shape(1, 2, 16, 32, 300)
            sizes = dict(cases=[Case("tiny", tiny, "float32"),
                                Case("tiny", tiny, "bfloat16", padded=True, block_rows=(16,))],
                         surrogate=Shape(1, 8, 16, 32, 300), paper=([2, 4], 16, 32, 300), rounds=1)
        else:
            # P x G responses of T tokens, H and V the LM head's (V only sets the log-probs'
            # scale in the surrogate's case).
            qwen3_4b_head = Shape(1, 2, 4096, 2560, 151936)
            small = Shape(1, 8, 256, 512, 32768)
            sizes = dict(cases=[
                Case("Qwen3-4B head", qwen3_4b_head, "bfloat16", block_rows=(2048, 8192)),
                Case("Qwen3-4B head", qwen3_4b_head, "bfloat16", padded=True),
                Case("small dense shape", small, "bfloat16"),
                Case("small dense shape", small, "float32"),
                Case("Qwen vocabulary", Shape(1, 4, 256, 1024, 151936), "float32"),
            ], surrogate=Shape(32, 8, 4096, 2560, 151936), paper=([8, 16, 32, 64], 4096, 2560, 151936),
                rounds=args.rounds)
        sections = {
            "bench": lambda: benchmark(sizes["cases"], sizes["rounds"]),
            "surrogate": lambda: surrogate_benchmark(sizes["surrogate"], ["float32", "bfloat16"], sizes["rounds"]),
            "paper": lambda: paper_scale(*sizes["paper"]),
        }
        for name, section in sections.items():
            try:
                measured[name] = section()
            except Exception:
                crashed.append(f"{name}: {traceback.format_exc()[-1500:]}")
                say(f"section {name} CRASHED:\n{crashed[-1]}")
            report()
    report()
    probe_failed = any(run.result is None for run in probes)
    trainer_failed = trainer is not None and bool(trainer.error)
    return 1 if tests.failed or crashed or probe_failed or trainer_failed else 0


if __name__ == "__main__":
    sys.exit(main())
