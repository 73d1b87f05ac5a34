"""Runs of TRL's GRPOTrainer and of this library's drop-in on the CPU, shared by the TRL
tests: a tiny Llama or Qwen2 built from a config and a word-level tokenizer, both
offline, a toy reward (the fraction of "7"s in a completion), a run short enough for a
test, and vLLM's sampling log-probs faked where a test needs its importance-sampling
correction."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trainer.models.tiny_model import build_tokenizer

TOKENIZER = build_tokenizer(["[PAD]", "[BOS]", "[EOS]"] + [str(digit) for digit in range(10)])
PROMPTS = Dataset.from_dict({"prompt": [f"{i} {i + 1}" for i in range(8)]})
# 4 prompts x 4 completions a generation batch, split into 4 micro-batches (shuffled),
# 2 per optimizer step: the second step has old log-probs and clips. SGD with a large
# rate, so that parameters after a step reflect the gradient and ratios move.
RUN = dict(
    per_device_train_batch_size=4, num_generations=4, steps_per_generation=4, gradient_accumulation_steps=2,
    max_completion_length=8, learning_rate=1.0, optim="sgd", logging_steps=1, report_to="none",
    save_strategy="no", use_cpu=True, bf16=False, seed=0,
)

# The drop-in's settings for stock TRL's numbers: the A/B recipe of docs/integrations/trl.md
# ("A/B against stock TRL"), which the tests comparing the two runs take as written.
STOCK_TRL = dict(use_hadw=False, hadw_shuffle="rows")


def tiny_model_dir(directory, head_scale: float = 1.0, architecture: str = "llama") -> str:
    """A tiny Llama (or Qwen2) saved to disk: TRL builds its reference model (beta > 0)
    from the path. ``head_scale`` multiplies the LM head's weights: the initialised model's
    next-token distributions are nearly uniform (entropies within 1e-5 of log V), a scaled
    head's are not."""
    shape = dict(
        vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=TOKENIZER.bos_token_id,
        eos_token_id=TOKENIZER.eos_token_id, pad_token_id=TOKENIZER.pad_token_id, tie_word_embeddings=False,
    )
    config = LlamaConfig(head_dim=16, **shape) if architecture == "llama" else Qwen2Config(**shape)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = (LlamaForCausalLM if architecture == "llama" else Qwen2ForCausalLM)(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(directory)
    return str(directory)


def sevens(completions, **_):
    return [completion.split().count("7") / max(len(completion.split()), 1) for completion in completions]


def train(trainer_class, config_class, model, output_dir, **options):
    trainer = trainer_class(
        model=model, reward_funcs=sevens, args=config_class(output_dir=str(output_dir), **{**RUN, **options}),
        train_dataset=PROMPTS, processing_class=TOKENIZER,
    )
    trainer.train()
    return trainer


def logged_steps(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


class BoundaryRecordingTrainer(GRPOTrainer):
    """Stock TRL, keeping what each of its token masks compares with its bound: the
    entropies and their quantile, and each response's mean KL and advantage."""

    recorded: dict[str, list] = {}  # reset for each run (train_recording_bounds)

    def get_high_entropy_mask(self, entropies, mask, threshold):
        local = entropies[mask.bool()].float().detach()
        BoundaryRecordingTrainer.recorded["entropy"].append((local, torch.quantile(local, threshold)))
        return super().get_high_entropy_mask(entropies, mask, threshold)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
        mean_kl = (kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        BoundaryRecordingTrainer.recorded["off_policy"].append((mean_kl, advantages.flatten().detach()))
        return GRPOTrainer.get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                               off_policy_threshold)


def train_recording_bounds(model, output_dir, trainer_class=BoundaryRecordingTrainer, **options):
    """Stock TRL (``trainer_class``, a BoundaryRecordingTrainer) and what its masks compared."""
    BoundaryRecordingTrainer.recorded = {"entropy": [], "off_policy": []}
    stock = train(trainer_class, GRPOConfig, model, output_dir, **options)
    return stock, BoundaryRecordingTrainer.recorded


# Two implementations' float32 values of one quantity differ by a few units in the last
# place (2.4e-7 at 2): a value this far from its bound is on the same side of it in both.
SIDE_MARGIN = 1e-5


def assert_masks_do_not_rest_on_rounding(recorded, options):
    """Why the integration's token masks equal TRL's: every entropy is the quantile itself
    (tokens of one context, equal on both sides) or farther from it than the two sides'
    rounding; every response's mean KL is 0 (before the first update, exactly 0 on both
    sides) or far from the off-policy threshold; and each mask removes something."""
    if options.get("top_entropy_quantile", 1.0) < 1.0:
        assert recorded["entropy"]
        for entropies, quantile in recorded["entropy"]:
            distances = (entropies - quantile).abs()
            assert float(distances[distances > 0].min()) > SIDE_MARGIN, (quantile, entropies)
            assert bool((entropies < quantile).any())
    if options.get("off_policy_mask_threshold") is not None:
        threshold = options["off_policy_mask_threshold"]
        assert recorded["off_policy"]
        dropped = 0
        for mean_kl, advantages in recorded["off_policy"]:
            moved = mean_kl[mean_kl != 0]
            assert bool(((moved - threshold).abs() > SIDE_MARGIN).all()), (threshold, mean_kl)
            dropped += int(((advantages < 0) & (mean_kl > threshold)).sum())
        assert dropped > 0


class VllmRollouts:
    """vLLM in a run, without vLLM: TRL's own generation draws the completions and each
    completion token gets a sampling log-prob in [-2.5, -0.9] that depends only on the
    token and its position, so that the stock trainer and the drop-in correct the same
    rollouts (TRL computes the old log-probs and the importance-sampling ratio whenever
    ``use_vllm``). Mixed in before the trainer class; ``use_vllm`` is switched on after
    the trainer is built, which builds no vLLM engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_vllm = True

    def _generate_single_turn(self, *args, **kwargs):
        self.use_vllm = False
        try:
            completion_ids, _ = super()._generate_single_turn(*args, **kwargs)
        finally:
            self.use_vllm = True
        logprobs = [[-2.5 + 0.4 * ((token + position) % 5) for position, token in enumerate(ids)]
                    for ids in completion_ids]
        return completion_ids, logprobs
