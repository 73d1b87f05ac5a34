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

Progress goes to stdout as it happens. Each section is a module beside this one
(gpu_correctness.py, gpu_trainer.py, gpu_probe.py, gpu_loss_step.py: the loss step, the
surrogate and the paper's scale), gpu_report.py writes the report.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from gpu_correctness import TestRun, run_tests
from gpu_loss_step import benchmark, paper_scale, surrogate_benchmark
from gpu_loss_step import sizes as loss_step_sizes
from gpu_probe import probe_runs
from gpu_progress import ROOT, START, say
from gpu_report import write_report
from gpu_trainer import TrainerCheck, trainer_check

# gpu_trainer.py reads the trainer's runs with the trainer's own modules, which the wheel
# does not install: they are imported from this checkout.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes (CI)")
    parser.add_argument("--report", type=Path, default=ROOT / "bench" / "results" / "gpu-report.md")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-probe", action="store_true", help="no train steps through the trainer")
    parser.add_argument("--skip-trainer", action="store_true", help="no run of trainer/run.py")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole check: the tests and the trainer's runs get a third, the "
                             "probe's runs what is left but a reserve for the benchmarks (a lent GPU's time is short)")
    args = parser.parse_args(argv)
    if args.rounds < 1:  # not hadw_kernels.tools.cli's type: this script loads the library only where it runs
        parser.error(f"argument --rounds: must be at least 1, got {args.rounds}")
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f"argument --time-limit: must be positive, got {args.time_limit}")
    if args.report == parser.get_default("report"):  # bench/results/ is git-ignored: a fresh clone has none
        args.report.parent.mkdir(parents=True, exist_ok=True)
    if not args.report.parent.is_dir():  # before the hour of tests whose report it would lose
        parser.error(f"argument --report: no folder {str(args.report.parent)!r} to write {args.report.name!r} in")
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
        sizes = loss_step_sizes(args.dry_run, args.rounds)
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
