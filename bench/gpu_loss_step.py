"""The GPU check's loss-step sections and their report lines: one loss step (forward +
backward from hidden states) of every implementation against the bound and eager, case by
case; the surrogate alone, from log-probs; and the loss step's peak memory at the paper's
scale against the memory planner's loss part.

The rows run the CPU benchmark's implementations, inputs and bound (bench/loss_impls.py,
its PEERS the GPU's peers too): one copy, so a change to a call reaches both.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from gpu_progress import say

if TYPE_CHECKING:  # loaded where the benchmarks run: it imports torch
    from loss_impls import Inputs, Shape, Step


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
    """The rows of a case's table: their labels (docs/benchmarks.md, "On a GPU"'s) -> the loss_impls
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


def paper_scale(group_sizes: list[int], width: int, hidden: int, vocab: int) -> list[dict]:
    """Peak memory of one loss step at Qwen3-4B's head, one prompt x G responses."""
    import torch
    from loss_impls import Shape

    from hadw_kernels.tools import plan

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



def sizes(dry_run: bool, rounds: int) -> dict:
    """The sections' shapes and rounds: ``cases`` (one table each), ``surrogate`` (its
    shape), ``paper`` (its G values, T, H and V)."""
    from loss_impls import Shape

    if dry_run:
        # The same code on the CPU with tiny shapes (Triton in its interpreter), so that
        # it cannot rot; the figures mean nothing.
        tiny = Shape(1, 2, 16, 32, 300)
        return dict(cases=[Case("tiny", tiny, "float32"), Case("tiny", tiny, "bfloat16", padded=True, block_rows=(16,))],
                    surrogate=Shape(1, 8, 16, 32, 300), paper=([2, 4], 16, 32, 300), rounds=1)
    # P x G responses of T tokens, H and V the LM head's (V only sets the log-probs'
    # scale in the surrogate's case).
    qwen3_4b_head = Shape(1, 2, 4096, 2560, 151936)
    small = Shape(1, 8, 256, 512, 32768)
    return dict(cases=[
        Case("Qwen3-4B head", qwen3_4b_head, "bfloat16", block_rows=(2048, 8192)),
        Case("Qwen3-4B head", qwen3_4b_head, "bfloat16", padded=True),
        Case("small dense shape", small, "bfloat16"),
        Case("small dense shape", small, "float32"),
        Case("Qwen vocabulary", Shape(1, 4, 256, 1024, 151936), "float32"),
    ], surrogate=Shape(32, 8, 4096, 2560, 151936), paper=([8, 16, 32, 64], 4096, 2560, 151936), rounds=rounds)


def _ratio(value, reference) -> str:
    if value is None or reference is None:
        return "n/a"
    return f"{value / reference:.2f}x"


def loss_step_lines(bench: list[tuple[Case, dict[str, Timing]]]) -> list[str]:
    lines = ["", "## Loss step: forward + backward from hidden states", "",
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
    return lines


def surrogate_lines(surrogate: list[tuple[str, dict]]) -> list[str]:
    lines = ["## The surrogate alone, from log-probs", "",
             "Wall: one call + backward from Python (launch overhead included). Graph: the same replayed as "
             "a CUDA graph (GPU time only).", "", "| dtype | implementation | wall us | graph us |",
             "| --- | --- | ---: | ---: |"]
    for dtype_name, row in surrogate:
        for name, (wall, graph) in row.items():
            wall_text = "failed" if wall is None else f"{wall * 1e3:.1f}"
            graph_text = "n/a" if graph is None else f"{graph * 1e3:.1f}"
            lines.append(f"| {dtype_name} | {name} | {wall_text} | {graph_text} |")
    lines.append("")
    return lines


def paper_lines(paper: list[dict], dry_run: bool) -> list[str]:
    lines = ["## The paper's scale: Qwen3-4B head, one prompt x G responses of 4096 tokens, bf16", "",
             "Peak memory of the loss step above its inputs; the planner's loss part "
             "(`hadw_kernels.tools.plan.loss_part_bytes`) beside it.", "",
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
    return lines
