"""The policy under training: a causal LM in a DeepSpeed engine, and the three things
the trainer asks of it: old log-probs, one PPO update on a mini-batch, and its weights
for the rollout engine.

The loss reads the model's last hidden states and the LM head's weight, and the LM head
is applied to no position: ``fused_linear_hadw_grpo_loss`` forms the log-probs tile by
tile, so no [tokens, vocab] logits tensor exists. Under ZeRO-3 the head's weight is
gathered with ``GatheredParameters`` for the loss and its backward.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from hadw_kernels import distributed, fused_linear_hadw_grpo_loss
from hadw_kernels import token_logprobs as fused_token_logprobs
from hadw_kernels.layouts import LaidOutBatch, choose_layout
from hadw_kernels.tables.linear_blocks import IGNORE_INDEX

from .settings import loss_options, rollout_correction

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def response_hidden_states(forward, batch: LaidOutBatch) -> torch.Tensor:
    """The last hidden states of ``forward`` (a causal LM or the DeepSpeed engine around
    one) that the loss takes (``batch.loss_hidden_states``). The LM head sees zero
    positions (``logits_to_keep`` is an empty index), so no logits exist."""
    outputs = forward(
        **batch.model_inputs(forward),
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=torch.empty(0, dtype=torch.long, device=batch.input_ids.device),
    )
    return batch.loss_hidden_states(outputs.hidden_states[-1])


def policy_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, batch: LaidOutBatch,
                old_logprobs: torch.Tensor, advantages: torch.Tensor, config, *,
                loss_normalizer: float, rollout_logprobs: torch.Tensor | None = None, correction=None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured loss of one micro-batch from its hidden states, on advantages formed
    once per rollout batch (so the rows need not hold whole groups), one a row of the
    micro-batch; the rollout engine's log-probs corrected by ``correction`` (a
    RolloutCorrection), where they are given."""
    # With return_metrics=True the loss returns (loss, metrics); its annotation is the
    # union of both forms.
    return cast("tuple[torch.Tensor, dict[str, torch.Tensor]]", fused_linear_hadw_grpo_loss(
        hidden,
        lm_head_weight,
        batch.labels,
        old_logprobs,
        None,
        batch.response_mask,
        cu_seqlens=batch.cu_seqlens,
        advantages=batch.per_segment(advantages),
        loss_normalizer=loss_normalizer,
        rollout_logprobs=rollout_logprobs,
        rollout_correction=correction,
        return_metrics=True,
        **loss_options(config),
    ))


class Policy:
    def __init__(self, model: PreTrainedModel, config, world_size: int) -> None:
        import deepspeed

        train, rollout = config.train, config.rollout
        self.config = config
        # What the loss does with the rollout engine's log-probs (None: nothing).
        self.correction = rollout_correction(config)
        self.zero_stage = train.zero_stage
        # The micro-batches' layout and why; the model switched to the segment attention when packed.
        self.layout, self.layout_because, _ = choose_layout([model], train.layout, option="train.layout")
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # A torch optimizer, not one named in the DeepSpeed config: DeepSpeed would
        # otherwise build its fused Adam extension (docs/trainer.md, "Config reference").
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay
        )
        warmup = train.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        ds_config = {
            # A mini-batch holds as many micro-batches as its token budget cuts it into:
            # accumulate() marks the last, and DeepSpeed's own count (1) scales nothing.
            "train_micro_batch_size_per_gpu": train.mini_batch_prompts // world_size * rollout.group_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": train.gradient_clip,
            "zero_optimization": {"stage": train.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": config.model.dtype == "bfloat16"},
            "steps_per_print": 2**31 - 1,
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.device = self.engine.device

    @property
    def module(self) -> PreTrainedModel:
        return self.engine.module

    @contextlib.contextmanager
    def _gathered(self, parameters: list[torch.nn.Parameter]):
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(parameters):
                yield
        else:
            yield

    def _lm_head_weight(self) -> torch.nn.Parameter:
        return self.module.get_output_embeddings().weight

    def hidden_states(self, batch: LaidOutBatch) -> torch.Tensor:
        """The last hidden states the loss takes (``batch.loss_hidden_states``).

        Through the DeepSpeed engine's forward, not the decoder's: the engine clears
        ZeRO's per-micro-batch backward state there, and without that ZeRO-3 summed the
        micro-batches' gradients wrongly (tested against plain PyTorch; docs/trainer.md,
        "What one step does").
        """
        return response_hidden_states(self.engine, batch)

    @torch.no_grad()
    def token_logprobs(self, batch: LaidOutBatch) -> torch.Tensor:
        """log pi(response token) in the loss's layout (0 where none is predicted),
        without logits."""
        hidden = self.hidden_states(batch)
        with self._gathered([self._lm_head_weight()]):
            # Without with_entropy, the log-probs alone (its annotation: either form).
            logprobs = cast("torch.Tensor", fused_token_logprobs(
                hidden,
                self._lm_head_weight(),
                batch.labels,
                temperature=self.config.rollout.temperature,
                ignore_index=IGNORE_INDEX,
                backend=self.config.algorithm.loss_backend,
            ))
        return logprobs.float()

    def accumulate(self, batch: LaidOutBatch, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                   loss_normalizer: float, last: bool, rollout_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Forward and backward of one micro-batch, then DeepSpeed's step, which updates
        the weights after the ``last`` micro-batch of a mini-batch. Mini-batches hold
        varying numbers of micro-batches (token budgets), so the trainer, not DeepSpeed's
        fixed accumulation count, says where the optimizer step falls."""
        self.engine.set_gradient_accumulation_boundary(last)
        hidden = self.hidden_states(batch)
        with self._gathered([self._lm_head_weight()]):
            loss, metrics = policy_loss(hidden, self._lm_head_weight(), batch, old_logprobs, advantages,
                                        self.config, loss_normalizer=loss_normalizer,
                                        rollout_logprobs=rollout_logprobs,
                                        correction=None if rollout_logprobs is None else self.correction)
            # The normaliser already spreads the mini-batch over its micro-batches.
            self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()
        figures = {name: float(value.detach()) for name, value in metrics.items()}
        figures["loss"] = float(loss.detach())
        return figures

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def learning_rate(self) -> float:
        return float(self.engine.get_lr()[0])

    def export_hf(self, directory: Path, tokenizer) -> None:
        """Saves the policy as a Hugging Face directory (weights, config, tokenizer) that
        ``from_pretrained`` and vLLM load; collective under ZeRO-3, rank 0 writes.

        The directory is replaced whole, so it is replaced only when it holds nothing but
        what a previous export wrote (``hf_export_foreign_entries``: a file the user added
        to it since is the user's; config validation refuses such a run before training,
        docs/trainer.md). Files that appeared during the run are kept: the new export is
        left beside them and rank 0 raises, after the collective."""
        from ..checkpoint_files import hf_export_foreign_entries, write_hf_export_marker

        parameters = list(self.module.parameters())
        foreign: list[str] = []
        with self._gathered(parameters):  # ZeRO-3: the full weights on every rank
            if distributed.rank() == 0:
                partial = directory.with_name(f".partial-{directory.name}")
                shutil.rmtree(partial, ignore_errors=True)
                self.module.save_pretrained(partial)
                tokenizer.save_pretrained(partial)
                write_hf_export_marker(partial)
                foreign = hf_export_foreign_entries(directory)
                if not foreign:
                    shutil.rmtree(directory, ignore_errors=True)
                    os.replace(partial, directory)
        distributed.barrier()
        if foreign:
            raise FileExistsError(
                f"{directory} holds {foreign[:8]}, which the trainer did not write: it was left as it is and the "
                f"trained model saved to {partial} instead; move your files out of {directory.name}/ "
                "(the trainer replaces that directory whole)"
            )

    def weights_for_rollout(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the checkpoint's naming, for the engine's reload_weights."""
        for name, parameter in self.module.named_parameters():
            if self.zero_stage == 3:
                # A copy: the gathered tensor is released when the context closes.
                with self._gathered([parameter]):
                    yield name, parameter.detach().clone()
            else:
                yield name, parameter.detach()
