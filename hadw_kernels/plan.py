"""Peak GPU memory of one GRPO training micro-step: ``python -m hadw_kernels.plan``.

An ESTIMATE from a model's shape, for the eager loss (fp32 logits) and the fused one,
with the largest group size G that fits a GPU. Example:

    python -m hadw_kernels.plan --model Qwen3-4B --group-size 8 --response-length 4096 \
        --gpus 8 --zero-stage 3

What is counted, per GPU, at the step's peak (the start of backward, when every saved
activation and the loss's own buffers are alive at once):

- Model states, mixed precision with Adam (the ZeRO paper's 2 + 2 + 12 bytes a
  parameter): bf16 parameters, bf16 gradients, fp32 master weights + Adam m and v.
  ZeRO stage 1 shards the fp32 states over the GPUs, stage 2 also the gradients,
  stage 3 also the parameters (plus a working set of gathered parameters: two decoder
  layers, the one computing and the one prefetched, and the LM head for the loss).
- Activations of the policy forward over the micro-batch: prompts x G sequences, each
  padded to prompt + response length, bf16, flash attention (no [S, S] scores), no
  dropout. Without gradient checkpointing every decoder layer keeps the tensors its
  backward reads: the input of each RMSNorm (2h), q, k, v and the attention output
  (2q + 2kv; Qwen3's q/k norms add their inputs, q + kv) and the SwiGLU's gate,
  silu(gate), up and their product (4 x intermediate). With checkpointing each layer
  keeps only its input (h), and one layer's full set is recomputed at a time, after the
  loss's buffers are freed (so the peak takes the larger of the two). The final hidden
  states of the response tokens, saved by the LM head, count in both cases.
- The loss part, over the response tokens only (trainers keep only those logits):
  eager holds, at its peak in backward, the fp32 log-softmax saved for backward, the
  gradient flowing into it and the gradient of the fp32 logits: 3 x 4 bytes a logit
  (its forward peak, bf16 logits + fp32 copy + log-softmax, is 10 bytes a logit).
  Fused holds no [N, V] tensor: fp32 gradient accumulators for the hidden states and
  the LM head, an fp32 copy of bf16 hidden states, and a few fp32 tiles of the torch
  backend's size (the Triton kernel's tiles live on chip: this bounds it from above).
- A fixed overhead (CUDA context, NCCL and DeepSpeed buffers, allocator fragmentation),
  4 GiB unless told otherwise.

Not counted: a reference model (beta = 0, or its log-probs computed before the step),
the rollout engine (assumed asleep or on other GPUs during training), CPU offload.
The loss part's formulas are checked against CPU peaks measured by the benchmark
(tests/test_plan.py); the rest is arithmetic on the stated assumptions.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from .backends.torch_backend import TOKEN_TILE, VOCAB_TILE

GIB = 1024**3
BF16 = 2
FP32 = 4
# Bytes a parameter: bf16 weights, bf16 gradients, fp32 master weights + Adam m + v.
PARAMETER_BYTES = BF16
GRADIENT_BYTES = BF16
OPTIMIZER_BYTES = 3 * FP32
EAGER_BYTES_PER_LOGIT = 3 * FP32
# Tiles alive at once in the torch backend's backward: logits, probabilities, the
# logits' gradient and one temporary.
LIVE_TILES = 4
DEFAULT_OVERHEAD_GIB = 4.0
A100_80GB_GIB = 80.0
LARGEST_GROUP_SEARCHED = 1 << 16


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer with grouped-query attention and a SwiGLU MLP."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        attention = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * self.layer_parameters + self.hidden

    @property
    def layer_activation_bytes_per_token(self) -> int:
        """bf16 bytes one decoder layer saves for backward, per token (see module doc)."""
        attention = 2 * self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += self.q_dim + self.kv_dim
        return BF16 * (4 * self.hidden + attention + 4 * self.intermediate)


# From the models' config.json on the Hugging Face Hub.
PRESETS = {
    "Qwen3-4B": ModelShape("Qwen3-4B", 2560, 9728, 36, 32, 8, 128, 151936, tied_embeddings=True, qk_norm=True),
    "Qwen3-8B": ModelShape("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, tied_embeddings=False, qk_norm=True),
    "Llama-3.2-3B": ModelShape(
        "Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, 128256, tied_embeddings=True, qk_norm=False
    ),
}


@dataclass(frozen=True)
class MicroStep:
    group_size: int
    prompts: int
    response_length: int
    prompt_length: int
    gpus: int
    zero_stage: int
    gradient_checkpointing: bool
    overhead_gib: float = DEFAULT_OVERHEAD_GIB

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("group_size", "prompts", "response_length", "gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompt_length < 0 or self.overhead_gib < 0:
            raise ValueError("prompt_length and overhead_gib must be non-negative")

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size

    @property
    def tokens(self) -> int:
        """Tokens through the model: every sequence padded to prompt + response."""
        return self.sequences * (self.prompt_length + self.response_length)

    @property
    def response_tokens(self) -> int:
        """Tokens the loss sees."""
        return self.sequences * self.response_length


def loss_part_bytes(tokens: int, hidden: int, vocab: int, *, fused: bool, dtype_bytes: int) -> dict[str, int]:
    """What the loss adds at its peak above its inputs (hidden states, LM head), by part.

    ``tokens`` are the response tokens, ``dtype_bytes`` the hidden states' element size
    (2 for bf16 on a GPU, 4 for the fp32 CPU benchmark).
    """
    if not fused:
        return {"eager: fp32 log-softmax + its gradient + the logits' gradient": EAGER_BYTES_PER_LOGIT * tokens * vocab}
    parts = {
        "fused: fp32 tiles": LIVE_TILES * min(tokens, TOKEN_TILE) * min(vocab, VOCAB_TILE) * FP32,
        "fused: fp32 gradient of the hidden states": FP32 * tokens * hidden,
        "fused: fp32 gradient of the LM head": FP32 * vocab * hidden,
    }
    if dtype_bytes < FP32:
        parts["fused: fp32 copy of the hidden states"] = FP32 * tokens * hidden
    return parts


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU. ``parts`` are alive together when the loss peaks (the start of
    backward); with checkpointing, ``recompute`` is one layer's recomputed activations,
    alive later in place of the loss part. ``peak`` is what must fit."""

    parts: dict[str, int]
    loss: int
    recompute: int

    @property
    def at_loss_peak(self) -> int:
        return sum(self.parts.values())

    @property
    def at_recompute(self) -> int:
        return self.at_loss_peak - self.loss + self.recompute

    @property
    def peak(self) -> int:
        return max(self.at_loss_peak, self.at_recompute)

    def fits(self, gpu_gib: float) -> bool:
        return self.peak <= gpu_gib * GIB


def estimate(model: ModelShape, step: MicroStep, *, fused: bool) -> Estimate:
    parameters = model.parameters
    stage = step.zero_stage
    shard = step.gpus
    parts = {
        "bf16 parameters": PARAMETER_BYTES * parameters // (shard if stage >= 3 else 1),
        "bf16 gradients": GRADIENT_BYTES * parameters // (shard if stage >= 2 else 1),
        "fp32 master weights + Adam m, v": OPTIMIZER_BYTES * parameters // (shard if stage >= 1 else 1),
    }
    if stage == 3:
        parts["ZeRO-3 gathered: 2 layers + LM head"] = BF16 * (2 * model.layer_parameters + model.vocab * model.hidden)
    layer_set = model.layer_activation_bytes_per_token * step.tokens
    if step.gradient_checkpointing:
        parts["activations: checkpointed layer inputs"] = BF16 * model.hidden * model.layers * step.tokens
    else:
        parts["activations: every layer's saved tensors"] = layer_set * model.layers
    parts["final hidden states (saved by the LM head)"] = BF16 * model.hidden * step.response_tokens
    parts["overhead (CUDA context, NCCL/DeepSpeed buffers, fragmentation)"] = int(step.overhead_gib * GIB)
    loss = loss_part_bytes(step.response_tokens, model.hidden, model.vocab, fused=fused, dtype_bytes=BF16)
    parts.update(loss)
    recompute = layer_set if step.gradient_checkpointing else 0
    return Estimate(parts, loss=sum(loss.values()), recompute=recompute)


def largest_group_size(model: ModelShape, step: MicroStep, *, fused: bool, gpu_gib: float) -> int:
    """The largest G whose micro-step fits ``gpu_gib``; 0 if not even G = 1 fits.

    Memory grows with G, so the search stops at the first G that does not fit.
    """
    largest = 0
    for group_size in range(1, LARGEST_GROUP_SEARCHED + 1):
        candidate = dataclasses.replace(step, group_size=group_size)
        if not estimate(model, candidate, fused=fused).fits(gpu_gib):
            break
        largest = group_size
    return largest


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:8.2f}"


def format_report(model: ModelShape, step: MicroStep, gpu_gib: float) -> str:
    eager = estimate(model, step, fused=False)
    fused = estimate(model, step, fused=True)
    width = 66
    lines = [
        f"ESTIMATE of peak GPU memory, one micro-step: {model.name} ({model.parameters / 1e9:.2f}B parameters, "
        f"H={model.hidden}, V={model.vocab}, {model.layers} layers)",
        f"G={step.group_size} x {step.prompts} prompt(s) = {step.sequences} sequences of "
        f"{step.prompt_length}+{step.response_length} tokens; {step.gpus} GPUs, ZeRO-{step.zero_stage}, "
        f"gradient checkpointing {'on' if step.gradient_checkpointing else 'off'}",
        "",
        f"{'GiB per GPU':<{width}}{'eager':>8}  {'fused':>8}",
    ]
    for name in dict.fromkeys([*eager.parts, *fused.parts]):
        lines.append(f"{name:<{width}}{_gib(eager.parts.get(name, 0))}  {_gib(fused.parts.get(name, 0))}")
    lines.append(f"{'= at the loss peak (start of backward)':<{width}}{_gib(eager.at_loss_peak)}  {_gib(fused.at_loss_peak)}")
    if step.gradient_checkpointing:
        lines.append(
            f"{'= later, one layer recomputed instead of the loss part':<{width}}"
            f"{_gib(eager.at_recompute)}  {_gib(fused.at_recompute)}"
        )
    lines.append(f"{'PEAK':<{width}}{_gib(eager.peak)}  {_gib(fused.peak)}")
    lines.append("")
    for label, result in (("eager", eager), ("fused", fused)):
        verdict = "fits" if result.fits(gpu_gib) else "does NOT fit"
        largest = largest_group_size(model, step, fused=label == "fused", gpu_gib=gpu_gib)
        lines.append(
            f"{label}: {verdict} in {gpu_gib:g} GiB; largest G that fits: {largest}"
            + ("" if largest else " (not even G=1)")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="Qwen3-4B")
    parser.add_argument("--group-size", "-G", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=1, help="prompts per micro-step (each with G responses)")
    parser.add_argument("--response-length", type=int, default=4096)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3)
    parser.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
        help="checkpoint every decoder layer (default on)",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=A100_80GB_GIB, help="default: an 80 GB A100")
    parser.add_argument("--overhead-gib", type=float, default=DEFAULT_OVERHEAD_GIB)
    args = parser.parse_args(argv)
    step = MicroStep(
        group_size=args.group_size,
        prompts=args.prompts,
        response_length=args.response_length,
        prompt_length=args.prompt_length,
        gpus=args.gpus,
        zero_stage=args.zero_stage,
        gradient_checkpointing=args.gradient_checkpointing,
        overhead_gib=args.overhead_gib,
    )
    print(format_report(PRESETS[args.model], step, args.gpu_memory_gib))


if __name__ == "__main__":
    main()
