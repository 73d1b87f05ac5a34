"""Which cases the benchmark runs: implementations x inputs x shapes.

Shapes are scaled to a 2-core, 24 GiB CPU machine shared with other work. The group
size G is the swept variable: a micro-batch holds ``prompts`` x G responses of T
tokens. From the natural 4 prompts x T = 256, both are scaled down, to 1 prompt (one
group a micro-batch) and T = 32, so that the full sweep (every implementation at every
G, each with a warm-up, three timed steps and a profiled step) stays within 15 minutes
on two cores: the fp32 LM-head GEMMs cost ~6-8 V H flops a token, and Liger's chunks
(one response each) re-touch the whole [V, H] LM-head gradient once per response, so
one prompt's G responses cost Liger 4x less than 4 prompts' at the same token count.
Eager's three [B*T, V] fp32 copies stay under 1 GB. One extra shape has Qwen3's
vocabulary, V = 151936.
"""

from __future__ import annotations

from dataclasses import dataclass

from loss_impls import BASELINE, PEERS, Shape, hadw_impl

GROUP_SIZES = (8, 16, 32, 64)
SWEEP = dict(prompts=1, length=32, hidden=512, vocab=32768)
QWEN3_VOCAB = Shape(prompts=1, group_size=8, length=32, hidden=512, vocab=151936)
QUICK = Shape(prompts=1, group_size=8, length=32, hidden=256, vocab=8192)

FULL_ROUNDS = 3
QUICK_ROUNDS = 2
# Steps of a few milliseconds get more rounds, up to this many, so that at least
# SHORTEST_TIMED_SECONDS of them are timed: the scheduler's noise on a shared machine is
# of their order.
MOST_ROUNDS = 100
SHORTEST_TIMED_SECONDS = 0.5


def rounds_for(step_seconds: float, configured: int) -> int:
    if step_seconds <= 0:
        return MOST_ROUNDS
    return max(configured, min(MOST_ROUNDS, int(SHORTEST_TIMED_SECONDS / step_seconds)))


@dataclass(frozen=True)
class Case:
    input_kind: str
    impl: str
    shape: Shape

    @property
    def id(self) -> str:
        return f"{self.input_kind}-{self.impl}-G{self.shape.group_size}-V{self.shape.vocab}"


def implementations(input_kind: str, backends: tuple[str, ...]) -> list[str]:
    """Every implementation with a row in the table, whether or not it can run here."""
    ours = [hadw_impl(backend) for backend in backends]
    if input_kind == "logprobs":
        return [BASELINE, *ours]
    return [BASELINE, *ours, *PEERS]


def cases(quick: bool, backends: tuple[str, ...]) -> list[Case]:
    if quick:
        shapes_by_input = {"hidden": [QUICK], "logprobs": [QUICK]}
    else:
        sweep = [Shape(group_size=g, **SWEEP) for g in GROUP_SIZES]
        # The log-prob loss does not see V: the Qwen3 vocabulary matters to the
        # hidden-state cases only.
        shapes_by_input = {"hidden": [*sweep, QWEN3_VOCAB], "logprobs": sweep}
    return [
        Case(input_kind, impl, shape)
        for input_kind, shapes in shapes_by_input.items()
        for shape in shapes
        for impl in implementations(input_kind, backends)
    ]
