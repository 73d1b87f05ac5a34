"""Peak GPU memory of one GRPO training micro-step: ``python -m hadw_kernels.tools.plan``.

An ESTIMATE from a model's shape, for the eager loss (fp32 logits) and the fused one,
with the largest group size G that fits a GPU. Example:

    python -m hadw_kernels.tools.plan --model Qwen3-4B --group-size 8 --response-length 4096 \
        --gpus 8 --zero-stage 3

``--budget`` speaks in token budgets instead: the largest number of tokens (prompt +
response, whole sequences) one micro-batch can hold with each loss. A trainer that packs
micro-batches by tokens rather than by whole groups (``python -m trainer.tools.probe
--micro-batch-tokens``) trains any G: a group of G responses becomes ceil(G / k)
micro-batches of k sequences with their gradients accumulated, so the micro-step's
memory no longer grows with G (only the number of micro-batches, hence the time, does).

    python -m hadw_kernels.tools.plan --budget --model Qwen3-1.7B --response-length 4096 --gpus 1 --zero-stage 2

What is counted, per GPU, at the step's peak (the start of backward, when every saved
activation and the loss's own buffers are alive at once):

- Model states, mixed precision with Adam (the ZeRO paper's 2 + 2 + 12 bytes a
  parameter): bf16 parameters, bf16 gradients, fp32 master weights + Adam m and v.
  ZeRO stage 1 shards the fp32 states over the GPUs, stage 2 also the gradients,
  stage 3 also the parameters (plus a working set of gathered parameters: two decoder
  layers, the one computing and the one prefetched, and the LM head for the loss).
  At the optimizer step, when the activations are gone, DeepSpeed also holds the fp32
  gradients of its partition and a bf16 copy of the updated weights (6 bytes a
  parameter, sharded as the fp32 states): the peak of a step whose activations are small.
- Activations of the policy forward over the micro-batch: prompts x G sequences, each
  padded to prompt + response length (or, with ``--share-prompt``, each prompt laid out
  once for its G responses: P - 1 + G x R tokens a prompt, the trainer's shared-prompt
  packing), bf16, flash attention (no [S, S] scores), no dropout. Without gradient checkpointing every decoder layer keeps the tensors its
  backward reads: the input of each RMSNorm (2h), q, k, v and the attention output
  (2q + 2kv; Qwen3's q/k norms add their inputs, q + kv) and the SwiGLU's gate,
  silu(gate), up and their product (4 x intermediate). With checkpointing each layer
  keeps only its input (h), and one layer's full set is recomputed at a time, after the
  loss's buffers are freed (so the peak takes the larger of the two). The final hidden
  states of the response tokens, saved by the LM head, count in both cases.
- The loss part, over the response tokens only (trainers keep only those logits):
  eager holds, at its peak in backward, the fp32 log-softmax saved for backward, the
  gradient flowing into it, the bf16 logits and their fp32 copy: 14 bytes a logit
  (measured: docs/benchmarks.md, "On a GPU").
  Fused (the Triton path) holds no [N, V] tensor: the logits of one block of rows, the
  gradients of the hidden states and the LM head (with an fp32 accumulator for a bf16
  head over several blocks) and a few per-token vectors (loss_part_bytes).
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

from ..tables.linear_blocks import block_rows_for, head_accumulator_bytes
from .cli import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, HelpFormatter, summary

GIB = 1024**3
BF16 = 2
FP32 = 4
# Bytes a parameter: bf16 weights, bf16 gradients, fp32 master weights + Adam m + v.
PARAMETER_BYTES = BF16
GRADIENT_BYTES = BF16
OPTIMIZER_BYTES = 3 * FP32
# Bytes a parameter DeepSpeed adds at the optimizer step: the fp32 gradients of its
# partition and a bf16 copy of the updated weights (measured: docs/benchmarks.md, "On a GPU").
STEP_BYTES = FP32 + BF16
# The linear path's per-token vectors: int64 row index, fp32 log-probs, entropy, lse,
# mean logit, the token gradients, and the per-token advantage, weight and old log-prob.
PER_TOKEN_BYTES = 8 + 10 * FP32
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
        """Bytes one decoder layer saves for backward, per token (see module doc): bf16
        tensors and the RMSNorms' fp32 copies of their inputs."""
        attention = 2 * self.q_dim + 2 * self.kv_dim
        normed = 2 * self.hidden
        if self.qk_norm:
            attention += self.q_dim + self.kv_dim
            normed += self.q_dim + self.kv_dim
        return BF16 * (4 * self.hidden + attention + 4 * self.intermediate) + FP32 * normed

    @property
    def layer_gradient_bytes_per_token(self) -> int:
        """bf16 bytes of one decoder layer's gradients alive together in its backward, per
        token: the SwiGLU's gate and up gradients and the hidden states' in and out."""
        return BF16 * (2 * self.intermediate + 2 * self.hidden)


# From the models' config.json on the Hugging Face Hub.
PRESETS = {
    "Qwen3-0.6B": ModelShape("Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936, tied_embeddings=True, qk_norm=True),
    "Qwen3-1.7B": ModelShape("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936, tied_embeddings=True, qk_norm=True),
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
    share_prompt: bool = False

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
        """Tokens through the model: every sequence padded to prompt + response, or each
        prompt once but its last token, which starts every response's branch."""
        if self.share_prompt:
            return self.prompts * (max(self.prompt_length - 1, 0) + self.group_size * self.response_length)
        return self.sequences * (self.prompt_length + self.response_length)

    @property
    def response_tokens(self) -> int:
        """Tokens the loss sees."""
        return self.sequences * self.response_length


def loss_part_bytes(tokens: int, hidden: int, vocab: int, *, fused: bool, dtype_bytes: int,
                    block_rows: int | None = None) -> dict[str, int]:
    """What the loss step adds at its peak above its inputs (hidden states, LM head), by
    part, on a GPU (the Triton path: gradients formed in the forward, dense rows).

    ``tokens`` are the response tokens, ``dtype_bytes`` the hidden states' element size,
    ``block_rows`` the rows whose logits are held at once (default: the library's).
    """
    if not fused:
        # The logits, their fp32 copy (16-bit models), the fp32 log-softmax and its
        # gradient alive together: 14 bytes a logit for bf16 (measured on an H100,
        # docs/benchmarks.md, "On a GPU"), 12 for fp32 (measured on the CPU, tests/test_plan.py).
        per_logit = dtype_bytes + (FP32 if dtype_bytes < FP32 else 0) + 2 * FP32
        return {"eager: logits, their fp32 copy, the log-softmax and its gradient": per_logit * tokens * vocab}
    accumulator = head_accumulator_bytes(vocab, hidden, dtype_bytes)
    block_rows = min(tokens, block_rows_for(tokens, vocab, dtype_bytes, "cuda", block_rows, accumulator))
    parts = {
        "fused: logits of one block of rows": block_rows * vocab * dtype_bytes,
        "fused: gradient of the hidden states": dtype_bytes * tokens * hidden,
        "fused: gradient of the LM head": dtype_bytes * vocab * hidden,
        "fused: per-token values (log-probs, entropy, lse, advantages, weights, row index)": PER_TOKEN_BYTES * tokens,
    }
    if tokens > block_rows and accumulator:
        parts["fused: fp32 accumulator of the LM head's gradient (several blocks)"] = accumulator
    return parts


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU. ``parts`` are alive together when the loss peaks (the start of
    backward); with checkpointing, ``recompute`` is one layer's recomputed activations,
    alive later in place of the loss part. ``peak`` is what must fit."""

    parts: dict[str, int]
    loss: int
    recompute: int
    activations: int  # the parts that are activations, gone by the optimizer step
    optimizer_step: int  # what the optimizer step adds then

    @property
    def at_loss_peak(self) -> int:
        return sum(self.parts.values())

    @property
    def at_recompute(self) -> int:
        return self.at_loss_peak - self.loss + self.recompute

    @property
    def at_optimizer_step(self) -> int:
        return self.at_loss_peak - self.loss - self.activations + self.optimizer_step

    @property
    def peak(self) -> int:
        return max(self.at_loss_peak, self.at_recompute, self.at_optimizer_step)

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
        activations = {"activations: checkpointed layer inputs": BF16 * model.hidden * model.layers * step.tokens}
    else:
        activations = {"activations: every layer's saved tensors": layer_set * model.layers}
    activations["final hidden states (saved by the LM head)"] = BF16 * model.hidden * step.response_tokens
    parts.update(activations)
    parts["overhead (CUDA context, NCCL/DeepSpeed buffers, fragmentation)"] = int(step.overhead_gib * GIB)
    loss = loss_part_bytes(step.response_tokens, model.hidden, model.vocab, fused=fused, dtype_bytes=BF16)
    parts.update(loss)
    # With checkpointing, one layer recomputed beside its gradients; without, its gradients
    # beside every layer's saved set (already counted).
    gradients = model.layer_gradient_bytes_per_token * step.tokens
    recompute = layer_set + gradients if step.gradient_checkpointing else gradients
    step_bytes = STEP_BYTES * parameters // (shard if stage >= 1 else 1)
    return Estimate(parts, loss=sum(loss.values()), recompute=recompute, activations=sum(activations.values()),
                    optimizer_step=step_bytes)


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


def largest_token_budget(model: ModelShape, step: MicroStep, *, fused: bool, gpu_gib: float) -> int:
    """The largest micro-batch token budget that fits ``gpu_gib``, in tokens through the
    model: k whole sequences of prompt + response tokens (with ``share_prompt``, k
    responses after one prompt), k the largest that fits (0 if not even one response does).

    ``step``'s group size and prompts are ignored: a micro-batch packed by tokens holds k
    sequences whatever G is.
    """
    one_prompt = dataclasses.replace(step, prompts=1, group_size=1)
    sequences = largest_group_size(model, one_prompt, fused=fused, gpu_gib=gpu_gib)
    return dataclasses.replace(one_prompt, group_size=max(sequences, 1)).tokens if sequences else 0


def format_budget_report(model: ModelShape, step: MicroStep, gpu_gib: float) -> str:
    sequence = step.prompt_length + step.response_length
    lines = [
        f"ESTIMATE of the largest micro-batch token budget: {model.name} ({model.parameters / 1e9:.2f}B parameters), "
        f"{step.gpus} GPUs, ZeRO-{step.zero_stage}, gradient checkpointing "
        f"{'on' if step.gradient_checkpointing else 'off'}, {gpu_gib:g} GiB a GPU",
        f"sequences of {step.prompt_length}+{step.response_length} = {sequence} tokens, packed whole into micro-batches"
        + (", each prompt laid out once for its responses" if step.share_prompt else ""),
        "",
    ]
    budgets = {}
    for label in ("eager", "fused"):
        budget = largest_token_budget(model, step, fused=label == "fused", gpu_gib=gpu_gib)
        sequences = largest_group_size(model, dataclasses.replace(step, prompts=1, group_size=1),
                                       fused=label == "fused", gpu_gib=gpu_gib)
        budgets[label] = sequences
        if budget:
            lines.append(f"{label}: largest budget {budget} tokens a micro-batch ({sequences} sequences)")
        else:
            lines.append(f"{label}: not even one {sequence}-token sequence fits")
    lines.append("")
    if budgets["fused"]:
        lines.append(
            "Any G trains: micro-batches are packed by tokens, not whole groups, so a group of G responses "
            f"runs as ceil(G / {budgets['fused']}) fused micro-batches with accumulated gradients; "
            "the memory no longer grows with G, the time does."
            + (f" Eager: ceil(G / {budgets['eager']}) micro-batches." if budgets["eager"] else
               " Eager trains no G here: not one sequence fits.")
        )
    else:
        lines.append("No G trains at this response length: one sequence does not fit with either loss.")
    return "\n".join(lines)


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
    parser = argparse.ArgumentParser(prog="python -m hadw_kernels.tools.plan", description=summary(__doc__),
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="Qwen3-4B", help="the model's shape")
    parser.add_argument("--group-size", "-G", type=POSITIVE_INT, default=8, help="responses per prompt")
    parser.add_argument("--prompts", type=POSITIVE_INT, default=1,
                        help="prompts per micro-step (each with G responses)")
    parser.add_argument("--response-length", type=POSITIVE_INT, default=4096, help="tokens per response")
    parser.add_argument("--prompt-length", type=NON_NEGATIVE_INT, default=512, help="tokens per prompt")
    parser.add_argument("--gpus", type=POSITIVE_INT, default=8, help="GPUs the ZeRO stage shards over")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3, help="DeepSpeed ZeRO stage")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="checkpoint every decoder layer")
    parser.add_argument("--gpu-memory-gib", type=POSITIVE_FLOAT, default=A100_80GB_GIB,
                        help="memory of one GPU (the default is an 80 GB A100's)")
    parser.add_argument("--overhead-gib", type=NON_NEGATIVE_FLOAT, default=DEFAULT_OVERHEAD_GIB,
                        help="CUDA context, NCCL and DeepSpeed buffers, fragmentation")
    parser.add_argument("--share-prompt", action="store_true",
                        help="each prompt laid out once for its responses (the trainer's shared-prompt packing)")
    parser.add_argument("--budget", action="store_true",
                        help="the token-budget view: the largest tokens a micro-batch holds with each loss (any G)")
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
        share_prompt=args.share_prompt,
    )
    report = format_budget_report if args.budget else format_report
    print(report(PRESETS[args.model], step, args.gpu_memory_gib))


if __name__ == "__main__":
    main()
