"""The memory planner: its arithmetic, and its loss-part formulas against CPU peaks
measured by the benchmark's worker (bench/worker.py) in fresh processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hadw_kernels.tools import plan
from hadw_kernels.tools.plan import (
    PER_TOKEN_BYTES,
    PRESETS,
    MicroStep,
    ModelShape,
    estimate,
    largest_group_size,
    loss_part_bytes,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024

TINY = ModelShape("tiny", hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=100,
                  tied_embeddings=False, qk_norm=False)


def micro_step(**changes) -> MicroStep:
    step = MicroStep(group_size=8, prompts=1, response_length=4096, prompt_length=512, gpus=8, zero_stage=3,
                     gradient_checkpointing=True)
    return dataclasses.replace(step, **changes)


@pytest.mark.parametrize(
    "name, billions",
    # The model cards' parameter counts (Qwen3-0.6B's and 1.7B's cards round to one
    # digit; their non-embedding counts, 0.44B and 1.4B, are checked below).
    [("Qwen3-0.6B", 0.60), ("Qwen3-1.7B", 1.72), ("Qwen3-4B", 4.02), ("Qwen3-8B", 8.19), ("Llama-3.2-3B", 3.21)],
)
def test_preset_parameter_counts(name, billions):
    assert PRESETS[name].parameters / 1e9 == pytest.approx(billions, abs=0.01)


def test_small_qwen3_non_embedding_counts():
    for name, billions in (("Qwen3-0.6B", 0.44), ("Qwen3-1.7B", 1.4)):
        model = PRESETS[name]
        assert (model.parameters - model.vocab * model.hidden) / 1e9 == pytest.approx(billions, abs=0.01)


def test_tiny_model_by_hand():
    # q: 8x8, k and v: 8x4 each, o: 8x8, MLP: 3x8x16, two norms of 8.
    assert TINY.layer_parameters == 64 + 64 + 64 + 384 + 16
    # Embeddings and LM head (untied) 2x100x8, two layers, final norm.
    assert TINY.parameters == 1600 + 2 * 592 + 8
    # bf16: 4 h + 2 q + 2 kv + 4 I = 32 + 16 + 8 + 64 elements; fp32: the two norms' inputs, 2 h.
    assert TINY.layer_activation_bytes_per_token == 2 * 120 + 4 * 16
    with_qk_norm = dataclasses.replace(TINY, qk_norm=True)
    assert with_qk_norm.layer_parameters == TINY.layer_parameters + 8
    assert with_qk_norm.layer_activation_bytes_per_token == 2 * (120 + 8 + 4) + 4 * (16 + 8 + 4)
    # In backward: the gate's and up's gradients (2 I) and the hidden states' in and out (2 h).
    assert TINY.layer_gradient_bytes_per_token == 2 * (32 + 16)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_shard_the_model_states(stage):
    gpus = 8
    parts = estimate(TINY, micro_step(zero_stage=stage, gpus=gpus), fused=True).parts
    psi = TINY.parameters
    assert parts["bf16 parameters"] == 2 * psi // (gpus if stage >= 3 else 1)
    assert parts["bf16 gradients"] == 2 * psi // (gpus if stage >= 2 else 1)
    assert parts["fp32 master weights + Adam m, v"] == 12 * psi // (gpus if stage >= 1 else 1)
    assert ("ZeRO-3 gathered: 2 layers + LM head" in parts) == (stage == 3)


def test_eager_loss_part_counts_the_logit_copies():
    # bf16: the logits, their fp32 copy, the fp32 log-softmax and its gradient; fp32: no copy.
    assert sum(loss_part_bytes(1000, 64, 5000, fused=False, dtype_bytes=2).values()) == 14 * 1000 * 5000
    assert sum(loss_part_bytes(1000, 64, 5000, fused=False, dtype_bytes=4).values()) == 12 * 1000 * 5000


def test_fused_loss_part_has_no_tokens_by_vocab_term():
    def fused(tokens):
        return sum(loss_part_bytes(tokens, 64, 100_000, fused=True, dtype_bytes=2, block_rows=1000).values())

    # Beyond one block, each extra token costs its bf16 hidden-size gradient row and a few
    # per-token values only; the [block_rows, V] buffer does not grow.
    assert fused(20_000) - fused(10_000) == 10_000 * (2 * 64 + PER_TOKEN_BYTES)


def test_planned_block_is_the_kernels_block():
    """The planner sizes the logits buffer as the Triton path does (even blocks of at
    most the default budget), checked on the kernels' own sweep on CPU tensors."""
    pytest.importorskip("triton")
    from hadw_kernels.triton.linear_logprob import _BlockSweep

    for tokens in (100, 8192, 32768):
        hidden = torch.zeros(tokens, 8, dtype=torch.bfloat16)
        weight = torch.zeros(151936, 8, dtype=torch.bfloat16)
        sweep = _BlockSweep(hidden, weight, None, torch.zeros(tokens, dtype=torch.long), -100, 0)
        # The CPU sweep's budget is the CPU one: plan with the block size it chose.
        parts = loss_part_bytes(tokens, 8, 151936, fused=True, dtype_bytes=2, block_rows=sweep.block_rows)
        assert parts["fused: logits of one block of rows"] == sweep.buffer.numel() * 2


def test_activations_with_and_without_checkpointing():
    step = micro_step(prompts=2, group_size=4, prompt_length=100, response_length=300)
    tokens = 2 * 4 * 400
    model = PRESETS["Qwen3-4B"]
    kept = estimate(model, step, fused=True)
    assert kept.parts["activations: checkpointed layer inputs"] == 2 * model.hidden * model.layers * tokens
    # One layer recomputed beside its gradients in backward.
    assert kept.recompute == (model.layer_activation_bytes_per_token + model.layer_gradient_bytes_per_token) * tokens
    full = estimate(model, dataclasses.replace(step, gradient_checkpointing=False), fused=True)
    assert full.parts["activations: every layer's saved tensors"] == \
        model.layer_activation_bytes_per_token * tokens * model.layers
    assert full.recompute == model.layer_gradient_bytes_per_token * tokens
    assert full.peak == max(full.at_loss_peak, full.at_recompute)
    assert full.peak > kept.peak


def test_the_optimizer_step_is_the_peak_of_small_micro_batches():
    """DeepSpeed's fp32 gradient partition and the bf16 copy of the updated weights (6 bytes
    a parameter, sharded as the fp32 states) when the activations are gone: the flat peak
    the H100 probe measured from 1 to 8 sequences (35.3 GiB, docs/results/2026-11-26.md, "The planner against two-step budgets")."""
    model = PRESETS["Qwen3-1.7B"]
    small = estimate(model, budget_step(group_size=1, overhead_gib=0), fused=True)
    assert small.peak == small.at_optimizer_step
    assert small.peak / 2**30 == pytest.approx(35.34, rel=0.01)
    states = 16 * model.parameters
    assert small.at_optimizer_step == states + 6 * model.parameters
    sharded = estimate(model, budget_step(group_size=1, overhead_gib=0, zero_stage=2, gpus=4), fused=True)
    assert sharded.optimizer_step == 6 * model.parameters // 4
    large = estimate(model, budget_step(group_size=32, overhead_gib=0), fused=True)
    assert large.peak == large.at_recompute > large.at_optimizer_step


def test_peak_takes_the_larger_of_loss_and_recompute():
    model = PRESETS["Qwen3-4B"]
    eager = estimate(model, micro_step(), fused=False)
    fused = estimate(model, micro_step(), fused=True)
    # Eager: the logits dominate; fused: one layer's recompute is larger than the tiles.
    assert eager.peak == eager.at_loss_peak > eager.at_recompute
    assert fused.peak == fused.at_recompute > fused.at_loss_peak
    assert eager.at_loss_peak - fused.at_loss_peak == eager.loss - fused.loss


def test_largest_group_size_is_the_fitting_boundary():
    model = PRESETS["Qwen3-4B"]
    step = micro_step()
    for fused in (False, True):
        largest = largest_group_size(model, step, fused=fused, gpu_gib=80)
        assert largest >= 1
        assert estimate(model, dataclasses.replace(step, group_size=largest), fused=fused).fits(80)
        assert not estimate(model, dataclasses.replace(step, group_size=largest + 1), fused=fused).fits(80)
    eager_largest = largest_group_size(model, step, fused=False, gpu_gib=80)
    assert largest_group_size(model, step, fused=True, gpu_gib=80) > 4 * eager_largest
    assert largest_group_size(model, step, fused=False, gpu_gib=1) == 0


def test_invalid_micro_step():
    with pytest.raises(ValueError, match="zero_stage"):
        micro_step(zero_stage=4)
    with pytest.raises(ValueError, match="group_size"):
        micro_step(group_size=0)


def test_command_line_prints_the_breakdown(capsys):
    plan.main(["--model", "Qwen3-4B", "-G", "16", "--zero-stage", "2", "--no-gradient-checkpointing"])
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATE")
    assert "ZeRO-2, gradient checkpointing off" in out
    assert "eager: does NOT fit in 80 GiB; largest G that fits:" in out
    assert "fused:" in out and "PEAK" in out


# --- the loss part against measured CPU peaks ---------------------------------------

# One small fp32 case: N = 2048 response tokens, H = 256, V = 16384. Eager's three
# [N, V] fp32 copies (384 MiB) dwarf the fused path's tiles and gradients (~82 MiB).
MEASURED_SHAPE = dict(prompts=2, group_size=8, length=128, hidden=256, vocab=16384)
# The allocator's view counts tensors only: it must agree closely. The resident set
# adds what the C allocator keeps after a free, thread stacks and page granularity.
ALLOC_FACTOR = 1.5
RSS_FACTOR = 3.0


def measure(impl: str) -> dict:
    shape_args = [f"--{key.replace('_', '-')}={value}" for key, value in MEASURED_SHAPE.items()]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "2"}
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "worker.py"), "--impl", impl, "--input", "hidden",
         *shape_args, "--rounds", "1"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["status"] == "ok", report
    return report


@pytest.mark.slow
@pytest.mark.parametrize("impl, fused", [("eager", False)])
def test_loss_part_matches_the_measured_cpu_peak(impl, fused):
    """The eager formula against a CPU measurement (the fused one is the GPU path's,
    measured on an H100 by scripts/gpu_check.sh: docs/results/2026-11-23.md)."""
    tokens = MEASURED_SHAPE["prompts"] * MEASURED_SHAPE["group_size"] * MEASURED_SHAPE["length"]
    planned_mib = sum(
        loss_part_bytes(tokens, MEASURED_SHAPE["hidden"], MEASURED_SHAPE["vocab"], fused=fused, dtype_bytes=4).values()
    ) / MIB
    report = measure(impl)
    assert 1 / ALLOC_FACTOR <= report["alloc_peak_mb"] / planned_mib <= ALLOC_FACTOR, (report, planned_mib)
    assert 1 / ALLOC_FACTOR <= report["rss_peak_mb"] / planned_mib <= RSS_FACTOR, (report, planned_mib)


# --- the token-budget view ----------------------------------------------------------

MEASURED_BUDGETS = REPO_ROOT / "docs" / "measured-budgets.json"


def budget_step(**changes) -> MicroStep:
    step = MicroStep(group_size=1, prompts=1, response_length=4096, prompt_length=512, gpus=1, zero_stage=2,
                     gradient_checkpointing=True)
    return dataclasses.replace(step, **changes)


@pytest.mark.parametrize("model_name", ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B"])
def test_budget_is_whole_sequences_at_the_fitting_boundary(model_name):
    # Over 8 GPUs (ZeRO-3): Qwen3-4B's model states and its optimizer step alone fill one.
    model, step = PRESETS[model_name], budget_step(zero_stage=3, gpus=8)
    sequence = step.prompt_length + step.response_length
    for fused in (False, True):
        budget = plan.largest_token_budget(model, step, fused=fused, gpu_gib=80)
        assert budget > 0 and budget % sequence == 0
        fitting = dataclasses.replace(step, group_size=budget // sequence)
        assert estimate(model, fitting, fused=fused).fits(80)
        assert not estimate(model, dataclasses.replace(fitting, group_size=fitting.group_size + 1), fused=fused).fits(80)


def test_budget_does_not_depend_on_the_group_size():
    model = PRESETS["Qwen3-1.7B"]
    budgets = {plan.largest_token_budget(model, budget_step(group_size=g, prompts=p), fused=True, gpu_gib=80)
               for g, p in ((1, 1), (8, 1), (64, 4), (1024, 1))}
    assert len(budgets) == 1


def test_fused_budget_is_larger_than_eager():
    for name in ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Llama-3.2-3B"):
        step = budget_step(zero_stage=3, gpus=8)  # Qwen3-8B's model states alone fill one GPU
        eager = plan.largest_token_budget(PRESETS[name], step, fused=False, gpu_gib=80)
        fused = plan.largest_token_budget(PRESETS[name], step, fused=True, gpu_gib=80)
        # Several times: 3.8x for Qwen3-8B, whose activations a token weigh most beside
        # its logits; 15x for Qwen3-0.6B.
        assert fused > 3 * eager > 0, name


def test_budget_grows_with_memory_and_gpus():
    model = PRESETS["Qwen3-4B"]
    for fused in (False, True):
        by_memory = [plan.largest_token_budget(model, budget_step(), fused=fused, gpu_gib=gib)
                     for gib in (40, 60, 80, 141)]
        assert by_memory == sorted(by_memory) and by_memory[0] < by_memory[-1]
        # ZeRO-3 over more GPUs shards more of the model states: more room for tokens.
        by_gpus = [plan.largest_token_budget(model, budget_step(zero_stage=3, gpus=n), fused=fused, gpu_gib=80)
                   for n in (1, 2, 8)]
        assert by_gpus == sorted(by_gpus) and by_gpus[0] < by_gpus[-1]


def test_one_long_response_fits_fused_only():
    # One 32k-token response of Qwen3-1.7B on one 80 GiB GPU: eager's [32k, V] fp32 copies
    # (14 bytes a logit, ~65 GiB) do not fit beside the model states; the fused loss does.
    step = budget_step(response_length=32768)
    assert plan.largest_token_budget(PRESETS["Qwen3-1.7B"], step, fused=False, gpu_gib=80) == 0
    assert plan.largest_token_budget(PRESETS["Qwen3-1.7B"], step, fused=True, gpu_gib=80) >= 32768 + 512


def test_budget_command_line(capsys):
    plan.main(["--budget", "--model", "Qwen3-1.7B", "--response-length", "4096", "--gpus", "1", "--zero-stage", "2"])
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATE of the largest micro-batch token budget")
    assert "eager: largest budget" in out and "fused: largest budget" in out
    assert "Any G trains" in out


def _measured_budgets() -> list[dict]:
    return json.loads(MEASURED_BUDGETS.read_text())["rows"]


def test_measured_budget_table_is_well_formed():
    fields = {"model", "loss", "gpus", "zero_stage", "prompt_length", "response_length", "gpu_memory_gib",
              "largest_budget_tokens", "device", "date"}
    for row in _measured_budgets():
        assert fields <= set(row), row
        assert row["model"] in PRESETS and row["loss"] in ("eager", "fused")


@pytest.mark.parametrize("row", _measured_budgets() or [None])
def test_planned_budget_within_10_percent_of_the_measured(row):
    """The budget view against the probe's GPU measurements (docs/measured-budgets.json).
    Each row is a measured run; with no row (a table cleared, a fresh checkout's) the test
    skips, it does not pass."""
    if row is None:
        pytest.skip("no measured budgets yet: docs/measured-budgets.json is empty (run the probe on a GPU)")
    step = budget_step(gpus=row["gpus"], zero_stage=row["zero_stage"], prompt_length=row["prompt_length"],
                       response_length=row["response_length"])
    planned = plan.largest_token_budget(PRESETS[row["model"]], step, fused=row["loss"] == "fused",
                                        gpu_gib=row["gpu_memory_gib"])
    assert planned == pytest.approx(row["largest_budget_tokens"], rel=0.10), (row, planned)
