"""Runs one loss step case in this (fresh) process and measures its peak memory.

    python bench/worker.py --impl eager --input hidden --prompts 4 --group-size 8 \
        --length 64 --hidden 512 --vocab 32768 [--dense | --long-tail [--packed]] [--threads 2] \
        [--rounds 3 | --serve]

A fresh process per case keeps one case's allocations, compiled code and allocator
state out of the next one's figures. The sequence is:

1. imports, the seeded inputs; then the peak resident set is reset and read: that is
   the baseline every peak is measured from;
2. one warm-up step (torch.compile of the peers happens here), untimed; its peak RSS
   is kept as ``first_step_rss_mb``;
3. the peak resident set is reset again, then the timed steps run: with ``--serve`` on
   the command "step" read from stdin (the pytest process times them), otherwise
   ``--rounds`` of them timed here;
4. after "finish" (or the rounds): the steady-state peak RSS, VmHWM minus the
   baseline, over the timed steps (what the warm-up left resident counts: compiled
   code, allocator caches);
5. one step under the PyTorch profiler with memory events: the allocator's view, the
   peak of live tensor bytes above those live before the step (the inputs); left out
   with ``--no-allocator-profile`` (a case's later processes: the first one has it).

Every message is one JSON line on the original stdout (library output goes to stderr).
The last one has "event": "done" and "status": "ok", "unavailable", "out of memory" or
"error". A cap on the address space (``--memory-cap-gb`` above the baseline) turns a
case too big for the machine into a clean "out of memory" instead of the kernel's OOM
killer picking a victim among everyone's processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
import traceback
from typing import Iterable, TextIO

import torch
from loss_impls import INPUTS, Shape, build_step, make_inputs

from hadw_kernels.tools.cli import summary

MB = 1024 * 1024
# Phrases the CPU allocator and Python use when an allocation fails.
OUT_OF_MEMORY_MARKS = ("can't allocate memory", "DefaultCPUAllocator", "out of memory")


def peak_rss_bytes() -> int:
    """VmHWM, this process's own high-water mark. Not ru_maxrss: exec folds the parent's
    resident set into it (a large pytest parent made every peak here read about 0)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Sets the kernel's high-water mark (VmHWM) back to the current RSS."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def virtual_size_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * resource.getpagesize()


def cap_address_space(cap_bytes: int) -> None:
    limit = virtual_size_bytes() + cap_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def allocator_peak_bytes(step) -> int:
    """Peak of live tensor bytes during ``step`` above those live when it starts, from
    the profiler's record of every allocation and free of the CPU allocator.

    The autograd profiler is what ``torch.profiler.profile`` wraps, and records the same
    events; the wrapper's start asks ``hasattr(torch, "_inductor")``, which imports
    inductor and dynamo in every process that profiles (docs/benchmarks.md, "What a case is")."""
    from torch.autograd.profiler import profile

    with profile(use_cpu=True, profile_memory=True) as profiler:
        step()
    memory_events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in memory_events:
        live += nbytes
        peak = max(peak, live)
    return peak


def failure_status(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or any(mark in text for mark in OUT_OF_MEMORY_MARKS):
        return "out of memory"
    return "error"


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300]


def run(args: argparse.Namespace, commands: Iterable[str], out: TextIO) -> None:
    def send(**message) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    torch.set_num_threads(args.threads)
    shape = Shape(args.prompts, args.group_size, args.length, args.hidden, args.vocab)
    try:
        impl_step = build_step(args.impl, args.input, shape, packed=args.packed, loss_type=args.loss_type)
    except Exception as error:  # an import error or an unavailable backend: a result
        send(event="done", status="unavailable", reason=first_line(error))
        return
    inputs = make_inputs(shape, args.input, dense=args.dense, lengths="long_tail" if args.long_tail else None,
                         packed=args.packed)

    def step() -> None:
        impl_step(inputs)

    gc.collect()
    if args.memory_cap_gb > 0:
        cap_address_space(int(args.memory_cap_gb * 1024 * MB))
    reset_peak_rss()
    baseline = peak_rss_bytes()
    report = {"baseline_rss_mb": baseline / MB, "threads": torch.get_num_threads()}
    phase = "warm-up"
    try:
        started = time.perf_counter()
        step()
        report["warmup_seconds"] = time.perf_counter() - started
        report["first_step_rss_mb"] = (peak_rss_bytes() - baseline) / MB
        gc.collect()
        reset_peak_rss()
        send(event="ready", **report)
        phase = "timed steps"
        seconds = []
        for command in commands:
            if command.strip() == "finish":
                break
            started = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - started)
            send(event="stepped", seconds=seconds[-1])
        report["rss_peak_mb"] = (peak_rss_bytes() - baseline) / MB
        if args.allocator_profile:
            # Last: the profiler keeps memory of its own resident after it ran.
            phase = "profiled step"
            report["alloc_peak_mb"] = allocator_peak_bytes(step) / MB
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        send(event="done", status=failure_status(error), reason=f"{phase}: {first_line(error)}", **report)
        return
    send(event="done", status="ok", seconds=seconds, **report)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--impl", required=True, help="bound, eager, hadw[<backend>(,recompute)], liger, cce or trl")
    parser.add_argument("--input", choices=INPUTS, required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dense", action="store_true", help="on-policy, no padding")
    parser.add_argument("--long-tail", action="store_true", help="lognormal response lengths, mean about T/10")
    parser.add_argument("--packed", action="store_true", help="the responses packed into segments, no padding")
    parser.add_argument("--loss-type", default="grpo", help="this library's loss type (Liger's of the same name)")
    parser.add_argument("--memory-cap-gb", type=float, default=16.0, help="0: no cap")
    parser.add_argument("--no-allocator-profile", dest="allocator_profile", action="store_false",
                        help="skip the profiled step at the end (no alloc_peak_mb)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rounds", type=int, default=1, help="timed steps run here")
    mode.add_argument("--serve", action="store_true", help="run a step per 'step' line on stdin")
    args = parser.parse_args(argv)

    # Keep the protocol on the original stdout; anything a library prints goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    commands = sys.stdin if args.serve else ["step"] * args.rounds
    run(args, commands, protocol)


if __name__ == "__main__":
    main()
    # Everything is reported; skip the interpreter's teardown of torch and the profiler,
    # paid once per case otherwise (docs/benchmarks.md, "What a case is").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
