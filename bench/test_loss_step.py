"""Forward+backward time and peak memory of one GRPO loss step, per case.

Each case runs in a fresh process (``worker.py``; a dense case in several, one test
each, combined in the table); pytest-benchmark drives the timed rounds, one step of that
process per round, and the table takes the process's own clock. A case that cannot run
here (missing package, unavailable backend, out of memory, crash) is still a row in the
table, with its reason; for a peer or the baseline the test is skipped with that reason,
for this library's own timed backends it fails.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import matrix
import pytest
import torch
from fresh_process import CaseFailed, Worker
from loss_impls import backend_of, response_lengths

INTERPRETER_ONLY = "interpreter only here, not timed"
MEMORY_FIELDS = ("alloc_peak_mb", "rss_peak_mb", "first_step_rss_mb", "baseline_rss_mb", "warmup_seconds")


def untimed_reason(impl: str) -> str | None:
    """Why a backend of this library is not timed here, or None if it is."""
    from hadw_kernels.backends import BackendUnavailable, load_backend

    backend = backend_of(impl)
    if backend is None:
        return None
    if backend == "triton" and not torch.cuda.is_available():
        return INTERPRETER_ONLY
    try:
        load_backend(backend)
    except BackendUnavailable as error:
        return str(error)
    return None


def test_loss_step(case, benchmark, bench_settings, record_row):
    shape = case.shape
    # Long-tailed cases count valid tokens (the padded and packed rows do the same work).
    tokens = int(response_lengths(shape, "long_tail").sum()) if case.long_tail else shape.tokens
    row = {"input": case.input_kind, "impl": case.impl, **dataclasses.asdict(shape), "tokens": tokens,
           "threads": case.threads, "dense": case.dense, "long_tail": case.long_tail, "packed": case.packed,
           "loss_type": case.loss_type,
           "process": case.process, "processes": case.processes}
    reason = untimed_reason(case.impl)
    if reason == INTERPRETER_ONLY:
        record_row({**row, "status": INTERPRETER_ONLY})
        pytest.skip(f"{case.impl}: {reason}")
    if reason is not None:
        record_row({**row, "status": "unavailable", "reason": reason})
        pytest.skip(f"{case.impl}: {reason}")

    benchmark.group = f"{case.input_kind} {shape.label} {case.kind} {case.threads}t"
    worker = Worker(
        ["--impl", case.impl, "--input", case.input_kind, *shape.as_args(), *case.worker_args(),
         # The allocator's peak does not depend on the process: the first one measures it.
         *(["--no-allocator-profile"] if case.process > 0 else [])],
        threads=case.threads,
        memory_cap_gb=bench_settings["memory_cap_gb"],
    )
    try:
        ready = worker.ready()
        quick = bench_settings["quick"]
        rounds = matrix.rounds_for(ready["warmup_seconds"],
                                   matrix.least_rounds_for(case.dense, quick, bench_settings["rounds"]),
                                   matrix.timed_seconds_for(case.dense, quick))
        benchmark.pedantic(worker.step, rounds=rounds, iterations=1)
        report = worker.finish()
    except CaseFailed as failure:
        memory = {key: failure.report[key] for key in MEMORY_FIELDS if key in failure.report}
        record_row({**row, **memory, "status": failure.status, "reason": failure.reason})
        if backend_of(case.impl) is not None:
            pytest.fail(f"{case.impl} failed: {failure}")
        pytest.skip(f"{case.impl} cannot run here: {failure}")
    finally:
        worker.close()

    # The table takes the worker's own clock: the pytest-side times add a pipe round trip
    # and a process wake-up, noise of the order of a log-prob step's few milliseconds.
    seconds = {
        "time_median_s": statistics.median(worker.step_seconds),
        "time_min_s": min(worker.step_seconds),
        "time_rounds": len(worker.step_seconds),
    }
    if benchmark.stats is not None:  # None under --benchmark-disable
        seconds["roundtrip_median_s"] = benchmark.stats.stats.median
    memory = {key: report[key] for key in MEMORY_FIELDS if key in report}
    benchmark.extra_info.update(memory, tokens=shape.tokens, worker_median_s=seconds["time_median_s"])
    # The case's own threads count ~1-2: above that, other work shared the cores.
    record_row({**row, **memory, **seconds, "status": "ok", "load_1min": os.getloadavg()[0]})
