"""Peak memory and throughput of real train steps at a chosen token budget:
``python -m trainer.tools.probe``.

A model is built from an architecture preset with random weights (nothing is
downloaded): Qwen3-0.6B, Qwen3-1.7B, Qwen3-4B (their config.json's shapes, vocabulary
151936, tied embeddings) or ``tiny`` (the trainer's tiny model). G responses of L random
token ids follow each prompt of P random token ids (no rollout). Responses are cut into
micro-batches of at most ``--micro-batch-tokens`` tokens of whole sequences (prompt +
response each; a response is never split), laid out as the trainer lays them out
(``--layout``, the trainer's ``train.layout``; the figures say which, and how many
tokens went through the model),
and each step runs the trainer's own pieces: the model in ``Policy``'s DeepSpeed engine
(gradient checkpointing, the chosen ZeRO stage, a torch AdamW), the loss,
``engine.backward``, ``engine.step``.

``--loss fused``: ``fused_linear_hadw_grpo_loss`` on the hidden states (no logits).
``--loss eager``: what a user without this library runs: the model's logits of the
response positions (``logits_to_keep``, as TRL does), fp32 ``log_softmax``, ``gather``,
and the library's pure-PyTorch reference surrogate (``fused_hadw_grpo_loss(...,
backend="torch")``) on the per-token log-probs.

Memory: on a GPU ``torch.cuda.max_memory_allocated`` over the step (absolute: model
states included); a step that raises ``torch.cuda.OutOfMemoryError`` does not fit. On the
CPU the process's resident set, after ``malloc_trim`` and with glibc's mmap threshold
pinned (so freed tensors leave it): the kernel's exact high-water mark (VmHWM) on Linux,
else RSS sampled by a psutil thread (``memory_meter.RssSampler``; it can miss a shorter spike). The peak
above the pre-step baseline is reported, and a budget fits a ``--memory-limit-gib`` when
the absolute peak stays under it (it counts the allocator's cached pages: an estimate).

``--find-max-budget`` bisects the micro-batch budget (in whole sequences of P + L
tokens): each trial is two consecutive micro-batch steps (forward, backward, optimizer
step) on the same engine, the model states, Adam's included, alive as in training. Two,
because on a GPU a budget whose first step fits can run out of memory in the second
(measured: docs/benchmarks.md, "On a GPU"), and training repeats steps.

Advantages are random (as computed elsewhere over the whole rollout batch); old
log-probs are -log V (what a random model gives, roughly), so the ratio is near 1.
Progress goes to stderr; ``--json OUT`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

# Run as a file, Python puts this file's folder on the path, not the checkout that holds
# the package: the wheel installs the library only, the trainer runs from its checkout
# (docs/trainer.md).
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hadw_kernels.layouts import LAYOUT_CHOICES
from hadw_kernels.tools.cli import (
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    HelpFormatter,
    finite_float,
    output_file,
)
from hadw_kernels.tools.plan import PRESETS as SHAPES
from trainer.tools.memory_meter import MemoryMeter

if TYPE_CHECKING:
    from trainer.engine.policy import Policy

# The planner's models (one description of each model's shape), and the trainer's tiny one.
PRESETS = (*SHAPES, "tiny")
GIB = 1024**3
FRACTION = finite_float(minimum=0.0, maximum=1.0)


def say(message: str) -> None:
    print(f"[probe] {message}", file=sys.stderr, flush=True)


# --- bisection (pure: unit-tested on a fake predicate) ----------------------------------


def largest_fitting(fits: Callable[[int], bool], start: int = 1, limit: int = 1 << 20,
                    tolerance: float = 0.0) -> int:
    """The largest n in [start, limit] with ``fits(n)``, for a monotone predicate (true
    up to some n, false beyond); ``start - 1`` if not even ``start`` fits.

    Doubles from ``start`` until a failure (or ``limit``), then bisects between the last
    fit and the first failure: O(log n) calls, none above twice the answer. With a
    ``tolerance`` the bisection stops once the first failure is within that fraction
    above the last fit (an answer at most that fraction short, with fewer calls).
    """
    if start > limit or not fits(start):
        return start - 1
    good, bad = start, None
    while bad is None:
        trial = min(good * 2, limit)
        if trial == good:
            return good
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > max(1, int(tolerance * good)):
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def steady_median(seconds: list[float]) -> float:
    """The median step time after the first, which warms up (allocations, Adam's states,
    kernels); the first alone if it is the only one."""
    return statistics.median(seconds[1:] or seconds)


# --- the model and the batch ---------------------------------------------------------


def build_model(preset: str, dtype, device, seed: int):
    import torch

    if preset == "tiny":
        from trainer.models.checks import ModelConfig
        from trainer.models.tiny_model import build_tiny_model, build_tokenizer
        from trainer.tasks.synthetic_task import VOCABULARY

        model = build_tiny_model(ModelConfig(), build_tokenizer(VOCABULARY), seed)
        # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), whose type
        # mypy does not bind as a method: it asks for self among the arguments.
        return model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = SHAPES[preset]
    # The query/key RMSNorm is Qwen3's; the planner's other models are Llamas.
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if shape.qk_norm else (LlamaConfig, LlamaForCausalLM)
    config = config_class(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=shape.tied_embeddings,
    )
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype=dtype)  # type: ignore[call-arg]  # functools.wraps, as above


def policy_config(args, micro_batches: int):
    """The trainer's Config for ``Policy``, one "prompt" a sequence; the probe packs its
    own micro-batches and marks the last of a step, as the trainer does."""
    from trainer.config import Config

    config = Config()
    config.model.dtype = args.dtype
    config.model.gradient_checkpointing = args.gradient_checkpointing
    config.rollout.group_size = 1
    config.rollout.max_new_tokens = args.response_length
    config.train.micro_batch_prompts = 1
    config.train.mini_batch_prompts = micro_batches
    config.train.prompts_per_step = micro_batches
    config.train.zero_stage = args.zero_stage
    config.train.learning_rate = 1e-6
    config.train.layout = args.layout
    config.train.warmup_steps = 0
    config.algorithm.loss_backend = "auto"
    return config


def make_rows(rows: int, args, vocab: int, generator):
    """``rows`` sequences in groups of G (one prompt a group, the last group partial) of
    random token ids (``hadw_kernels.layouts.RowTokens``): every layout gets the same."""
    import torch

    from hadw_kernels.layouts import RowTokens

    # Token ids from 1: 0 may be a pad id; every sequence is P + L long (no padding).
    groups = -(-rows // args.group_size)
    prompts = torch.randint(1, vocab, (groups, args.prompt_length), generator=generator)
    responses = torch.randint(1, vocab, (rows, args.response_length), generator=generator)
    return RowTokens([prompts[row // args.group_size].tolist() for row in range(rows)], responses.tolist())


def make_batch(rows: int, args, vocab: int, device, generator, *, layout):
    """:func:`make_rows` in the micro-batch ``layout`` (a ``hadw_kernels.layouts.Layout``)."""
    batch = make_rows(rows, args, vocab, generator)
    return layout.build(batch.prompts, batch.responses, pad_token_id=0, device=device)


def fed_tokens(rows: int, args, vocab: int, layout) -> int:
    """Tokens through the model for ``rows`` sequences of :func:`make_rows` in ``layout``;
    the prefix tree's count depends on the draw (responses that begin alike share), so it
    is counted on one draw of the run's seed."""
    import torch

    return layout.fed_tokens(make_rows(rows, args, vocab, torch.Generator().manual_seed(args.seed)))


# --- one micro-step ----------------------------------------------------------------------


def accumulate(policy, batch, old_logprobs, advantages, *, loss_normalizer: float, last: bool,
               loss: str) -> dict[str, float]:
    """One micro-batch's forward, loss, backward and DeepSpeed step (the optimizer's after
    the ``last``): the trainer's own ``Policy.accumulate`` for the fused loss, or the path
    a user without this library runs (the response positions' logits, fp32 log-softmax,
    gather, the PyTorch reference surrogate)."""
    import torch

    from hadw_kernels import fused_hadw_grpo_loss

    if loss == "fused":
        return policy.accumulate(batch, old_logprobs, advantages, loss_normalizer=loss_normalizer, last=last)
    policy.engine.set_gradient_accumulation_boundary(last)
    width = batch.labels.shape[1]
    # Padded: the logits of the response positions only (the last width + 1, as TRL
    # asks). Packed: every position's, the prompts' included (as a padding-free trainer
    # without a fused head forms them).
    logits = policy.engine(**batch.model_inputs(policy.engine), use_cache=False, logits_to_keep=0 if batch.cu_seqlens is not None
                           else width + 1).logits
    # Packed, the positions the loss reads (the prefix tree gathers each response's).
    logits = batch.loss_hidden_states(logits) if batch.cu_seqlens is not None else logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    labels = batch.labels.clamp(min=0)
    token_logprobs = logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    # Without return_metrics, the loss alone (its annotation: either form).
    value = cast("torch.Tensor", fused_hadw_grpo_loss(
        token_logprobs, old_logprobs, None, batch.response_mask, cu_seqlens=batch.cu_seqlens,
        advantages=batch.per_segment(advantages), loss_normalizer=loss_normalizer, max_response_length=policy.config.rollout.max_new_tokens,
        backend="torch",
    ))
    policy.engine.backward(value, scale_wrt_gas=False)
    policy.engine.step()
    return {"loss": float(value.detach())}


# --- the probe ----------------------------------------------------------------------


def _out_of_memory_types():
    import torch

    types = [torch.cuda.OutOfMemoryError]
    return tuple(types)


class Probe:
    def __init__(self, args) -> None:
        import deepspeed
        import torch

        self.args = args
        self.torch = torch
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        self.sequence_tokens = args.prompt_length + args.response_length
        self.sequences = args.prompts * args.group_size
        self.dtype = getattr(torch, args.dtype)
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        budget = args.micro_batch_tokens or self.sequences * self.sequence_tokens
        self.rows = budget // self.sequence_tokens
        self.micro_batches = math.ceil(self.sequences / self.rows)  # parse_args: a budget holds a sequence
        self._policy: Policy | None = None
        self.broken = False  # an out-of-memory error left the engine half-way through a step
        self._build()
        self.meter = MemoryMeter(self.device)
        self.generator = torch.Generator().manual_seed(args.seed)
        # A loss_normalizer of the whole step's responses (GRPO's seq-mean over the mini-batch).
        self.normalizer = float(self.sequences)

    def close(self) -> None:
        """Destroys the engine and collects what it held."""
        import gc

        if self._policy is not None:
            self._policy.engine.destroy()
            self._policy = None
        gc.collect()

    def _build(self) -> None:
        """The model and its DeepSpeed engine, from scratch (the same seed, the same weights)."""
        from trainer.engine.policy import Policy

        args = self.args
        # The old engine's hooks and buffers would otherwise keep its model alive beside the new.
        self.close()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        say(f"building {args.preset} ({args.dtype}, random weights) on {self.device}")
        model = build_model(args.preset, self.dtype, self.device, args.seed)
        self.parameters = sum(p.numel() for p in model.parameters())
        self.vocab = model.get_output_embeddings().weight.shape[0]
        say(f"{self.parameters:,} parameters; DeepSpeed ZeRO-{args.zero_stage}")
        self._policy = Policy(model, policy_config(args, self.micro_batches), world_size=1)
        self.broken = False

    @property
    def policy(self) -> Policy:
        """The policy in its DeepSpeed engine; between close() and the next build, none."""
        if self._policy is None:
            raise RuntimeError("the probe's engine is closed")
        return self._policy

    def _ensure_usable(self) -> None:
        """After an out-of-memory error, a new engine: ZeRO tracks which gradients a step
        has reduced, and a step stopped inside backward leaves that state half-way (not
        tried on a GPU yet), so the engine is rebuilt rather than patched. Called outside the ``except`` block, so that the
        traceback's frames, and the tensors they hold, are gone first."""
        if self.broken:
            say("rebuilding the engine after an out-of-memory error")
            self._build()

    def _inputs(self, rows: int):
        torch = self.torch
        batch = make_batch(rows, self.args, self.vocab, self.device, self.generator, layout=self.policy.layout)
        old = torch.full(batch.labels.shape, -math.log(self.vocab), device=self.device)
        advantages = torch.randn(rows, generator=self.generator).to(self.device)
        return batch, old, advantages

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def _timed(self, step: Callable[[], None]) -> float:
        """Seconds of ``step``, the device synchronised before and after."""
        self._sync()
        started = time.perf_counter()
        step()
        self._sync()
        return time.perf_counter() - started

    def train_step(self) -> float:
        """One optimizer step over prompts x G responses in micro-batches; seconds."""

        def micro_batches() -> None:
            remaining = self.sequences
            while remaining:
                rows = min(self.rows, remaining)
                batch, old, advantages = self._inputs(rows)
                remaining -= rows
                accumulate(self.policy, batch, old, advantages, loss_normalizer=self.normalizer,
                           last=remaining == 0, loss=self.args.loss)

        return self._timed(micro_batches)

    def _recover(self) -> None:
        """After an out-of-memory error: the engine is rebuilt before its next use."""
        self.broken = True

    def fits(self, rows: int) -> dict:
        """Two micro-batch steps of ``rows`` sequences, each forward, backward and
        optimizer step: a fit is a budget that training can repeat."""
        limit = self.args.memory_limit_gib
        self._ensure_usable()

        def two_steps() -> None:
            self._one_micro_step(rows)
            self._one_micro_step(rows)

        try:
            figures = self.meter.measure(two_steps)
        except _out_of_memory_types() as error:
            self._recover()
            return {"rows": rows, "tokens": rows * self.sequence_tokens, "fits": False,
                    "fed_tokens": fed_tokens(rows, self.args, self.vocab, self.policy.layout),
                    "note": f"out of memory: {str(error).splitlines()[0][:200]}"}
        fits = limit is None or figures["peak_bytes"] <= limit * GIB
        return {"rows": rows, "tokens": rows * self.sequence_tokens, "fits": fits,
                "fed_tokens": fed_tokens(rows, self.args, self.vocab, self.policy.layout), **figures}

    def _one_micro_step(self, rows: int) -> None:
        batch, old, advantages = self._inputs(rows)
        accumulate(self.policy, batch, old, advantages, loss_normalizer=float(rows), last=True, loss=self.args.loss)

    def run(self) -> dict:
        args = self.args
        result = {
            "preset": args.preset, "parameters": self.parameters, "vocab": self.vocab, "loss": args.loss,
            "dtype": args.dtype, "device": str(self.device), "zero_stage": args.zero_stage,
            "gradient_checkpointing": args.gradient_checkpointing, "group_size": args.group_size,
            "prompts": args.prompts, "prompt_length": args.prompt_length, "response_length": args.response_length,
            "layout": self.policy.layout.name,
            "micro_batch_tokens": self.rows * self.sequence_tokens, "sequences_per_micro_batch": self.rows,
            "micro_batch_fed_tokens": fed_tokens(self.rows, args, self.vocab, self.policy.layout),
            "micro_batches_per_step": self.micro_batches, "memory_method": self.meter.method,
            "memory_limit_gib": args.memory_limit_gib,
        }
        if self.device.type == "cuda":
            result["device_name"] = self.torch.cuda.get_device_name(self.device)
        if args.steps:
            result.update(self._timed_steps())
        if args.find_max_budget:
            result.update(self._bisect())
        return result

    def _timed_steps(self) -> dict:
        args = self.args
        self._ensure_usable()
        seconds: list[float] = []

        def steps() -> None:
            for index in range(args.steps):
                seconds.append(self.train_step())
                say(f"step {index + 1}/{args.steps}: {seconds[-1]:.2f} s")

        try:
            memory = self.meter.measure(steps)
        except _out_of_memory_types() as error:
            self._recover()
            say("out of memory")
            return {"fits": False, "note": f"out of memory: {str(error).splitlines()[0][:200]}"}
        if args.memory_limit_gib is not None and memory["peak_bytes"] > args.memory_limit_gib * GIB:
            fits = False
        else:
            fits = True
        step_seconds = steady_median(seconds)
        tokens = self.sequences * self.sequence_tokens
        figures = {
            "fits": fits, "step_seconds": seconds, "median_step_seconds": step_seconds,
            "tokens_per_step": tokens, "tokens_per_second": tokens / step_seconds,
            "response_tokens_per_second": self.sequences * args.response_length / step_seconds,
            "peak_memory_bytes": memory["peak_bytes"], "peak_memory_gib": memory["peak_bytes"] / GIB,
            "peak_above_baseline_bytes": memory["peak_above_baseline_bytes"],
            "baseline_memory_bytes": memory["baseline_bytes"],
        }
        say(f"{figures['tokens_per_second']:.0f} tokens/s; peak {figures['peak_memory_gib']:.2f} GiB "
            f"({memory['peak_above_baseline_bytes'] / GIB:.2f} above the baseline)")
        return figures

    def _bisect(self) -> dict:
        args = self.args
        trials: list[dict] = []

        def fits(rows: int) -> bool:
            trial = self.fits(rows)
            trials.append(trial)
            say(f"budget {trial['tokens']} tokens ({rows} sequences): {'fits' if trial['fits'] else 'does not fit'}"
                + (f", peak {trial['peak_bytes'] / GIB:.2f} GiB" if "peak_bytes" in trial else ""))
            return trial["fits"]

        limit_rows = args.max_budget_tokens // self.sequence_tokens
        rows = largest_fitting(fits, 1, limit_rows, args.budget_tolerance)
        largest = rows * self.sequence_tokens
        say(f"largest budget: {largest} tokens ({rows} sequences of {self.sequence_tokens})")
        figures = {"largest_budget_tokens": largest, "largest_budget_sequences": rows,
                   "largest_budget_fed_tokens": fed_tokens(rows, args, self.vocab, self.policy.layout) if rows else 0,
                   "budget_search_limit_tokens": limit_rows * self.sequence_tokens, "budget_trials": trials}
        if rows and args.steps_at_largest_budget:
            figures.update(self._time_budget(rows))
        return figures

    def _time_budget(self, rows: int) -> dict:
        """Throughput at a budget: micro-batch steps of ``rows`` sequences (the first warms
        up), each its own optimizer step, as the bisection's trials."""
        self._ensure_usable()
        seconds = []
        for index in range(self.args.steps_at_largest_budget):
            try:
                seconds.append(self._timed(lambda: self._one_micro_step(rows)))
            except _out_of_memory_types():  # a fit by a narrow margin can fail on a later batch
                self._recover()
                say("out of memory while timing the largest budget")
                return {"largest_budget_note": "out of memory on a repeated step"}
            say(f"largest budget, step {index + 1}/{self.args.steps_at_largest_budget}: {seconds[-1]:.2f} s")
        tokens_per_second = rows * self.sequence_tokens / steady_median(seconds)
        say(f"largest budget: {tokens_per_second:.0f} tokens/s")
        return {"largest_budget_step_seconds": seconds, "largest_budget_tokens_per_second": tokens_per_second}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.probe", description=" ".join(summary.split()),
                                     epilog=details, formatter_class=HelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="the model's architecture (random weights)")
    parser.add_argument("--loss", choices=("fused", "eager"), default="fused",
                        help="this library's loss on the hidden states, or logits + log_softmax + the surrogate")
    parser.add_argument("--group-size", "-G", type=POSITIVE_INT, default=8, help="responses per prompt")
    parser.add_argument("--prompts", type=POSITIVE_INT, default=1, help="prompts per optimizer step")
    parser.add_argument("--response-length", "-L", type=POSITIVE_INT, default=64, help="tokens per response")
    parser.add_argument("--prompt-length", "-P", type=POSITIVE_INT, default=16,
                        help="tokens per prompt (at least 1: a hidden state precedes the first response token)")
    parser.add_argument("--micro-batch-tokens", type=NON_NEGATIVE_INT, default=0,
                        help="tokens (prompt + response) per forward, at least one sequence's; 0: all of a step's "
                             "sequences in one")
    parser.add_argument("--steps", type=NON_NEGATIVE_INT, default=2,
                        help="timed optimizer steps (the first is a warm-up); 0: none, with --find-max-budget")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2, help="DeepSpeed ZeRO stage")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="checkpoint every decoder layer")
    parser.add_argument("--layout", choices=LAYOUT_CHOICES, default="auto",
                        help="the micro-batches' layout, as the trainer's train.layout (auto: the prefix tree where "
                             "the segment attention serves the model, else padded)")
    parser.add_argument("--device", default="cuda" if _cuda_visible() else "cpu",
                        help="where the model runs (the default: cuda when a GPU is visible)")
    parser.add_argument("--find-max-budget", action="store_true",
                        help="bisect the largest micro-batch token budget that fits")
    parser.add_argument("--budget-tolerance", type=FRACTION, default=0.0,
                        help="stop the bisection once the first budget that does not fit is within this "
                             "fraction above the largest that does (fewer trials; 0: to one sequence)")
    parser.add_argument("--steps-at-largest-budget", type=NON_NEGATIVE_INT, default=0,
                        help="with --find-max-budget: time this many micro-batch steps at the largest budget "
                             "(the first a warm-up)")
    parser.add_argument("--memory-limit-gib", type=POSITIVE_FLOAT, default=None,
                        help="a budget fits when its peak stays under this (CPU: required for the bisection)")
    parser.add_argument("--max-budget-tokens", type=POSITIVE_INT, default=1 << 21,
                        help="the bisection's upper end, at least one sequence's tokens")
    parser.add_argument("--threads", type=NON_NEGATIVE_INT, default=0,
                        help="OpenMP threads; 0: OMP_NUM_THREADS, else the trainer's rule (1 for the tiny preset, "
                             "the cores over the local ranks for the others)")
    parser.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="seeds the weights and the batches")
    parser.add_argument("--json", type=output_file, default=None, help="write the figures here (default: print them)")
    args = parser.parse_args(argv)
    sequence = args.prompt_length + args.response_length
    if 0 < args.micro_batch_tokens < sequence:
        parser.error(f"argument --micro-batch-tokens: {args.micro_batch_tokens} holds no whole sequence of "
                     f"{args.prompt_length} + {args.response_length} = {sequence} tokens (0: one micro-batch a step)")
    if args.max_budget_tokens < sequence:
        parser.error(f"argument --max-budget-tokens: {args.max_budget_tokens} is below one sequence of "
                     f"{args.prompt_length} + {args.response_length} = {sequence} tokens")
    if args.steps == 0 and not args.find_max_budget:
        parser.error("argument --steps: 0 measures nothing without --find-max-budget")
    if args.steps_at_largest_budget and not args.find_max_budget:
        parser.error("argument --steps-at-largest-budget: needs --find-max-budget")
    if args.find_max_budget and not args.device.startswith("cuda") and args.memory_limit_gib is None:
        parser.error("--find-max-budget on the CPU needs --memory-limit-gib")
    return args


def _cuda_visible() -> bool:
    # Without a CUDA call: the device is not chosen yet.
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES", "x")) and os.path.exists("/dev/nvidia0")


def prepare(args) -> None:
    """The environment the trainer's run sets up for one process (trainer/engine/environment.py),
    its thread rule included."""
    from trainer.engine.environment import _free_port, default_threads, set_deepspeed_defaults

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or default_threads(args.preset == "tiny"))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # torch read the variable when it loaded, with the argument types (hadw_kernels.tools.cli).
    import torch

    torch.set_num_threads(threads)

    set_deepspeed_defaults(cuda=args.device.startswith("cuda"))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepare(args)
    import torch.distributed

    from hadw_kernels.distributed import is_distributed

    probe = None
    try:
        probe = Probe(args)
        result = probe.run()
    finally:
        # The engine before its process group, and neither left to the interpreter's exit:
        # a gloo group torn down there, after the engine's cycles are collected, once
        # aborted the process ("terminate called without an active exception") after the
        # figures were written.
        if probe is not None:
            probe.close()
        if is_distributed():
            torch.distributed.destroy_process_group()
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
        say(f"figures written to {args.json}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
