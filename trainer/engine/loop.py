"""The training loop: rollout, reward, anchor, PPO update, weight sync, log, checkpoint.

One iteration handles one rollout batch: each rank samples its share of the prompts
(G responses each), scores them, and the difficulty anchor folds in the batch's
accuracy once (all-reduced, so every rank holds the same belief), and each response's
advantage A_hat * Phi is formed once. The old log-probs are taken from the policy before
any update; then ``ppo_epochs`` passes over the batch in mini-batches (one optimizer step
each), each mini-batch in micro-batches (any responses, cut by a token budget or by
prompts: ``micro_batches.py``) whose losses add up to the mini-batch loss. The updated
weights go into the rollout engine before the next batch.

A batch whose every group got equal rewards has zero advantage everywhere: its gradient
is exactly zero (without an entropy bonus), so the forward and backward are skipped and
the weights stay as they are. The batch is still logged and still folded into the
anchor, since its accuracy is an observation like any other.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hadw_kernels import LOSS_PRESETS, DifficultyAnchor, PromptHistory, all_equal_groups, hadw_advantages, prompt_key
from hadw_kernels.advantage.history import DEFAULT_DISCOUNT, DEFAULT_PRIOR_STRENGTH
from hadw_kernels.config.loss_config import AUTHORS_LAMBDA_SCALE, DEFAULT_LAMBDA_SCALE
from hadw_kernels.distributed import all_gather_rows, all_reduce, barrier
from hadw_kernels.layouts import RowTokens
from hadw_kernels.tables.estimators import ESTIMATORS
from hadw_kernels.tables.metrics import METRIC_MEAN_OVER

from ..tasks.problem import Problem, encode_prompt
from ..tasks.registry import TASKS
from ..tasks.rewards import build_reward
from ..tasks.synthetic_task import MAX_SYNTHETIC_PROMPT_TOKENS, VOCABULARY, pool_id_tokens
from .checkpoint import load_checkpoint, save_checkpoint
from .metrics_log import JsonlLog, MetricsLog, read_metrics
from .micro_batches import by_prompt_count, loss_normalizer, pack_by_tokens, split_to_count
from .policy import Policy
from .settings import resolve_engine

MAX_ERROR_MESSAGES = 20
# The all-degenerate warning: the first few times, then every this many steps.
DEGENERATE_WARNINGS_FIRST = 3
DEGENERATE_WARNINGS_EVERY = 20


def build_anchor(algo) -> tuple[DifficultyAnchor, float]:
    """The anchor and lambda_scale of the configured preset."""
    if algo.anchor_preset == "authors_code":
        return DifficultyAnchor.authors_code(), algo.lambda_scale or AUTHORS_LAMBDA_SCALE
    options = {
        name: value
        for name, value in (("eta", algo.anchor_eta), ("window", algo.anchor_window), ("eta_min", algo.anchor_eta_min))
        if value is not None
    }
    rule = "kalman" if algo.anchor_preset == "kalman" else "soft"
    return DifficultyAnchor(rule, belief="prior", **options), algo.lambda_scale or DEFAULT_LAMBDA_SCALE


def build_history(algo) -> PromptHistory:
    """Every run keeps its prompts' history (cheap: two numbers a prompt), whatever its
    estimator, so the bias tool can score ``prompt_history`` at any run's checkpoints."""
    discount = DEFAULT_DISCOUNT if algo.history_discount is None else algo.history_discount
    strength = DEFAULT_PRIOR_STRENGTH if algo.history_prior_strength is None else algo.history_prior_strength
    return PromptHistory(discount=discount, prior_strength=strength)


def batch_advantages(rewards: torch.Tensor, group_size: int, algo, lambda_scale: float, belief: float,
                     prior: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """A * Phi of every response of the whole rollout batch (every rank's, gathered, its
    groups whole and in order; the batch estimators read the other ranks' groups too),
    formed once so that micro-batches may take any rows, and the groups' figures
    (phi_mean, zero_std_frac) the loss cannot see once given advantages. ``prior``: each
    response's (alpha, beta), read by the history estimators."""
    row = ESTIMATORS[algo.advantage_estimator]
    normalize_std = LOSS_PRESETS[algo.loss_type].normalize_std if algo.normalize_std is None else algo.normalize_std
    normalize_std = normalize_std and row.takes_std
    advantages, phi = hadw_advantages(rewards, group_size=group_size, anchor=belief if algo.hadw else None,
                                      lambda_scale=lambda_scale, normalize_std=normalize_std, estimator=row.name,
                                      prior=prior if row.scope == "history" else None, return_phi=True)
    all_equal = all_equal_groups(rewards, group_size).float()
    return advantages, {"phi_mean": float(phi.mean()), "zero_std_frac": float(all_equal.mean())}


class UpdateFigures:
    """The loss and the metrics of one update, the same however its mini-batches are cut
    into micro-batches and its rollout batch over ranks. A micro-batch's loss is its share
    of its mini-batch's (the loss normaliser), so the shares add up to the mini-batch's
    loss, which is averaged over the mini-batches (and PPO epochs) and the ranks (as
    DeepSpeed averages their gradients). A metric is a mean over the micro-batch's tokens
    or responses (``METRIC_MEAN_OVER``), so each value is weighed by that count."""

    def __init__(self, sequence_level: bool) -> None:
        self.sequence_level = sequence_level
        self.loss = 0.0
        self.mini_batches = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, name: str, mean: float, count: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + mean * count
        self.counts[name] = self.counts.get(name, 0.0) + count

    def add_micro_batch(self, figures: dict[str, float], response_lengths: list[int]) -> None:
        """A micro-batch's figures (``Policy.accumulate``) and its responses' lengths."""
        tokens = float(sum(response_lengths))
        responses = float(sum(1 for length in response_lengths if length > 0))
        counts = {"tokens": tokens, "ratios": responses if self.sequence_level else tokens}
        for name, value in figures.items():
            if name == "loss":
                self.loss += value
            else:
                self.add(name, value, counts[METRIC_MEAN_OVER[name]])

    def end_mini_batch(self) -> None:
        self.mini_batches += 1

    def result(self, world_size: int) -> dict[str, float]:
        """Over every rank (one all-reduce; collective): the mean mini-batch loss and each
        metric's mean over all its tokens or responses (0 where there were none)."""
        names = sorted(self.sums)
        totals = torch.tensor([self.loss, *(self.sums[name] for name in names), *(self.counts[name] for name in names)],
                              dtype=torch.float64)
        reduced: list[float] = all_reduce(totals).tolist()
        sums, counts = reduced[1:1 + len(names)], reduced[1 + len(names):]
        result = {"loss": reduced[0] / (self.mini_batches * world_size)}
        result.update((name, total / count if count else 0.0) for name, total, count in zip(names, sums, counts))
        return result


def _logprob_gap(trainer_logprobs: list[torch.Tensor], engine_logprobs: list[list[float]]) -> float:
    """Largest |trainer - engine| log-prob of a sampled token in a micro-batch (each
    response's values)."""
    gaps = [float((mine - torch.tensor(theirs, device=mine.device)).abs().max())
            for mine, theirs in zip(trainer_logprobs, engine_logprobs) if len(theirs)]
    return max(gaps, default=0.0)


class Trainer:
    def __init__(self, config, rank: int, world_size: int, checkpoint: Path | None,
                 resumed_changes: dict[str, list] | None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.run_dir = config.run_dir
        self.group_size = config.rollout.group_size
        self.prompts_per_rank = config.train.prompts_per_step // world_size
        self.engine_name = resolve_engine(config.rollout.engine)
        # A resumed run keeps the config it trained with (run.py saves a new run's): the
        # settings a resume changes (``resumed_changes``, which run.py checked) are recorded
        # in resumes.jsonl instead.
        barrier()

        self.tokenizer, model, model_dir = self._build_model()
        self._build_prompt_source()
        self.policy = Policy(model, config, world_size)
        self.anchor, self.lambda_scale = build_anchor(config.algorithm)
        self.history = build_history(config.algorithm)
        self.reward = build_reward(config.data, config.reward)
        self.error_messages = 0
        self.degenerate_steps = 0
        self.warned_oversized = False

        self.start_step = 0
        if checkpoint is not None:
            self.start_step = load_checkpoint(checkpoint, self.policy.engine, self.anchor, self.history)
        # run.py finds changed settings only for a run resumed from a checkpoint.
        if rank == 0 and checkpoint is not None and resumed_changes is not None:
            with (self.run_dir / "resumes.jsonl").open("a") as handle:
                handle.write(json.dumps({"step": self.start_step, "checkpoint": checkpoint.name,
                                         "changed": resumed_changes}) + "\n")
        self.rollout = self._build_rollout(model_dir)
        # The engine starts from the files on disk; after a resume they are stale.
        if self.rollout.needs_weight_sync and self.start_step > 0:
            self.rollout.sync_weights(self.policy.weights_for_rollout())
        self.log = MetricsLog(
            self.run_dir / "metrics.jsonl",
            total_steps=config.train.steps,
            first_step=self.start_step,
            enabled=rank == 0,
            progress=config.run.progress,
        )
        # Each step's groups (prompt key, successes): the prompts' history at any discount
        # can be rebuilt from it (the bias tool's --history-discounts).
        self.outcomes = JsonlLog(self.run_dir / "outcomes.jsonl", first_step=self.start_step, enabled=rank == 0)
        self.samples = JsonlLog(self.run_dir / "samples.jsonl", first_step=self.start_step,
                                enabled=rank == 0 and config.run.log_samples > 0)
        # Cut back to before the first step: the run evaluates its first step (again).
        self.evaluations = JsonlLog(self.run_dir / "eval.jsonl", first_step=self.start_step - 1,
                                    enabled=rank == 0 and config.eval.every > 0)
        if checkpoint is not None:
            self.log.message(f"resumed from {checkpoint} at step {self.start_step}")
        self.log.message(f"micro-batches: {self.policy.layout.name.replace('_', '-')} ({self.policy.layout_because})")
        correction = self.policy.correction
        self.log.message("rollout correction: " + (
            f"{correction.level}_{correction.rule} of the engine's log-probs within [{correction.lower or 0}, "
            f"{correction.upper or 'inf'}] (metrics rollout_is_mean, rollout_is_corrected_frac)" if correction is not None
            else f"off ({self._correction_off_because()})"))

    def _correction_off_because(self) -> str:
        if self.engine_name == "hf":
            return "the HF engine samples from the trainer's own policy"
        if self.config.algorithm.rollout_correction == "none":
            return "algorithm.rollout_correction=none"
        return "vLLM's log-probs are untempered, the trainer's at rollout.temperature != 1"

    # -- construction -----------------------------------------------------------------

    def _build_model(self):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_config = self.config.model
        dtype = getattr(torch, model_config.dtype)
        if model_config.path:
            from ..models.pretrained import cached_model_dir, ensure_converted, resolve_model_source

            source = resolve_model_source(model_config.path)
            if self.rank == 0:
                ensure_converted(source, model_config.cache_dir)
            barrier()
            model_dir = cached_model_dir(source, model_config.cache_dir)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
            return tokenizer, model, model_dir
        from ..models.tiny_model import build_tiny_model, build_tokenizer, save_initial_model

        tokenizer = build_tokenizer(VOCABULARY)
        # Positions for the longest prompt (its context, its pool identifier and exemplars
        # included: an exemplar, a prompt and its one-token answer, is at most a prompt's
        # length) and response.
        data = self.config.data
        positions = (data.context_tokens + pool_id_tokens(data.prompt_pool)
                     + (data.exemplars + 1) * MAX_SYNTHETIC_PROMPT_TOKENS + self.config.rollout.max_new_tokens)
        model = build_tiny_model(model_config, tokenizer, self.config.train.seed, positions).to(dtype)
        model_dir = self.run_dir / "initial_model"
        if self.rank == 0 and not (model_dir / "config.json").exists():
            save_initial_model(model, tokenizer, model_dir, self.run_dir / "tokenizer")
        barrier()
        return tokenizer, model, model_dir

    def _build_prompt_source(self) -> None:
        """The run's problems, from its task's row: the levels, the held-out set (with
        eval.every) and each step's problems."""
        config = self.config
        self.prompts = TASKS[config.data.task].prompt_source(config.data, config.eval, config.train.seed)
        self.levels: list[str] = self.prompts.levels
        self.held_out: list[Problem] = self.prompts.held_out

    def _build_rollout(self, model_dir: Path):
        from .rollout import HFRollout, VLLMRollout

        rollout = self.config.rollout
        if self.engine_name == "hf":
            synced = self.config.train.zero_stage == 3 and self.world_size > 1
            return HFRollout(self.policy.module, rollout, pad_token_id=self.tokenizer.pad_token_id,
                             eos_token_id=self.tokenizer.eos_token_id, synced_gpus=synced)
        positions = self.policy.module.config.max_position_embeddings
        return VLLMRollout(
            model_dir, rollout, verbose=self.config.run.verbose,
            dtype=self.config.model.dtype,
            max_model_len=min(positions, self.config.data.max_prompt_tokens + rollout.max_new_tokens),
            eos_token_id=self.tokenizer.eos_token_id,
            world_size=self.world_size,
            seed=self.config.train.seed,
        )

    # -- one rollout batch -------------------------------------------------------------

    def _problems(self, step: int) -> list[Problem]:
        return self.prompts.problems(step, self.prompts_per_rank, self.rank, self.world_size)

    def _encode(self, prompt: str) -> list[int]:
        data = self.config.data
        return encode_prompt(self.tokenizer, prompt, apply_chat_template=data.apply_chat_template,
                             max_prompt_tokens=data.max_prompt_tokens)

    def train_step(self, step: int) -> dict:
        config = self.config
        started = time.perf_counter()
        problems = self._problems(step)
        prompt_ids = [self._encode(problem.prompt) for problem in problems]
        seeds = [int(s) for s in np.random.SeedSequence([config.train.seed, step, self.rank]).generate_state(len(problems))]
        responses, engine_logprobs = self.rollout.generate(prompt_ids, seeds)
        rolled_out = time.perf_counter()

        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        per_response = [problem for problem in problems for _ in range(self.group_size)]
        scored = self.reward(texts, per_response)
        self._report_errors(step, scored.errors)
        rewards = torch.tensor(scored.rewards, dtype=torch.float32)
        rewarded = time.perf_counter()

        belief = self.anchor.update(rewards)  # once per rollout batch, all-reduced
        # Both once per rollout batch, over every rank's responses: the history is the same
        # on every rank, and each rank keeps its own rows' advantages.
        keys = [prompt_key(ids) for ids in prompt_ids]
        with warnings.catch_warnings():
            if ESTIMATORS[self.config.algorithm.advantage_estimator].scope != "history":
                # Kept for the bias tool alone: prompts that seldom recur cost this run nothing.
                warnings.filterwarnings("ignore", message="PromptHistory: no prompt key has recurred")
            prior = self.history.update(rewards, [key for key in keys for _ in range(self.group_size)])
        own_rows = slice(self.rank * len(rewards), (self.rank + 1) * len(rewards))
        all_rewards = all_gather_rows(rewards)
        all_advantages, group_figures = batch_advantages(all_rewards, self.group_size, self.config.algorithm,
                                                         self.lambda_scale, belief, all_gather_rows(prior))
        self.outcomes.write({"step": step + 1, "size": self.group_size,
                             "keys": all_gather_rows(torch.tensor(keys, dtype=torch.int64)).tolist(),
                             "successes": all_rewards.view(-1, self.group_size).sum(dim=1).tolist()})
        tallies = self._global_tallies(per_response, rewards, responses, len(scored.errors))
        self._log_samples(step, problems, prompt_ids, texts, scored.rewards)
        # Zero advantage everywhere: a zero gradient, unless an entropy bonus adds one.
        no_advantage = not bool(all_advantages.any())
        if no_advantage:
            self._warn_degenerate(step, tallies)
        skip = no_advantage and self.config.algorithm.entropy_coef == 0
        if skip:
            figures = {}
        else:
            figures = self._update(step, prompt_ids, responses, engine_logprobs, rewards.to(self.policy.device),
                                   all_advantages[own_rows].to(self.policy.device), group_figures, tallies)
        trained = time.perf_counter()

        if self.rollout.needs_weight_sync and not skip:
            self.rollout.sync_weights(self.policy.weights_for_rollout())
        synced = time.perf_counter()

        row = {"step": step + 1, "reward/mean": self.anchor.observation}
        for index, level in enumerate(self.levels):
            count = tallies["level_counts"][index]
            row[f"acc/{level}"] = tallies["level_sums"][index] / count if count else None
        anchor_figures = self.anchor.figures()
        row.update({
            "anchor/y": anchor_figures["anchor/y"],
            "anchor/belief": belief,
            "anchor/prior": anchor_figures["anchor/prior"],
            "anchor/posterior": anchor_figures["anchor/posterior"],
            "anchor/eta": anchor_figures["anchor/eta"],
            "anchor/sigma": anchor_figures["anchor/sigma"],
        })
        row.update(figures)
        row.update({
            "update/skipped": skip,
            "degenerate_group_frac": tallies["degenerate_groups"] / tallies["groups"],
            "response_length": tallies["tokens"] / (len(per_response) * self.world_size),
            "reward/errors": tallies["errors"],
            "tokens_per_s": tallies["tokens"] / (synced - started),
            "time/rollout": rolled_out - started,
            "time/reward": rewarded - rolled_out,
            "time/train": trained - rewarded,
            "time/sync": synced - trained,
            "time/step": synced - started,
        })
        return row

    def _global_tallies(self, problems, rewards, responses, errors) -> dict:
        """Per-level reward sums and counts, generated tokens, reward errors, and groups
        whose rewards are all equal (zero advantage), over all ranks."""
        levels = len(self.levels)
        values = torch.zeros(2 * levels + 4, dtype=torch.float64)
        for problem, reward in zip(problems, rewards.tolist()):
            index = self.levels.index(problem.level)
            values[index] += reward
            values[levels + index] += 1
        all_equal = all_equal_groups(rewards, self.group_size)
        values[-4] = sum(len(r) for r in responses)
        values[-3] = errors
        values[-2] = float(all_equal.sum())
        values[-1] = all_equal.numel()
        reduced: list[float] = all_reduce(values).tolist()
        return {"level_sums": reduced[:levels], "level_counts": reduced[levels:2 * levels],
                "tokens": reduced[-4], "errors": int(reduced[-3]), "degenerate_groups": int(reduced[-2]),
                "groups": int(reduced[-1])}

    def _log_samples(self, step: int, problems, prompt_ids, texts, rewards) -> None:
        """The first response to each of the first prompts, so a user can see what the
        model answers (and why the reward is what it is)."""
        group = self.group_size
        for index, problem in enumerate(problems[:self.config.run.log_samples]):
            self.samples.write({
                "step": step + 1,
                "level": problem.level,
                "prompt": self.tokenizer.decode(prompt_ids[index]),
                "answer": problem.answer,
                "response": texts[index * group],
                "reward": rewards[index * group],
                "group_rewards": rewards[index * group:(index + 1) * group],
            })

    def _warn_degenerate(self, step: int, tallies: dict) -> None:
        self.degenerate_steps += 1
        count = self.degenerate_steps
        if count <= DEGENERATE_WARNINGS_FIRST or count % DEGENERATE_WARNINGS_EVERY == 0:
            self.log.message(
                f"warning: step {step + 1}: all {tallies['groups']} groups got equal rewards (mean "
                f"{self.anchor.observation:.2f}), so no response has an advantage and there is nothing to "
                f"learn from ({count} such step(s) so far); samples.jsonl shows what the model answers"
            )

    def evaluate(self, step: int) -> dict:
        """Greedy accuracy per level on the held-out problems, over all ranks."""
        started = time.perf_counter()
        mine = self.held_out[self.rank::self.world_size]
        responses = self.rollout.greedy([self._encode(problem.prompt) for problem in mine],
                                        self.config.rollout.max_new_tokens)
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        scored = self.reward(texts, mine)
        levels = len(self.levels)
        values = torch.zeros(2 * levels, dtype=torch.float64)
        for problem, reward in zip(mine, scored.rewards):
            index = self.levels.index(problem.level)
            values[index] += reward
            values[levels + index] += 1
        reduced: list[float] = all_reduce(values).tolist()
        row: dict[str, float] = {"step": step}
        for index, level in enumerate(self.levels):
            row[f"eval/{level}"] = reduced[index] / reduced[levels + index]
        row["eval/mean"] = sum(reduced[:levels]) / sum(reduced[levels:])
        row["time/eval"] = time.perf_counter() - started
        self.evaluations.write(row)
        self.log.message(f"held-out greedy accuracy at step {step}: " + ", ".join(
            f"{level} {row[f'eval/{level}']:.2f}" for level in self.levels) + f" ({row['time/eval']:.0f} s)")
        return row

    def _micro_batches(self, rows: list[int], batch: RowTokens) -> list[list[int]]:
        """The micro-batches of ``rows`` of ``batch``: packed under the token budget, or by
        prompt count; as many on every rank (each forward is collective under ZeRO-3)."""
        train = self.config.train
        if not train.micro_batch_tokens:
            return by_prompt_count(rows, train.micro_batch_prompts * self.group_size)
        layout = self.policy.layout
        micro_batches, oversized = pack_by_tokens(rows, batch, train.micro_batch_tokens, layout=layout)
        if oversized and not self.warned_oversized:
            self.warned_oversized = True
            longest = max(batch.prompt_lengths[row] + batch.response_lengths[row] for row in oversized)
            self.log.message(
                f"note: a response of {longest} prompt+response tokens exceeds train.micro_batch_tokens="
                f"{train.micro_batch_tokens}; such responses get a micro-batch of their own (said once)"
            )
        count = int(all_reduce(torch.tensor([len(micro_batches)], dtype=torch.float64), dist.ReduceOp.MAX)[0])
        return split_to_count(micro_batches, count, batch, layout=layout)

    def _update(self, step, prompt_ids, responses, engine_logprobs, rewards, advantages, group_figures,
                tallies) -> dict:
        train, algo = self.config.train, self.config.algorithm
        group = self.group_size
        pad = self.tokenizer.pad_token_id
        mini_prompts = train.mini_batch_prompts // self.world_size
        mini_batches = self.prompts_per_rank // mini_prompts
        row_prompts = [prompt_ids[row // group] for row in range(len(responses))]
        rows_tokens = RowTokens(row_prompts, responses)

        def batch_of(rows):
            return self.policy.layout.build_rows(rows_tokens.subset(rows), pad_token_id=pad,
                                                 device=self.policy.device)

        # Behaviour log-probs: the policy before this batch's first update, kept per row.
        old_logprobs: dict[int, torch.Tensor] = {}
        gaps = []
        for rows in self._micro_batches(list(range(len(responses))), rows_tokens):
            batch = batch_of(rows)
            per_response = batch.per_response(self.policy.token_logprobs(batch))
            for row, logprobs in zip(rows, per_response):
                old_logprobs[row] = logprobs
            if engine_logprobs is not None and self.config.rollout.temperature == 1.0:
                gaps.append(_logprob_gap(per_response, [engine_logprobs[r] for r in rows]))

        # The engine's log-probs of each row, which the loss corrects against the behaviour
        # policy's (algorithm.rollout_correction; None: no correction).
        rollout_logprobs = None
        if self.policy.correction is not None:
            rollout_logprobs = [torch.tensor(engine_logprobs[row], dtype=torch.float32, device=self.policy.device)
                                for row in range(len(responses))]

        normalizer = loss_normalizer(LOSS_PRESETS[algo.loss_type].loss_agg_mode, batch_tokens=tallies["tokens"],
                                     mini_batches=mini_batches, responses_per_rank=mini_prompts * group,
                                     world_size=self.world_size)

        figures = UpdateFigures(LOSS_PRESETS[algo.loss_type].sequence_level)
        figures.add("phi_mean", group_figures["phi_mean"], len(responses))
        figures.add("zero_std_frac", group_figures["zero_std_frac"], len(responses) // group)
        calls = fed_tokens = 0
        grad_norms = []
        # Mini-batches are drawn as runs of prompts: single prompts under a token budget,
        # else runs of micro_batch_prompts, each then one micro-batch.
        run = 1 if train.micro_batch_tokens else train.micro_batch_prompts
        runs_per_mini_batch = mini_prompts // run
        for epoch in range(train.ppo_epochs):
            order = np.random.default_rng([train.seed, step, epoch, 7]).permutation(self.prompts_per_rank // run)
            for mini in range(mini_batches):
                runs = order[mini * runs_per_mini_batch:(mini + 1) * runs_per_mini_batch]
                rows = [(first * run + p) * group + g for first in runs for p in range(run) for g in range(group)]
                micro_batches = self._micro_batches(rows, rows_tokens)
                for index, micro_rows in enumerate(micro_batches):
                    batch = batch_of(micro_rows)
                    micro_figures = self.policy.accumulate(
                        batch, batch.from_responses([old_logprobs[row] for row in micro_rows]), advantages[micro_rows],
                        loss_normalizer=normalizer, last=index == len(micro_batches) - 1,
                        rollout_logprobs=None if rollout_logprobs is None
                        else batch.from_responses([rollout_logprobs[row] for row in micro_rows]),
                    )
                    figures.add_micro_batch(micro_figures, batch.response_lengths)
                    calls += 1
                    fed_tokens += batch.fed_tokens
                figures.end_mini_batch()
                norm = self.policy.grad_norm()
                if norm is not None:
                    grad_norms.append(norm)
        reduced = figures.result(self.world_size)
        averaged: dict[str, float | None] = {
            **reduced,
            "clip_frac": reduced["clip_frac_low"] + reduced["clip_frac_high"],
            "micro_batches": calls / (train.ppo_epochs * mini_batches),
            "fed_tokens": fed_tokens / (train.ppo_epochs * mini_batches),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else None,
            "lr": self.policy.learning_rate(),
            # Engine against trainer on the same weights: large means the weight sync broke.
            "rollout/logprob_gap": max(gaps) if gaps else None,
        }
        return averaged

    def _report_errors(self, step: int, errors: list[str]) -> None:
        if not errors:
            return
        with (self.run_dir / f"reward_errors-rank{self.rank}.log").open("a") as handle:
            handle.writelines(f"step {step + 1}: {error}\n" for error in errors)
        if self.error_messages < MAX_ERROR_MESSAGES:
            self.error_messages += 1
            self.log.message(f"step {step + 1}: {len(errors)} reward error(s), scored 0; first: {errors[0]}")

    # -- the run ---------------------------------------------------------------------

    def run(self) -> list[dict]:
        config = self.config
        every = config.eval.every
        try:
            if every and (self.start_step % every == 0 or self.start_step == config.train.steps):
                self.evaluate(self.start_step)
            for step in range(self.start_step, config.train.steps):
                row = self.train_step(step)
                self.log.write(row)
                done = step + 1
                if every and (done % every == 0 or done == config.train.steps):
                    self.evaluate(done)
                if done % config.run.checkpoint_every == 0 or done == config.train.steps:
                    save_checkpoint(self.run_dir / "checkpoints", done, self.policy.engine, self.anchor,
                                    config.run.keep_checkpoints, self.history)
            if config.run.export_hf:
                self.policy.export_hf(self.run_dir / "hf_model", self.tokenizer)
                self.log.message(f"trained model saved as a Hugging Face directory: {self.run_dir / 'hf_model'}")
        finally:
            self.log.close()
            self.samples.close()
            self.outcomes.close()
            self.evaluations.close()
            self.reward.close()
        rows = read_metrics(self.run_dir / "metrics.jsonl") if self.rank == 0 else []
        if self.rank == 0 and config.run.plot and rows:
            from .plotting import plot_run, run_title

            plot_run(rows, self.run_dir / "curves.png", run_title(config, self.engine_name))
        return rows

