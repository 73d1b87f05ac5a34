"""The TRL drop-in's layouts (hadw_layout, hadw_shuffle; docs/integrations/trl.md,
"Layouts") against stock TRL 1.16 on the CPU: with HA-DW off, a run in each layout is
TRL's (the loss, the parameters after two SGD steps, so every gradient, and every figure
TRL logs), whichever rows its shuffled micro-batches hold.

The layouts feed the model the same tokens as TRL's padded rows, at positions counted
from each sample's first real token, where TRL counts from the row's first (padding
included); rotary embeddings see only the positions' differences, so the two agree to
float32 rounding, which the tolerance (1e-5 relative) covers with a margin of ~20x."""

import pytest
import torch

pytest.importorskip("trl", reason="the trl extra is not installed")
from trl import GRPOConfig  # noqa: E402
from trl_runs import (  # noqa: E402
    PROMPTS,
    RUN,
    STOCK_TRL,
    TOKENIZER,
    BoundaryRecordingTrainer,
    VllmRollouts,
    assert_masks_do_not_rest_on_rounding,
    logged_steps,
    tiny_model_dir,
    train,
    train_recording_bounds,
)

from hadw_kernels.integrations.trl import HADWGRPOConfig, HADWGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow

LOSS_TYPES = {
    "grpo": dict(loss_type="grpo"),
    "dapo": dict(loss_type="dapo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    "dr_grpo": dict(loss_type="dr_grpo"),
}
FEATURES = {
    "plain": {},
    "entropy_mask": dict(top_entropy_quantile=0.5),
    # Per-token ratios masked outside [0.3, 3]: the faked sampling log-probs put some there.
    "vllm_correction": dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.3,
                            vllm_importance_sampling_clip_max=3.0),
}
# Every value of each axis with every value of every other: 16 runs instead of the 96 of
# the full product (layout x loss type x feature x model).
CASES = [
    ("padded", "grpo", "plain", "llama"), ("packed", "grpo", "entropy_mask", "qwen2"),
    ("shared_prompt", "grpo", "vllm_correction", "llama"), ("packed", "dapo", "plain", "llama"),
    ("shared_prompt", "dapo", "entropy_mask", "llama"), ("padded", "dapo", "vllm_correction", "qwen2"),
    ("shared_prompt", "gspo", "plain", "qwen2"), ("padded", "gspo", "entropy_mask", "llama"),
    ("packed", "gspo", "vllm_correction", "qwen2"), ("packed", "dr_grpo", "plain", "llama"),
    ("shared_prompt", "dr_grpo", "entropy_mask", "qwen2"), ("padded", "dr_grpo", "vllm_correction", "llama"),
    ("prefix_tree", "grpo", "plain", "qwen2"), ("prefix_tree", "dapo", "vllm_correction", "llama"),
    ("prefix_tree", "gspo", "entropy_mask", "qwen2"), ("prefix_tree", "dr_grpo", "plain", "llama"),
]
# What TRL logs that is time, not arithmetic.
UNCOMPARED = {"step_time"}
# What TRL logs and the drop-in does not (docs/integrations/trl.md, "Metrics"): per-response
# extremes of the clip fractions, which the fused loss does not form.
NOT_LOGGED = {"clip_ratio/low_min", "clip_ratio/high_max", "vespo/phi_seq_mean"}
# What the drop-in logs beside TRL's: the tokens its layout fed the model.
DROP_IN_LOGGED = {"hadw/fed_tokens"}


class StockWithVllm(VllmRollouts, BoundaryRecordingTrainer):
    pass


class DropInWithVllm(VllmRollouts, HADWGRPOTrainer):
    pass


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A model whose entropies spread (the entropy mask's quantile far from every other
    entropy: tests/trl_runs.py) for each architecture; and the plain Llama, whose smaller
    steps keep a reference model's KL where TRL's unclamped log-ratio and the library's
    clamped one agree (docs/math.md, "Where the hosts differ")."""
    dirs = {architecture: tiny_model_dir(tmp_path_factory.mktemp(architecture), head_scale=16.0,
                                         architecture=architecture)
            for architecture in ("llama", "qwen2")}
    dirs["plain"] = tiny_model_dir(tmp_path_factory.mktemp("plain"))
    return dirs


def assert_runs_equal(stock, fused, *, per_micro_batch_metrics: bool = True):
    stock_steps, fused_steps = logged_steps(stock), logged_steps(fused)
    assert len(stock_steps) == len(fused_steps) > 0
    for expected, got in zip(stock_steps, fused_steps):
        assert set(got) == (set(expected) - NOT_LOGGED) | DROP_IN_LOGGED
        for name in set(got) - UNCOMPARED - DROP_IN_LOGGED:
            if per_micro_batch_metrics or name in ("loss", "grad_norm") or not name.startswith(("entropy", "clip")):
                assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    for expected, got in zip(stock.model.parameters(), fused.model.parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("layout", "loss_type", "feature", "architecture"), CASES)
def test_each_layout_is_trl(layout, loss_type, feature, architecture, model_dirs, tmp_path):
    """Micro-batches of 4 rows of a generation batch of 16 (4 prompts x 4), shuffled by
    rows as TRL does, two to an optimizer step: each splits groups."""
    options = dict(LOSS_TYPES[loss_type], **FEATURES[feature], max_steps=2, hadw_layout=layout)
    with_vllm = feature == "vllm_correction"
    stock, recorded = train_recording_bounds(model_dirs[architecture], tmp_path / "stock",
                                             trainer_class=StockWithVllm if with_vllm else BoundaryRecordingTrainer,
                                             **{k: v for k, v in options.items() if not k.startswith("hadw_")})
    assert_masks_do_not_rest_on_rounding(recorded, options)
    fused = train(DropInWithVllm if with_vllm else HADWGRPOTrainer, HADWGRPOConfig, model_dirs[architecture],
                  tmp_path / "fused", **STOCK_TRL, **options)
    assert fused.layout.name == layout and not fused.shuffles_groups
    if with_vllm:
        assert any(step["sampling/importance_sampling_ratio/min"] == 0 for step in logged_steps(stock))
    assert_runs_equal(stock, fused)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_group_shuffle_changes_no_step_that_takes_the_whole_generation_batch(loss_type, model_dirs, tmp_path):
    """hadw_shuffle='auto' shuffles whole groups where each optimizer step takes a whole
    generation batch (its micro-batches then each hold one prompt's completions, laid out
    once): the loss and the parameters are TRL's; what TRL logs as a mean over the
    micro-batches (entropy, clip fractions) averages other micro-batches. One step: the
    shuffle draws from torch's generator, so later generations sample other completions."""
    options = dict(LOSS_TYPES[loss_type], max_steps=1, gradient_accumulation_steps=4)
    stock = train(BoundaryRecordingTrainer, GRPOConfig, model_dirs["llama"], tmp_path / "stock", **options)
    fused = train(HADWGRPOTrainer, HADWGRPOConfig, model_dirs["llama"], tmp_path / "fused", use_hadw=False,
                  **options)
    assert fused.layout.name == "prefix_tree" and fused.shuffles_groups
    assert_runs_equal(stock, fused, per_micro_batch_metrics=False)


class RecordingGroups(HADWGRPOTrainer):
    """Keeps the prompts each micro-batch of the training forward holds."""

    held: list = []

    def _fused_loss(self, unwrapped, inputs, mode):
        RecordingGroups.held.append(inputs["prompt_ids"].tolist())
        return super()._fused_loss(unwrapped, inputs, mode)


def test_groups_shuffled_whole_reach_each_micro_batch_together(model_dirs, tmp_path):
    RecordingGroups.held = []
    train(RecordingGroups, HADWGRPOConfig, model_dirs["llama"], tmp_path, max_steps=1, gradient_accumulation_steps=4)
    assert len(RecordingGroups.held) == 4
    for prompts in RecordingGroups.held:  # 4 rows: one prompt's 4 completions
        assert all(prompt == prompts[0] for prompt in prompts)


@pytest.mark.parametrize(("layout", "options"), [
    ("shared_prompt", dict(beta=0.05, use_bias_correction_kl=False, num_iterations=2)),
    ("packed", dict(gradient_checkpointing=True)),
    ("shared_prompt", dict(peft="lora")),
    ("packed", dict(loss_type="bnpo", mask_truncated_completions=True, max_completion_length=5)),
])
def test_what_trl_users_combine_it_with(layout, options, model_dirs, tmp_path):
    """A reference model (its log-probs through the layout too) and several PPO
    iterations a generation batch (old log-probs); gradient checkpointing; a LoRA
    adapter; completions cut at the length limit and masked whole (an empty response)."""
    options = dict(options, max_steps=2)
    stock_options, fused_options = dict(options), dict(options, hadw_layout=layout)
    extra = {}
    if options.get("peft"):
        peft = pytest.importorskip("peft", reason="peft is not installed")
        for each in (stock_options, fused_options):
            each.pop("peft")
        extra = dict(peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    stock = _train_with(BoundaryRecordingTrainer, GRPOConfig, model_dirs["plain"], tmp_path / "stock", extra,
                        stock_options)
    fused = _train_with(HADWGRPOTrainer, HADWGRPOConfig, model_dirs["plain"], tmp_path / "fused", extra,
                        dict(fused_options, **STOCK_TRL))
    assert fused.layout.name == layout
    assert_runs_equal(stock, fused)


def _train_with(trainer_class, config_class, model, output_dir, extra, options):
    trainer = trainer_class(model=model, reward_funcs=_sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
                            args=config_class(output_dir=str(output_dir), **{**RUN, **options}), **extra)
    trainer.train()
    return trainer


def _sevens(completions, **_):
    return [completion.split().count("7") / max(len(completion.split()), 1) for completion in completions]


def test_the_layout_is_chosen_when_the_trainer_is_built(model_dirs, tmp_path, caplog):
    """The choice is logged at INFO under TRL's own verbosity (``log_level``), as a TRL user
    sets it; at ``log_level="warning"`` it is not."""
    chosen = "the prefix_tree layout (hadw_layout='auto', the segment attention over sdpa)"
    for log_level in ("warning", "info"):
        caplog.clear()
        trainer = HADWGRPOTrainer(model=model_dirs["llama"], reward_funcs=_sevens, train_dataset=PROMPTS,
                                  processing_class=TOKENIZER,
                                  args=HADWGRPOConfig(output_dir=str(tmp_path), **RUN, log_level=log_level))
        assert (chosen in caplog.text) == (log_level == "info"), log_level
    assert trainer.layout.name == "prefix_tree"
    assert trainer.model.config._attn_implementation == "hadw_segments_over_sdpa"
    with pytest.raises(ValueError, match="unknown hadw_layout 'ragged'"):
        HADWGRPOConfig(output_dir=str(tmp_path), **RUN, hadw_layout="ragged")
    with pytest.raises(ValueError, match="unknown hadw_shuffle 'tokens'"):
        HADWGRPOConfig(output_dir=str(tmp_path), **RUN, hadw_shuffle="tokens")


def test_the_layout_choice_reaches_stderr_without_a_logging_config(model_dirs, tmp_path, capsys, monkeypatch):
    """A TRL user who configured no logging (no handler up the logger's chain, which
    pytest's capture would otherwise be) still sees the INFO line with log_level="info",
    on stderr, as transformers' own lines."""
    import logging

    from hadw_kernels.integrations import trl as drop_in

    monkeypatch.setattr(drop_in.logger, "propagate", False)
    monkeypatch.setattr(drop_in.logger, "handlers", [])  # the handler the trainer adds goes with the test
    HADWGRPOTrainer(model=model_dirs["llama"], reward_funcs=_sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
                    args=HADWGRPOConfig(output_dir=str(tmp_path), **RUN, log_level="info"))
    assert [type(handler) for handler in drop_in.logger.handlers] == [logging.StreamHandler]
    assert "HADWGRPOTrainer: the model's forwards in the prefix_tree layout" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["auto", "packed"])
def test_a_model_the_segment_attention_cannot_serve(layout, tmp_path):
    """Sliding-window attention: "auto" stays padded, a packed layout is refused by name."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model_dir(tmp_path / "qwen2", architecture="qwen2")
    model = AutoModelForCausalLM.from_pretrained(directory)
    model.config.use_sliding_window, model.config.sliding_window = True, 4

    def build():
        return HADWGRPOTrainer(model=model, reward_funcs=_sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
                               args=HADWGRPOConfig(output_dir=str(tmp_path), **RUN, hadw_layout=layout))

    if layout == "auto":
        with pytest.warns(UserWarning, match=r"hadw_layout='auto' feeds this model padded rows: this model's "
                                             r"attention \(sdpa\) has sliding"):
            assert build().layout.name == "padded"
    else:
        with pytest.raises(ValueError, match=r"hadw_layout='packed': this model's attention \(sdpa\) has sliding"):
            build()
    assert model.config._attn_implementation == "sdpa"


def test_the_layout_is_reported_where_a_user_looks(model_dirs, tmp_path):
    """An eager-attention model falls back to padded rows with a warning (shown at TRL's
    default verbosity, where the choice's INFO line is not); every logged step holds
    the tokens the layout fed the model, beside TRL's own figures."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(model_dirs["plain"], attn_implementation="eager")
    with pytest.warns(UserWarning, match=r"hadw_layout='auto' feeds this model padded rows: this model's attention "
                                         r"\(eager\) is not one the segment attention can wrap"):
        trainer = HADWGRPOTrainer(model=eager, reward_funcs=_sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
                                  args=HADWGRPOConfig(output_dir=str(tmp_path / "eager"), **RUN))
    assert trainer.layout.name == "padded"
    fed = {}
    for layout in ("padded", "shared_prompt", "prefix_tree"):
        run = train(HADWGRPOTrainer, HADWGRPOConfig, model_dirs["plain"], tmp_path / layout, max_steps=1,
                    gradient_accumulation_steps=4, hadw_layout=layout)
        (step,) = logged_steps(run)
        fed[layout] = step["hadw/fed_tokens"]
    assert 0 < fed["prefix_tree"] < fed["shared_prompt"] < fed["padded"]


def test_vision_language_inputs_stay_padded(tmp_path):
    import types

    trainer = types.SimpleNamespace(args=types.SimpleNamespace(hadw_layout="auto"), _is_vlm=True, ref_model=None)
    layout, why = HADWGRPOTrainer._choose_layout(trainer, None)
    assert layout.name == "padded" and "vision-language" in why
    trainer.args.hadw_layout = "shared_prompt"
    with pytest.raises(ValueError, match="hadw_layout='shared_prompt': vision-language inputs stay padded"):
        HADWGRPOTrainer._choose_layout(trainer, None)


@pytest.mark.parametrize(("layout", "distribution"), [("shared_prompt", None), ("packed", "zero2"),
                                                      ("prefix_tree", "zero3")],
                         ids=["ddp", "zero2", "zero3"])
def test_two_ranks(layout, distribution, model_dirs, tmp_path):
    """Two CPU ranks under torchrun (DDP, and DeepSpeed ZeRO-2 and ZeRO-3 with every
    parameter partitioned): the drop-in in a layout trains as stock TRL does, each rank's
    old-log-prob forwards as many as TRL's (ZeRO-3 gathers the weights in each)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed", reason="the trainer extra is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "runs.pt"
    script = Path(__file__).resolve().parent / "trl_two_ranks.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(script), model_dirs["plain"], str(out), layout, *([distribution] if distribution else [])]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=environment)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = torch.load(out)
    stock, fused = runs["stock"], runs["drop-in"]
    assert fused["layout"] == layout
    assert len(stock["steps"]) == len(fused["steps"]) == 2
    for expected, got in zip(stock["steps"], fused["steps"]):
        for name in ("loss", "grad_norm", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean"):
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    for name, expected in stock["parameters"].items():
        torch.testing.assert_close(fused["parameters"][name], expected, rtol=1e-5, atol=1e-6)
