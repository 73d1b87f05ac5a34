"""Rewards: the MATH verifier on hand-made answers, the guard around reward functions,
MATH-style data loading, and the synthetic task's difficulty for a random policy."""

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify", reason="the trainer extra is not installed (scripts/setup_venv.sh)")
pytest.importorskip("transformers", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import test_trainer_helpers as helpers
import torch

from trainer.config import load_config
from trainer.tasks.math_data import MathDataset, last_boxed, math_verify_reward
from trainer.tasks.problem import Problem
from trainer.tasks.rewards import InProcessReward, PooledReward
from trainer.tasks.synthetic_task import LEVELS, VOCABULARY, make_problem, sample_problems, score_synthetic

MATH_CASES = [
    # (response, gold answer, reward)
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("... which gives \\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{\\sqrt2}{2}", 1.0),
    ("First \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),  # the last box counts
    ("First \\boxed{4}, no wait: \\boxed{3}", "4", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("The answer is 4.", "4", 0.0),  # no boxed answer
    ("\\boxed{5}", "4", 0.0),
    ("\\boxed{", "4", 0.0),  # unclosed
]


@pytest.mark.parametrize("response, gold, expected", MATH_CASES)
def test_math_verify_reward_on_hand_made_answers(response, gold, expected):
    assert math_verify_reward(response, gold) == expected


def test_math_verifier_in_worker_pool_with_deadline():
    pooled = PooledReward(math_verify_reward, timeout_seconds=30.0, workers=1)
    try:
        responses = [response for response, _, _ in MATH_CASES]
        problems = [Problem("q", gold, "all") for _, gold, _ in MATH_CASES]
        batch = pooled(responses, problems)
        assert batch.rewards == [expected for _, _, expected in MATH_CASES]
        assert batch.errors == []
    finally:
        pooled.close()


def test_last_boxed_matches_braces():
    assert last_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{1} then \\boxed{2}") == "2"
    assert last_boxed("none") is None


def test_a_raising_reward_function_scores_zero_and_is_reported():
    problems = [Problem("q", "1", "all")] * 3
    batch = InProcessReward(helpers.raises)(["a", "b", "c"], problems)
    assert batch.rewards == [0.0, 0.0, 0.0]
    assert len(batch.errors) == 3 and "RuntimeError: this verifier is broken" in batch.errors[0]


@pytest.mark.slow
def test_a_hanging_reward_function_times_out_and_the_pool_recovers():
    pooled = PooledReward(helpers.hangs_on_seven, timeout_seconds=3.0, workers=1)
    try:
        started = time.perf_counter()
        batch = pooled(["1", "7"], [Problem("q", "1", "a"), Problem("q", "7", "a")])
        assert batch.rewards == [1.0, 0.0]
        assert batch.errors == ["timeout after 3.0s"]
        assert time.perf_counter() - started < 30
        # The stuck worker was killed: the next batch runs on a fresh pool.
        assert pooled(["2"], [Problem("q", "2", "a")]).rewards == [1.0]
    finally:
        pooled.close()


def test_math_data_from_json_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [
        {"question": f"What is {i}+{i}?", "sol": f"Twice: $\\boxed{{{2 * i}}}$.", "difficulty": f"Level {i % 3}"}
        for i in range(7)
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    (tmp_path / "b.json").write_text(json.dumps(records[3:5]))
    pq.write_table(pa.Table.from_pylist(records[5:]), tmp_path / "c.parquet")
    files = [str(tmp_path / name) for name in ("a.jsonl", "b.json", "c.parquet")]
    config = load_config(None, [
        "data.task=math", f"data.train_files=[{','.join(files)}]", "data.question_field=question",
        "data.answer_field=sol", "data.answer_from_solution=true", "data.level_field=difficulty",
    ])
    dataset = MathDataset(config.data, seed=0)
    assert len(dataset.items) == 7
    first = dataset.items[0]
    assert first.answer == "0" and first.level == "Level 0"
    assert first.prompt == (
        "What is 0+0? Let's think step by step and output the final answer within \\boxed{}."
    )
    # One epoch: every problem once; ranks get disjoint slices of the same order.
    seen = dataset.problems(0, 2, rank=0, world=2) + dataset.problems(0, 2, rank=1, world=2)
    seen += dataset.problems(1, 2, rank=0, world=2)
    assert len({p.prompt for p in seen}) == 6
    assert dataset.problems(3, 2, 1, 2) == dataset.problems(3, 2, 1, 2)  # a pure function of the step


def test_synthetic_answers_are_right():
    rng = np.random.default_rng(0)
    for level in LEVELS:
        for _ in range(20):
            problem = make_problem(level, rng)
            tokens = problem.prompt.split()
            if level == "copy":
                assert problem.answer == tokens[1]
            elif level == "next":
                assert int(problem.answer) == (int(tokens[1]) + 1) % 10
            elif level == "add":
                assert int(problem.answer) == (int(tokens[1]) + int(tokens[2])) % 10
            else:
                assert int(problem.answer) == tokens[1:-1].count("1")
    # A context before each prompt (data.context_tokens): the same problems, answers and
    # levels after it, its digits drawn after them.
    plain = sample_problems(list(LEVELS), 8, np.random.default_rng(3))
    with_context = sample_problems(list(LEVELS), 8, np.random.default_rng(3), context_tokens=5)
    for short, long in zip(plain, with_context):
        words = long.prompt.split()
        assert len(words) == 5 + len(short.prompt.split()) and all(word.isdigit() for word in words[:5])
        assert " ".join(words[5:]) == short.prompt and (long.answer, long.level) == (short.answer, short.level)
    assert score_synthetic(" 7 3", "7") == 1.0
    assert score_synthetic("copy 7", "7") == 1.0  # the first number, wherever it is
    assert score_synthetic(" 3 7", "7") == 0.0
    assert score_synthetic("? ?", "7") == 0.0


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_random_policy_scores_between_5_and_40_percent(architecture):
    """Groups are then neither hopeless nor solved: GRPO has signal from the start."""
    from trainer.engine.rollout import HFRollout
    from trainer.models.tiny_model import build_tiny_model, build_tokenizer

    config = load_config(None, [f"model.architecture={architecture}"])
    tokenizer = build_tokenizer(VOCABULARY)
    model = build_tiny_model(config.model, tokenizer, seed=1)
    engine = HFRollout(model, config.rollout, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, synced_gpus=False)
    problems = sample_problems(list(LEVELS), 64, np.random.default_rng(0))
    prompts = [tokenizer(p.prompt).input_ids for p in problems]
    assert all(ids[0] == tokenizer.bos_token_id for ids in prompts)
    responses, _ = engine.generate(prompts, seeds=[0])
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    per_response = [p for p in problems for _ in range(config.rollout.group_size)]
    rewards = torch.tensor([score_synthetic(t, p.answer) for t, p in zip(texts, per_response)])
    assert 0.05 <= rewards.mean().item() <= 0.40, rewards.mean().item()
    groups = rewards.view(-1, config.rollout.group_size)
    mixed = (groups.amax(1) != groups.amin(1)).float().mean().item()
    assert mixed >= 0.3, f"only {mixed:.0%} of the groups have both right and wrong answers"


@pytest.mark.slow
def test_one_hanging_response_costs_one_timeout_not_the_batch():
    """With one worker, every response after a stuck one used to time
    out as well (N x timeout a step); the stuck worker is now replaced."""
    pooled = PooledReward(helpers.hangs_on_seven, timeout_seconds=2.0, workers=1)
    try:
        answers = ["7", "1", "2", "3", "7", "4"]
        started = time.perf_counter()
        batch = pooled(answers, [Problem("q", answer, "a") for answer in answers])
        elapsed = time.perf_counter() - started
        assert batch.rewards == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
        assert batch.errors == ["timeout after 2.0s"] * 2
        # Two deadlines and two replacement workers' start-up, nothing more.
        assert elapsed < 2 * 2.0 + 20, elapsed
    finally:
        pooled.close()
