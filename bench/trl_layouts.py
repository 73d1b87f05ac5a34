"""Stock TRL's GRPOTrainer against the drop-in (hadw_kernels.integrations.trl) in each layout:
train step time and peak memory (docs/benchmarks.md, "The TRL drop-in's layouts").

Each run trains a Llama built from a config (fp32, one thread) for a few optimizer steps on
fixed rollouts: the completions are drawn from a seeded generator with the case's length
distribution instead of sampled from the model, so every trainer gets the same tokens and
the step time is the model's forwards and backward (and TRL's bookkeeping), not
generation. Each run is a fresh process (its peak RSS is its own); the driver runs every
trainer of every case in turn, ``--repeats`` times.

    .venv/bin/python bench/trl_layouts.py                      # every case, twice
    .venv/bin/python bench/trl_layouts.py --cases long-prompt-8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from fresh_process import worker_env

# Each trainer: stock TRL (None), or the drop-in's (hadw_layout, hadw_shuffle). The
# shared-prompt layout runs with both shuffles: "auto" shuffles whole groups here (one
# optimizer step takes the generation batch), "rows" keeps TRL's row shuffle.
DROP_INS = {"stock": None, "padded": ("padded", "auto"), "packed": ("packed", "auto"),
            "shared_prompt": ("shared_prompt", "auto"), "shared_prompt_rows": ("shared_prompt", "rows"),
            "prefix_tree": ("prefix_tree", "auto")}
TRAINERS = tuple(DROP_INS)


@dataclass(frozen=True)
class Case:
    """``prompts`` prompts of ``prompt_tokens`` a generation batch (after a system prompt
    of ``system_tokens`` common to every prompt), ``group`` completions each, whose lengths
    are drawn log-normally around ``completion_median`` (sigma ``completion_sigma``, cut to
    [1, ``completion_max``]); one optimizer step per generation batch, in micro-batches of
    ``groups_per_micro_batch`` groups' rows. With ``first_turns``, a two-turn rollout: each
    completion begins with one of its group's ``first_turns`` first turns of
    ``first_turn_tokens`` (what a tree-shaped rollout shares), then its own turn."""

    prompts: int
    prompt_tokens: int
    group: int
    completion_median: int
    completion_sigma: float
    completion_max: int
    hidden: int = 256
    layers: int = 4
    vocab: int = 1024
    system_tokens: int = 0
    groups_per_micro_batch: int = 1
    first_turns: int = 0
    first_turn_tokens: int = 0


CASES = {
    # (a) short prompts, long-tailed completions: padding to the longest completion dominates.
    "long-tail": Case(prompts=4, prompt_tokens=32, group=8, completion_median=32, completion_sigma=1.0,
                      completion_max=384),
    # (b) long prompts: each prompt forwarded G times.
    "long-prompt-8": Case(prompts=2, prompt_tokens=512, group=8, completion_median=64, completion_sigma=0.4,
                          completion_max=128),
    "long-prompt-16": Case(prompts=2, prompt_tokens=512, group=16, completion_median=64, completion_sigma=0.4,
                           completion_max=128),
    # (c) a 1,000-token system prompt common to every prompt, 64-token questions, G = 8,
    # 64-token completions, four groups a micro-batch: the prefix tree lays the system
    # prompt out once a micro-batch, the shared-prompt layout once a group.
    "system-prompt": Case(prompts=4, prompt_tokens=64, group=8, completion_median=64, completion_sigma=0.0,
                          completion_max=64, system_tokens=1000, groups_per_micro_batch=4),
    # (d) two-turn rollouts forking at several depths: a 256-token system prompt, 64-token
    # questions, each group's completions after one of two 64-token first turns, then their
    # own second turn (64 tokens), four groups a micro-batch.
    "two-turn": Case(prompts=4, prompt_tokens=64, group=8, completion_median=64, completion_sigma=0.0,
                     completion_max=64, system_tokens=256, groups_per_micro_batch=4, first_turns=2,
                     first_turn_tokens=64),
    # What the quick check (bench/test_trl_layouts.py) runs.
    "tiny": Case(prompts=2, prompt_tokens=16, group=4, completion_median=8, completion_sigma=0.5,
                 completion_max=16, hidden=32, layers=1, vocab=64),
}


def run_one(case: Case, trainer_name: str, steps: int) -> dict:
    """Trains ``steps`` optimizer steps in this process; the step times and memory."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from hadw_kernels.integrations.trl import HADWGRPOConfig, HADWGRPOTrainer

    torch.set_num_threads(1)
    words = ["[PAD]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(case.vocab - 3)]
    raw = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", bos_token="[BOS]",
                                        eos_token="[EOS]", padding_side="left")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=case.vocab, hidden_size=case.hidden, intermediate_size=int(2.75 * case.hidden),
        num_hidden_layers=case.layers, num_attention_heads=max(case.hidden // 64, 1),
        num_key_value_heads=max(case.hidden // 64, 1),
        max_position_embeddings=case.system_tokens + case.prompt_tokens + case.first_turn_tokens + case.completion_max + 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    ))
    draw = torch.Generator().manual_seed(1)

    def words(count):
        return " ".join(f"w{int(token)}" for token in torch.randint(0, case.vocab - 3, (count,), generator=draw))

    system = words(case.system_tokens) + " " if case.system_tokens else ""
    prompts = [system + words(case.prompt_tokens) for _ in range(case.prompts * (steps + 1))]
    rollouts = torch.Generator().manual_seed(2)

    class FixedRollouts:
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            lengths = torch.distributions.LogNormal(0.0, case.completion_sigma).sample((len(prompt_ids),))
            first_turns: dict[tuple, list] = {}
            completions = []
            for row, scale in enumerate(lengths.tolist()):
                length = int(min(max(round(case.completion_median * scale), 1), case.completion_max))
                completion = torch.randint(3, case.vocab, (length,), generator=rollouts).tolist()
                if case.first_turns:
                    turns = first_turns.setdefault(tuple(prompt_ids[row]), [
                        torch.randint(3, case.vocab, (case.first_turn_tokens,), generator=rollouts).tolist()
                        for _ in range(case.first_turns)])
                    completion = turns[row % case.group * case.first_turns // case.group] + completion
                completions.append(completion)
            return completions, None

    micro_batches = case.prompts // case.groups_per_micro_batch
    options = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=case.group * case.groups_per_micro_batch,
        num_generations=case.group, steps_per_generation=micro_batches, gradient_accumulation_steps=micro_batches,
        max_completion_length=case.first_turn_tokens + case.completion_max, max_steps=steps, learning_rate=1e-5,
        logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, loss_type="grpo",
    )
    if trainer_name == "stock":
        trainer_class, args = GRPOTrainer, GRPOConfig(**options)
    else:
        trainer_class = HADWGRPOTrainer
        layout, shuffle = DROP_INS[trainer_name]
        args = HADWGRPOConfig(**options, use_hadw=False, hadw_layout=layout, hadw_shuffle=shuffle)
    trainer_type = type("Timed", (FixedRollouts, trainer_class), {})
    trainer = trainer_type(model=model, reward_funcs=lambda completions, **_: [0.5] * len(completions),
                           args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fed = []

    def count_fed_tokens(module, args):
        # Every forward's input ids, whichever trainer made them: padded rows count their
        # padding, a packed row its prompts as often as they are laid out.
        fed.append(args[0].numel())

    model.get_input_embeddings().register_forward_pre_hook(count_fed_tokens)
    trainer.train()
    step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    return {
        "step_times": step_times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_train_mb": before / 1024,
        "fed_tokens_per_step": sum(fed) / steps,
    }


def run_in_fresh_process(case_name: str, trainer_name: str, steps: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--one", case_name, trainer_name, "--steps", str(steps)],
                          env=worker_env(threads=1), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{case_name} / {trainer_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="long-tail,long-prompt-8,long-prompt-16",
                        help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, of {TRAINERS}")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps a run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each trainer of each case")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "TRAINER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(CASES[args.one[0]], args.one[1], args.steps)))
        return
    cases = args.cases.split(",")
    trainers = args.trainers.split(",")
    for name in cases + trainers:
        if name not in CASES and name not in TRAINERS:
            parser.error(f"unknown case or trainer {name!r}")
    runs = []
    for repeat in range(args.repeats):
        for case_name in cases:
            for trainer_name in trainers:
                print(f"[{repeat + 1}/{args.repeats}] {case_name} {trainer_name} ...", file=sys.stderr, flush=True)
                result = run_in_fresh_process(case_name, trainer_name, args.steps)
                runs.append(dict(case=case_name, trainer=trainer_name, repeat=repeat, **result))
    if args.json:
        args.json.write_text(json.dumps({"cases": {name: asdict(CASES[name]) for name in cases}, "runs": runs},
                                        indent=1))
    print("| case | trainer | step time (s), median of steps 2+ per run | x stock | peak RSS MB | fed tokens/step |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for case_name in cases:
        medians = {trainer: [statistics.median(run["step_times"][1:] or run["step_times"])
                             for run in runs if run["case"] == case_name and run["trainer"] == trainer]
                   for trainer in trainers}
        stock = statistics.mean(medians["stock"]) if "stock" in medians else None
        for trainer_name in trainers:
            mine = [run for run in runs if run["case"] == case_name and run["trainer"] == trainer_name]
            times = medians[trainer_name]
            ratio = f"{statistics.mean(times) / stock:.2f}" if stock else ""
            fed = mine[0]["fed_tokens_per_step"]
            step_times = ", ".join(f"{t:.2f}" for t in times)
            peaks = ", ".join(f"{run['peak_rss_mb']:.0f}" for run in mine)
            print(f"| {case_name} | {trainer_name} | {step_times} | {ratio} | {peaks} | "
                  f"{round(fed)} |")


if __name__ == "__main__":
    main()
