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
from dataclasses import dataclass
from pathlib import Path

import torch

from hadw_kernels import fused_linear_hadw_grpo_loss
from hadw_kernels import token_logprobs as fused_token_logprobs
from hadw_kernels.config import IGNORE_INDEX

from ..config import rollout_correction
from ..models.segment_attention import Segments, use_segment_attention


@dataclass
class SequenceBatch:
    """Prompts (left-padded) followed by responses (right-padded), as tensors.

    Hidden state ``prompt_width - 1 + j`` predicts response token ``j``; the loss takes
    the [b, response_width] slice of them (:meth:`loss_hidden_states`).
    """

    input_ids: torch.Tensor  # [b, prompt_width + response_width]
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor  # [b, response_width], IGNORE_INDEX on padding
    response_mask: torch.Tensor  # [b, response_width] bool
    prompt_width: int
    response_lengths: list[int]

    # A padded batch passes no offsets to the loss.
    cu_seqlens = None

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int,
              device: torch.device) -> "SequenceBatch":
        prompt_width = max(len(p) for p in prompts)
        response_width = max(1, max(len(r) for r in responses))
        rows = len(prompts)
        input_ids = torch.full((rows, prompt_width + response_width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full((rows, response_width), IGNORE_INDEX, dtype=torch.long)
        for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            input_ids[row, prompt_width - len(prompt):prompt_width] = torch.tensor(prompt)
            attention_mask[row, prompt_width - len(prompt):prompt_width + len(response)] = 1
            if response:
                input_ids[row, prompt_width:prompt_width + len(response)] = torch.tensor(response)
                labels[row, :len(response)] = torch.tensor(response)
        # Positions count real tokens only, as in the rollout engine (no padding there).
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return cls(input_ids.to(device), attention_mask.to(device), position_ids.to(device),
                   labels.to(device), (labels != IGNORE_INDEX).to(device), prompt_width,
                   [len(response) for response in responses])

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids)

    def loss_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, response_width, H]: the model's last hidden states that predict the responses."""
        width = self.labels.shape[1]
        return hidden_states[:, self.prompt_width - 1: self.prompt_width - 1 + width]

    def per_response(self, values: torch.Tensor) -> list[torch.Tensor]:
        """A per-token tensor of the loss's layout ([b, response_width]) cut into each
        response's values."""
        return [values[row, :length] for row, length in enumerate(self.response_lengths)]

    def from_responses(self, per_response: list[torch.Tensor]) -> torch.Tensor:
        """Each response's values placed in the loss's layout, zeros elsewhere."""
        values = torch.zeros(self.labels.shape, device=self.labels.device)
        for row, row_values in enumerate(per_response):
            values[row, :row_values.numel()] = row_values
        return values


@dataclass
class PackedBatch:
    """Padding-free: every sample's prompt and response in one row [1, N], positions
    restarting at 0 at each sample, no attention mask, no padding. The segment attention
    (``segment_attention.py``) is handed the samples' offsets and attends within each
    (docs/trainer.md, "Packed micro-batches").

    The loss takes the whole row, one segment per sample (``cu_seqlens``): hidden state
    t predicts token t + 1 of its segment, and ``response_mask`` marks the positions
    that predict a response token, so the prompts' hidden states enter no GEMM.
    """

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    labels: torch.Tensor  # [1, N], IGNORE_INDEX where no response token is predicted
    response_mask: torch.Tensor  # [1, N] bool
    cu_seqlens: torch.Tensor  # [S+1] int64: sample i is tokens cu_seqlens[i]:cu_seqlens[i+1]
    response_starts: list[int]  # where each response's first predicting position is
    response_lengths: list[int]
    attention_segments: Segments  # what each position attends to

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int | None,
              device: torch.device) -> "PackedBatch":
        """``pad_token_id`` is unused: nothing is padded (the padded batch's signature)."""
        ids: list[int] = []
        positions: list[int] = []
        offsets, starts = [0], []
        for prompt, response in zip(prompts, responses, strict=True):
            if not prompt:
                raise ValueError("a packed sample needs a prompt token to predict its response's first token from")
            starts.append(len(ids) + len(prompt) - 1)
            ids += prompt + response
            positions += range(len(prompt) + len(response))
            offsets.append(len(ids))
        labels = torch.full((len(ids),), IGNORE_INDEX, dtype=torch.long)
        for start, response in zip(starts, responses):
            if response:
                labels[start:start + len(response)] = torch.tensor(response)
        return cls(torch.tensor([ids], dtype=torch.long, device=device),
                   torch.tensor([positions], dtype=torch.long, device=device),
                   labels[None].to(device), (labels != IGNORE_INDEX)[None].to(device),
                   torch.tensor(offsets, dtype=torch.int64, device=device), starts,
                   [len(response) for response in responses], Segments.packed(offsets))

    def model_inputs(self) -> dict:
        return dict(input_ids=self.input_ids, attention_mask=None, position_ids=self.position_ids,
                    attention_segments=self.attention_segments)

    def loss_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[1, N, H]: every position; the loss reads only those that predict a response."""
        return hidden_states

    def per_response(self, values: torch.Tensor) -> list[torch.Tensor]:
        flat = values.reshape(-1)
        return [flat[start:start + length] for start, length in zip(self.response_starts, self.response_lengths)]

    def from_responses(self, per_response: list[torch.Tensor]) -> torch.Tensor:
        values = torch.zeros(self.labels.shape[1], device=self.labels.device)
        for start, row_values in zip(self.response_starts, per_response):
            values[start:start + row_values.numel()] = row_values
        return values[None]


@dataclass
class SharedPromptBatch(PackedBatch):
    """Packed, each prompt laid out once for the responses that follow it (consecutive
    samples with equal prompts: a group's G responses). A prompt of P tokens becomes a
    trunk of its first P - 1 tokens; each response of R tokens a branch of R positions:
    the prompt's last token, then the response's first R - 1 tokens, at positions P - 1
    onwards. A branch attends to the trunk and causally to itself, so position j of it
    has the hidden state it has in prompt + response and predicts response token j: a
    group costs P - 1 + G * R tokens instead of G * (P + R) in every layer.

    The loss's segments are one a response (its branch; the first of a group also holds
    the trunk, whose positions predict nothing), so its packed layout is the one above.
    A group whose responses are all empty lays out its whole prompt (the row is never empty).
    """

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int | None,
              device: torch.device) -> "SharedPromptBatch":
        """``pad_token_id`` is unused: nothing is padded (the padded batch's signature)."""
        ids: list[int] = []
        positions: list[int] = []
        labels: list[int] = []
        offsets, starts = [0], []
        segments: list[tuple[int, int, int, int]] = []  # (start, length, prefix start, prefix length)
        for prompt, group in _runs_of_equal_prompts(prompts, responses):
            if not prompt:
                raise ValueError("a packed sample needs a prompt token to predict its response's first token from")
            trunk_start = len(ids)
            trunk = prompt if not any(group) else prompt[:-1]
            ids += trunk
            positions += range(len(trunk))
            labels += [IGNORE_INDEX] * len(trunk)
            if trunk:
                segments.append((trunk_start, len(trunk), 0, 0))
            for response in group:
                start = len(ids)
                branch = (prompt[-1:] + response[:-1]) if response else []
                ids += branch
                positions += range(len(prompt) - 1, len(prompt) - 1 + len(branch))
                labels += response
                starts.append(start)
                offsets.append(len(ids))
                if branch:
                    segments.append((start, len(branch), trunk_start if trunk else 0, len(trunk)))
        label_tensor = torch.tensor(labels, dtype=torch.long)
        return cls(torch.tensor([ids], dtype=torch.long, device=device),
                   torch.tensor([positions], dtype=torch.long, device=device),
                   label_tensor[None].to(device), (label_tensor != IGNORE_INDEX)[None].to(device),
                   torch.tensor(offsets, dtype=torch.int64, device=device), starts,
                   [len(response) for response in responses], Segments.of(segments))


def _runs_of_equal_prompts(prompts: list[list[int]], responses: list[list[int]]):
    """(prompt, its responses) for each run of consecutive samples with equal prompts."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    runs: list[tuple[list[int], list[list[int]]]] = []
    for prompt, response in zip(prompts, responses):
        if runs and runs[-1][0] == prompt:
            runs[-1][1].append(response)
        else:
            runs.append((prompt, [response]))
    return runs


# The micro-batch layouts (train.packing, train.share_prompt) and the batch that builds each.
LAYOUTS = {"padded": SequenceBatch, "packed": PackedBatch, "shared_prompt": SharedPromptBatch}


def packed_layouts_serve(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention keeps each sample of a packed row to itself in both
    packed layouts: asked of the model, not of a list. Three samples (two sharing a prompt)
    are laid out packed and shared-prompt; each response position must get the hidden
    state it gets alone, and no sample may see another's tokens."""
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)

    def tokens(count):
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    shared = tokens(3)
    prompts, responses = [tokens(2), shared, shared], [tokens(3), tokens(4), tokens(2)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [response_hidden_states(model, SequenceBatch.build([prompt], [response], 0, device))[0]
                     for prompt, response in zip(prompts, responses)]
            for layout in (PackedBatch, SharedPromptBatch):
                batch = layout.build(prompts, responses, 0, device)
                hidden = response_hidden_states(model, batch)[0]
                for start, length, theirs in zip(batch.response_starts, batch.response_lengths, alone):
                    mine = hidden[start:start + length].float()
                    tolerance = 1e-3 if theirs.dtype in (torch.float32, torch.float64) else 5e-2
                    if (mine - theirs.float()).norm() > tolerance * theirs.float().norm():
                        return False
    except ValueError:  # the model's attention refused the row
        return False
    finally:
        model.train(was_training)
    return True


def choose_layout(model: torch.nn.Module, train) -> tuple[str, str]:
    """(layout, why) of the micro-batches (``LAYOUTS``) from ``train.packing`` and
    ``train.share_prompt`` (null: on where the segment attention serves the model), the
    model switched to the segment attention for a packed one. A forced layout that cannot
    serve the model is refused, naming its option. Asked before DeepSpeed partitions the
    model (ZeRO-3)."""
    wanted = train.packing is not False or train.share_prompt is True
    original = model.config._attn_implementation
    serves = wanted and use_segment_attention(model) and packed_layouts_serve(model)
    if not serves and wanted:
        model.set_attn_implementation(original)
        for option in ("share_prompt", "packing"):
            if getattr(train, option) is True:
                raise ValueError(
                    f"train.{option}=true, but this model's attention ({original}) cannot be confined to each "
                    "sample of a packed row (the segment attention, trainer/models/segment_attention.py, does not serve "
                    f"it); use train.{option}=false (or null)"
                )
    if not serves:
        why = "train.packing=false" if train.packing is False else \
            f"the segment attention does not serve this model's {original} attention"
        return "padded", why
    over = f"the segment attention over {original}"
    if train.share_prompt is False:
        return "packed", f"{over}; train.share_prompt=false"
    return "shared_prompt", f"{over}; each group's prompt laid out once"


def response_hidden_states(forward, batch: SequenceBatch | PackedBatch) -> torch.Tensor:
    """The last hidden states of ``forward`` (a causal LM or the DeepSpeed engine around
    one) that the loss takes (``batch.loss_hidden_states``). The LM head sees zero
    positions (``logits_to_keep`` is an empty index), so no logits exist."""
    outputs = forward(
        **batch.model_inputs(),
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=torch.empty(0, dtype=torch.long, device=batch.input_ids.device),
    )
    return batch.loss_hidden_states(outputs.hidden_states[-1])


def policy_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, batch: SequenceBatch | PackedBatch,
                old_logprobs: torch.Tensor, advantages: torch.Tensor, config, *,
                loss_normalizer: float, rollout_logprobs: torch.Tensor | None = None, correction=None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured loss of one micro-batch from its hidden states, on advantages formed
    once per rollout batch (so the rows need not hold whole groups); the rollout engine's
    log-probs corrected by ``correction`` (a RolloutCorrection), where they are given."""
    algo = config.algorithm
    return fused_linear_hadw_grpo_loss(
        hidden,
        lm_head_weight,
        batch.labels,
        old_logprobs,
        None,
        batch.response_mask,
        cu_seqlens=batch.cu_seqlens,
        advantages=advantages,
        loss_type=algo.loss_type,
        epsilon_low=algo.epsilon_low,
        epsilon_high=algo.epsilon_high,
        temperature=config.rollout.temperature,
        entropy_coef=algo.entropy_coef,
        loss_normalizer=loss_normalizer,
        max_response_length=config.rollout.max_new_tokens,
        rollout_logprobs=rollout_logprobs,
        rollout_correction=correction,
        return_metrics=True,
        backend=algo.loss_backend,
    )


class Policy:
    def __init__(self, model: torch.nn.Module, config, world_size: int) -> None:
        import deepspeed

        train, rollout = config.train, config.rollout
        self.config = config
        # What the loss does with the rollout engine's log-probs (None: nothing).
        self.correction = rollout_correction(config)
        self.zero_stage = train.zero_stage
        # The micro-batches' layout and why; the model switched to the segment attention when packed.
        self.layout, self.layout_because = choose_layout(model, train)
        self.batch_type = LAYOUTS[self.layout]
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # A torch optimizer, not one named in the DeepSpeed config: DeepSpeed would
        # otherwise build its fused Adam extension (~80 s and 2 GB on a CPU).
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
    def module(self) -> torch.nn.Module:
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

    def hidden_states(self, batch: SequenceBatch | PackedBatch) -> torch.Tensor:
        """The last hidden states the loss takes (``batch.loss_hidden_states``).

        Through the DeepSpeed engine's forward, not the decoder's: the engine clears
        ZeRO's per-micro-batch backward state there, and without that ZeRO-3 summed the
        micro-batches' gradients wrongly (60-75% off, tested against plain PyTorch).
        """
        return response_hidden_states(self.engine, batch)

    @torch.no_grad()
    def token_logprobs(self, batch: SequenceBatch | PackedBatch) -> torch.Tensor:
        """log pi(response token) in the loss's layout (0 where none is predicted),
        without logits."""
        hidden = self.hidden_states(batch)
        with self._gathered([self._lm_head_weight()]):
            logprobs = fused_token_logprobs(
                hidden,
                self._lm_head_weight(),
                batch.labels,
                temperature=self.config.rollout.temperature,
                ignore_index=IGNORE_INDEX,
                backend=self.config.algorithm.loss_backend,
            )
        return logprobs.float()

    def accumulate(self, batch: SequenceBatch | PackedBatch, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
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
        import torch.distributed as dist

        from ..checkpoint_files import hf_export_foreign_entries, write_hf_export_marker

        rank = dist.get_rank() if dist.is_initialized() else 0
        parameters = list(self.module.parameters())
        foreign: list[str] = []
        with self._gathered(parameters):  # ZeRO-3: the full weights on every rank
            if rank == 0:
                partial = directory.with_name(f".partial-{directory.name}")
                shutil.rmtree(partial, ignore_errors=True)
                self.module.save_pretrained(partial)
                tokenizer.save_pretrained(partial)
                write_hf_export_marker(partial)
                foreign = hf_export_foreign_entries(directory)
                if not foreign:
                    shutil.rmtree(directory, ignore_errors=True)
                    os.replace(partial, directory)
        if dist.is_initialized():
            dist.barrier()
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
