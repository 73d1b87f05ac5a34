"""Which cases the benchmark runs: implementations x inputs x shapes x threads.

Shapes are scaled to the 2-core CPU machine of docs/benchmarks.md, shared with other work.

- The G sweep: one prompt x G responses of T = 32 tokens (padded), H = 512, V = 32768,
  G = 8..64, two threads: memory and time as G grows. Eager's three [B*T, V] fp32
  copies stay small (docs/benchmarks.md, "Shapes"); Liger's chunks (one response each) re-touch the whole [V, H]
  LM-head gradient once per response, which this keeps affordable.
- The dense on-policy cases (the first mini-batch of a GRPO step: ratio 1,
  no padding, every token with a gradient), where the GEMMs dominate and the bound is
  what counts: B = 8, T = 256, H = 512, V = 32768 and Qwen3's vocabulary, B = 4, T = 256,
  H = 1024, V = 151936, at one and two threads; and the first of them padded, beside.
  Each implementation of a dense case runs in several fresh processes, in turns with
  the others (see DENSE_PROCESSES).
- The surrogate alone (from log-probs) from 16k tokens up, where it must not be slower
  than eager, and at the paper's rollout, B = 256 responses of T = 4096: one and two
  threads.
- Long-tailed lengths (lognormal, mean about T/10: reasoning traces), padded against
  packed (padding-free): from hidden states at P = 2 x G = 8, T = 1024, H = 512,
  V = 32768, and the surrogate alone at the paper's rollout, B = 256, T = 4096; two
  threads.
- The objectives: every loss type (presets.LOSS_PRESETS) from hidden states at B = 8,
  T = 256, H = 512, V = 32768, padded, two threads, beside Liger's loss of the same name
  (TRL's eight), and GRPO's bound and eager baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from loss_impls import BASELINE, BOUND, CPU_PEERS, Shape, hadw_impl

GROUP_SIZES = (8, 16, 32, 64)
SWEEP = dict(prompts=1, length=32, hidden=512, vocab=32768)
DENSE_SHAPES = (
    Shape(prompts=1, group_size=8, length=256, hidden=512, vocab=32768),
    Shape(prompts=1, group_size=4, length=256, hidden=1024, vocab=151936),
)
# H and V do not enter the log-prob loss.
SURROGATE_SHAPES = (
    Shape(prompts=8, group_size=8, length=256, hidden=512, vocab=32768),
    Shape(prompts=32, group_size=8, length=4096, hidden=512, vocab=32768),
)
QUICK = Shape(prompts=1, group_size=8, length=32, hidden=256, vocab=8192)
# The padded two-thread table of DENSE_SHAPES[0]: its GRPO rows are the objectives' baseline.
OBJECTIVE_SHAPE = DENSE_SHAPES[0]
# The quick run's objectives: one of each kind (a detached weight, a soft gate, a
# sequence-level weight), so CI runs their cases.
QUICK_LOSS_TYPES = ("cispo", "sapo", "vespo")
LONG_TAIL_SHAPES = {
    "hidden": Shape(prompts=2, group_size=8, length=1024, hidden=512, vocab=32768),
    "logprobs": Shape(prompts=32, group_size=8, length=4096, hidden=512, vocab=32768),
}

FULL_ROUNDS = 3
QUICK_ROUNDS = 2
# Short steps get more rounds, up to MOST_ROUNDS, until this many seconds of them are
# timed: the scheduler's noise on a shared machine is of the order of a short step, and
# the min of a few rounds of a longer one still moved between runs.
FULL_TIMED_SECONDS = 6.0
# The dense cases, where a ratio to the bound of a few percent is the question. Here a
# whole process can run slow, the bound's as much as anyone's, by more than that question
# (docs/benchmarks.md, "What a case is"). So, as pyperf does, every
# implementation of a dense case runs in DENSE_PROCESSES fresh processes, taken in turns
# with the other implementations' (bound, eager, ..., bound, eager, ...), and its time is
# the median of the processes' mins; each process times at least DENSE_ROUNDS rounds and
# DENSE_TIMED_SECONDS of them.
DENSE_PROCESSES = 3
DENSE_TIMED_SECONDS = 8.0
DENSE_ROUNDS = 3
# The quick run takes two, so that CI runs the combining of processes too.
QUICK_DENSE_PROCESSES = 2
QUICK_TIMED_SECONDS = 0.5
MOST_ROUNDS = 100
SWEEP_THREADS = 2


def timed_seconds_for(dense: bool, quick: bool) -> float:
    if quick:
        return QUICK_TIMED_SECONDS
    return DENSE_TIMED_SECONDS if dense else FULL_TIMED_SECONDS


def least_rounds_for(dense: bool, quick: bool, configured: int) -> int:
    """The configured rounds (--bench-rounds, or the mode's default), DENSE_ROUNDS at least
    in a dense case of the full run."""
    return max(configured, DENSE_ROUNDS) if dense and not quick else configured


def dense_processes(quick: bool) -> int:
    return QUICK_DENSE_PROCESSES if quick else DENSE_PROCESSES


def rounds_for(step_seconds: float, configured: int, timed_seconds: float) -> int:
    if step_seconds <= 0:
        return MOST_ROUNDS
    return max(configured, min(MOST_ROUNDS, int(timed_seconds / step_seconds)))


@dataclass(frozen=True)
class Case:
    input_kind: str
    impl: str
    shape: Shape
    threads: int = SWEEP_THREADS
    dense: bool = False
    # Lognormal response lengths (mean about T/10), padded or packed into segments.
    long_tail: bool = False
    packed: bool = False
    loss_type: str = "grpo"
    # This is fresh process `process` (0-based) of `processes` that time the case.
    process: int = 0
    processes: int = 1

    @property
    def kind(self) -> str:
        if self.dense:
            return "dense"
        return ("long-tail-packed" if self.packed else "long-tail-padded") if self.long_tail else "padded"

    def worker_args(self) -> list[str]:
        flags = {"dense": ["--dense"], "padded": [], "long-tail-padded": ["--long-tail"],
                 "long-tail-packed": ["--long-tail", "--packed"]}
        return flags[self.kind] + ([] if self.loss_type == "grpo" else ["--loss-type", self.loss_type])

    @property
    def id(self) -> str:
        kind = self.kind if self.loss_type == "grpo" else f"{self.kind}-{self.loss_type}"
        of_processes = f"-process{self.process + 1}of{self.processes}" if self.processes > 1 else ""
        return f"{self.input_kind}-{self.impl}-P{self.shape.prompts}-G{self.shape.group_size}-T{self.shape.length}-V{self.shape.vocab}-" \
               f"{kind}-{self.threads}t{of_processes}"


def implementations(input_kind: str, backends: tuple[str, ...]) -> list[str]:
    """Every implementation with a row in the table, whether or not it can run here."""
    ours = [hadw_impl(backend) for backend in backends]
    if input_kind == "logprobs":
        return [BASELINE, *ours]
    # The gradients-in-forward backends also run their recompute path, for comparison.
    recompute = [hadw_impl(backend, "recompute") for backend in backends if backend != "torch"]
    return [BOUND, BASELINE, *ours, *recompute, *CPU_PEERS]


def dense_cases(impls: list[str], shape: Shape, threads: int, processes: int) -> list[Case]:
    """Every implementation's processes of a dense case, in turns: round r runs process r
    of each implementation, so a slow stretch of the machine falls on all of them."""
    return [Case("hidden", impl, shape, threads, dense=True, process=process, processes=processes)
            for process in range(processes) for impl in impls]


def long_tail_cases(impls: list[str], input_kind: str, shape: Shape) -> list[Case]:
    """Every implementation on long-tailed lengths, padded, then packed (the same responses)."""
    return [Case(input_kind, impl, shape, long_tail=True, packed=packed) for packed in (False, True) for impl in impls]


def objective_cases(backends: tuple[str, ...], shape: Shape, loss_types) -> list[Case]:
    """Each loss type but GRPO on the gradients-in-forward backends (their default path:
    the recompute path for sequence-level objectives) and on Liger where it has the loss
    type: they join the padded table of ``shape``, whose GRPO rows (bound, eager, every
    implementation) they are rated against."""
    from loss_impls import LIGER_LOSS_TYPES

    ours = [hadw_impl(backend) for backend in backends if backend != "torch"]
    return [Case("hidden", impl, shape, loss_type=loss_type)
            for loss_type in loss_types if loss_type != "grpo"
            for impl in [*ours, *(["liger"] if loss_type in LIGER_LOSS_TYPES else [])]]


def cases(quick: bool, backends: tuple[str, ...]) -> list[Case]:
    from hadw_kernels.config.presets import LOSS_TYPES

    hidden_impls = implementations("hidden", backends)
    logprob_impls = implementations("logprobs", backends)
    if quick:
        return [
            *dense_cases(hidden_impls, QUICK, SWEEP_THREADS, dense_processes(quick=True)),
            *(Case("hidden", impl, QUICK) for impl in hidden_impls),
            *(Case("logprobs", impl, QUICK) for impl in logprob_impls),
            *long_tail_cases(hidden_impls, "hidden", QUICK),
            *long_tail_cases(logprob_impls, "logprobs", QUICK),
            *objective_cases(backends, QUICK, QUICK_LOSS_TYPES),
        ]
    sweep = [Shape(group_size=g, **SWEEP) for g in GROUP_SIZES]
    out = [Case("hidden", impl, shape) for shape in sweep for impl in hidden_impls]
    # The log-prob loss does not see V or H.
    out += [Case("logprobs", impl, shape) for shape in sweep for impl in logprob_impls]
    for shape in DENSE_SHAPES:
        for threads in (1, 2):
            out += dense_cases(hidden_impls, shape, threads, dense_processes(quick=False))
    out += [Case("hidden", impl, DENSE_SHAPES[0], 2, dense=False) for impl in hidden_impls]
    for shape in SURROGATE_SHAPES:
        out += [Case("logprobs", impl, shape, threads) for threads in (1, 2) for impl in logprob_impls]
    out += long_tail_cases(hidden_impls, "hidden", LONG_TAIL_SHAPES["hidden"])
    out += long_tail_cases(logprob_impls, "logprobs", LONG_TAIL_SHAPES["logprobs"])
    out += objective_cases(backends, OBJECTIVE_SHAPE, LOSS_TYPES)
    return out
