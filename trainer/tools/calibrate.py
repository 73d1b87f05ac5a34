"""Step-0 accuracy per level of a config's model on its task, before any training:
``python trainer/tools/calibrate.py --config trainer/configs/smollm2_arithmetic.yaml``.

For each level it samples ``--prompts`` problems with G responses each at the
configured temperature (as a training step would) and one greedy response each (as the
held-out evaluation does), and prints the sampled and greedy accuracy and the share of
groups with both right and wrong responses (the groups GRPO learns from). HA-DW is about
a spread of difficulty: hard levels and easy ones (docs/trainer.md has the calibration).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as a file, Python puts this file's folder on the path, not the checkout that holds
# the package: the wheel installs the library only, the trainer runs from its checkout
# (docs/trainer.md).
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.config import ConfigError, load_config, validate
from trainer.engine.environment import prepare_environment
from trainer.tasks.registry import TASKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])  # argparse rewraps it
    parser.add_argument("--config", help="a YAML config (its model, task, rollout and reward sections are used)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--prompts", type=int, default=32, help="problems per level (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the problems and the sampling (default 0)")
    args = parser.parse_args(argv)
    # Checked here, not by hadw_kernels.tools.cli's types: importing the library would load torch
    # before prepare_environment sets its thread count.
    for flag, value, minimum in (("--prompts", args.prompts, 1), ("--seed", args.seed, 0)):
        if value < minimum:
            parser.error(f"argument {flag}: must be at least {minimum}, got {value}")
    try:
        config = load_config(args.config, args.overrides)
        prepare_environment(config)
        validate(config)
        task = TASKS[config.data.task]
        if task.draw is None or not config.model.path:
            drawn = ", ".join(name for name, row in TASKS.items() if row.draw is not None)
            raise ConfigError(f"calibrate.py needs a task that draws its problems by level (data.task: {drawn}) "
                              f"and a model.path model")
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2

    import numpy as np
    from transformers import AutoTokenizer

    from trainer.engine.settings import resolve_engine
    from trainer.models.pretrained import ensure_converted, resolve_model_source
    from trainer.tasks.problem import encode_prompt
    from trainer.tasks.rewards import build_reward

    model_dir = ensure_converted(resolve_model_source(config.model.path), config.model.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = rollout_engine(config, model_dir, tokenizer, resolve_engine(config.rollout.engine))
    reward = build_reward(config.data, config.reward)
    group = config.rollout.group_size

    def encode(prompt: str) -> list[int]:
        return encode_prompt(tokenizer, prompt, apply_chat_template=config.data.apply_chat_template,
                             max_prompt_tokens=config.data.max_prompt_tokens)

    print(f"{config.model.path}, temperature {config.rollout.temperature}, G={group}, {args.prompts} prompts a level")
    print("| level | sampled | greedy | mixed groups | time |")
    print("| --- | --- | --- | --- | --- |")
    try:
        for level in list(config.data.levels) or list(task.levels):
            started = time.perf_counter()
            rng = np.random.default_rng([args.seed, len(level)])
            problems = task.draw([level], args.prompts, rng, config.data, frozenset())
            ids = [encode(problem.prompt) for problem in problems]
            sampled, _ = engine.generate(ids, list(range(len(ids))))
            greedy = engine.greedy(ids, config.rollout.max_new_tokens)
            per_response = [problem for problem in problems for _ in range(group)]
            rewards = np.array(reward(tokenizer.batch_decode(sampled, skip_special_tokens=True), per_response).rewards)
            greedy_rewards = reward(tokenizer.batch_decode(greedy, skip_special_tokens=True), problems).rewards
            groups = rewards.reshape(-1, group)
            mixed = float(np.mean(groups.max(axis=1) != groups.min(axis=1)))
            print(f"| {level} | {rewards.mean():.2f} | {np.mean(greedy_rewards):.2f} | {mixed:.2f} | "
                  f"{time.perf_counter() - started:.0f} s |", flush=True)
    finally:
        reward.close()
    return 0


def rollout_engine(config, model_dir: Path, tokenizer, engine_name: str):
    """The run's rollout engine (``hf`` or ``vllm``) on the model in ``model_dir``, sampling
    as ``config.rollout`` says (G = ``rollout.group_size`` responses a prompt)."""
    from transformers import AutoConfig

    from trainer.engine.rollout import HFRollout, VLLMRollout

    if engine_name == "hf":
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, config.model.dtype))
        return HFRollout(model, config.rollout, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, synced_gpus=False)
    positions = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    return VLLMRollout(model_dir, config.rollout, dtype=config.model.dtype,
                       max_model_len=min(positions, config.data.max_prompt_tokens + config.rollout.max_new_tokens),
                       eos_token_id=tokenizer.eos_token_id, world_size=1, seed=config.train.seed,
                       verbose=config.run.verbose)


if __name__ == "__main__":
    sys.exit(main())
