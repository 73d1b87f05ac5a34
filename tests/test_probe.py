"""The probe (python -m trainer.tools.probe): its bisection on fake predicates, and the tiny
preset's real train steps on the CPU for both losses (a smoke test: the figures' fields,
no assertion on time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.tools.probe import largest_fitting

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 8, 9, 100, 1000, 1023, 1024])
def test_bisection_finds_the_boundary(threshold):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= threshold

    assert largest_fitting(fits, 1, 1024) == threshold
    # Doubling then bisecting: O(log n) calls, none far above the answer.
    assert len(calls) <= 2 * threshold.bit_length() + 2
    assert max(calls) <= max(2 * threshold, 1)


def test_bisection_when_nothing_fits():
    assert largest_fitting(lambda n: False, 1, 100) == 0
    assert largest_fitting(lambda n: False, 5, 100) == 4


def test_bisection_stops_at_the_limit():
    calls = []

    def fits(n):
        calls.append(n)
        return True

    assert largest_fitting(fits, 1, 100) == 100
    assert max(calls) == 100


def test_bisection_from_a_start_above_one():
    assert largest_fitting(lambda n: n <= 37, 5, 1000) == 37


@pytest.mark.parametrize("threshold", [1, 7, 64, 100, 700])
def test_bisection_with_a_tolerance_stops_early_within_it(threshold):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= threshold

    found = largest_fitting(fits, 1, 4096, tolerance=0.05)
    assert found <= threshold and threshold - found <= max(1, 0.05 * found)
    exact_calls = []
    largest_fitting(lambda n: exact_calls.append(n) or n <= threshold, 1, 4096)
    assert len(calls) <= len(exact_calls)


@pytest.mark.slow
@pytest.mark.parametrize("loss, layout, flags", [
    ("fused", "prefix_tree", []), ("fused", "packed", ["--layout", "packed"]),
    ("eager", "padded", ["--layout", "padded"]), ("eager", "shared_prompt", ["--layout", "shared_prompt"]),
    ("eager", "prefix_tree", []),
])
def test_tiny_preset_runs_on_the_cpu(tmp_path, loss, layout, flags):
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "trainer.tools.probe", "--preset", "tiny", "--loss", loss, "--device", "cpu",
         "-G", "4", "-L", "16", "-P", "4", "--micro-batch-tokens", "40", "--steps", "2", "--threads", "1",
         "--find-max-budget", "--memory-limit-gib", "64", "--max-budget-tokens", "160", "--json", str(out),
         *flags],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "[probe]" in completed.stderr  # progress goes to stderr
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny" and result["loss"] == loss and result["device"] == "cpu"
    assert result["layout"] == layout
    # 4 sequences of 20 tokens, two a micro-batch; with a shared prompt 3 + 2 x 16 go through
    # the model, in the prefix tree 4 + 2 x 15 (less any run the two random responses share).
    assert result["sequences_per_micro_batch"] == 2 and result["micro_batches_per_step"] == 2
    assert result["micro_batch_tokens"] == 40 and result["tokens_per_step"] == 80
    if layout == "prefix_tree":
        assert result["micro_batch_fed_tokens"] <= 34
    else:
        assert result["micro_batch_fed_tokens"] == (35 if layout == "shared_prompt" else 40)
    assert result["fits"] is True
    assert len(result["step_seconds"]) == 2
    assert result["tokens_per_second"] > 0 and result["response_tokens_per_second"] > 0
    assert result["peak_memory_bytes"] >= result["baseline_memory_bytes"] > 0
    assert "RSS" in result["memory_method"]
    # 64 GiB is far above what the tiny model needs: the bisection reaches its limit.
    assert result["largest_budget_tokens"] == 160 and result["largest_budget_sequences"] == 8
    # 8 sequences in groups of 4: two prompts laid out once each.
    if layout == "prefix_tree":
        assert 0 < result["largest_budget_fed_tokens"] <= 2 * 4 + 8 * 15
    else:
        assert result["largest_budget_fed_tokens"] == (2 * 3 + 8 * 16 if layout == "shared_prompt" else 160)
    assert all(trial["fits"] for trial in result["budget_trials"])


def test_the_cpu_bisection_needs_a_memory_limit():
    from trainer.tools.probe import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--find-max-budget"])


# A child process whose micro-step raises CUDA's out-of-memory error above 5 sequences, as
# a GPU would: the bisection must count it as "does not fit" and go on with a new engine.
FAKE_OUT_OF_MEMORY = """
import sys, torch
from trainer.tools import probe
real = probe.accumulate
def accumulate(policy, batch, *args, **kwargs):
    if len(batch.response_lengths) > 5:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
    return real(policy, batch, *args, **kwargs)
probe.accumulate = accumulate
sys.exit(probe.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_bisection_goes_on_after_out_of_memory(tmp_path):
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-c", FAKE_OUT_OF_MEMORY, "--preset", "tiny", "--device", "cpu", "-G", "4", "-L", "16",
         "-P", "4", "--steps", "0", "--threads", "1", "--find-max-budget", "--memory-limit-gib", "64",
         "--max-budget-tokens", "400", "--json", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["largest_budget_sequences"] == 5 and result["largest_budget_tokens"] == 100
    failed = [trial for trial in result["budget_trials"] if not trial["fits"]]
    assert failed and all("out of memory" in trial["note"] for trial in failed)
    assert "rebuilding the engine" in completed.stderr


def test_the_probe_builds_every_model_the_planner_knows():
    """One list of models: the planner's presets (and the trainer's tiny model), each built
    by the probe with the parameter count the planner computes from its shape."""
    import torch

    from hadw_kernels.tools.plan import PRESETS as SHAPES
    from trainer.tools.probe import PRESETS, build_model

    assert PRESETS == (*SHAPES, "tiny")
    for name, shape in SHAPES.items():
        model = build_model(name, torch.bfloat16, "meta", seed=0)
        assert sum(parameter.numel() for parameter in model.parameters()) == shape.parameters, name
        assert (type(model).__name__ == "Qwen3ForCausalLM") == shape.qk_norm


@pytest.mark.parametrize("preset, threads", [("tiny", "1"), ("Qwen3-0.6B", "cores"), ("tiny", "--threads 2"),
                                             ("tiny", "OMP_NUM_THREADS=2")])
def test_the_default_thread_count_is_the_trainer_s(preset, threads):
    """The probe took all cores by default: on a busy 2-core machine a tiny step took
    4.8-6.6 s against 0.087 s with --threads 1. The trainer's rule (one thread for the
    tiny model, the cores for a real one) unless --threads or OMP_NUM_THREADS says."""
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    argv = ["--preset", preset]
    if threads == "--threads 2":
        argv += ["--threads", "2"]
    if threads == "OMP_NUM_THREADS=2":
        environment["OMP_NUM_THREADS"] = "2"
    script = ("import os, sys, torch\nfrom trainer.tools.probe import parse_args, prepare\n"
              "prepare(parse_args(sys.argv[1:]))\nprint(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120,
                            env=environment, cwd=Path(__file__).resolve().parents[1])
    expected = str(len(os.sched_getaffinity(0))) if threads == "cores" else threads[-1]
    assert result.stdout.split() == [expected, expected], result.stderr[-2000:]
