"""The graded arithmetic word problems: right answers, a fixed held-out set
that training never draws, and the math-verify scorer on the answers a model writes."""

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("math_verify", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

REPO = Path(__file__).resolve().parents[1]

from trainer.tasks.arithmetic_task import LEVELS, held_out_problems, make_problem, sample_problems, score_arithmetic

TEMPLATE = "{question} Give the final answer as a number."


def _solve(question: str) -> int:
    """The answer, read back from the story's wording."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if len(numbers) == 3:
        return numbers[0] + numbers[1] - numbers[2]
    if "plus" in question or "add" in question or "sum" in question:
        return numbers[0] + numbers[1]
    taken = any(word in question for word in ("away", "takes", "left"))
    return numbers[0] - numbers[1] if taken else numbers[0] + numbers[1]


@pytest.mark.parametrize("level", list(LEVELS))
def test_answers_are_right_and_prompts_use_the_template(level):
    rng = np.random.default_rng(0)
    digits = {"single-digit": 1, "two-digit": 2}.get(level)
    for _ in range(200):
        problem = make_problem(level, rng, TEMPLATE)
        question = problem.prompt.removesuffix(" Give the final answer as a number.")
        assert problem.prompt.endswith("? Give the final answer as a number.")
        assert int(problem.answer) == _solve(question) >= 0
        assert problem.level == level
        if digits:
            assert all(len(n) == digits for n in re.findall(r"\d+", question))


def test_held_out_set_is_fixed_distinct_and_never_trained_on():
    levels = list(LEVELS)
    held_out = held_out_problems(levels, 16, TEMPLATE)
    assert held_out == held_out_problems(levels, 16, TEMPLATE)
    assert len({p.prompt for p in held_out}) == 64
    assert [p.level for p in held_out] == [level for level in levels for _ in range(16)]
    prompts = frozenset(p.prompt for p in held_out)
    drawn = sample_problems(["plus"], 2000, np.random.default_rng(1), TEMPLATE, prompts)
    assert not prompts & {p.prompt for p in drawn}
    with pytest.raises(ValueError, match="lower eval.problems_per_level"):
        everything = frozenset(p.prompt for p in held_out_problems(["plus"], 80, TEMPLATE))  # all 80 of them
        sample_problems(["plus"], 1, np.random.default_rng(1), TEMPLATE, everything)


@pytest.mark.parametrize("response, answer, reward", [
    ("Tom has 3 + 4 = 7 apples.\nThe final answer is 7.", "7", 1.0),
    ("Mia has 5 stickers and gets one more, so she has 5 + 1 = 6 stickers now.", "6", 1.0),  # last number
    ("So 9 - 5 = 4. The final answer is 4. Ben had 9 books.", "4", 1.0),  # "final answer is" first
    ("The answer is \\boxed{12}.", "12", 1.0),
    ("Anna has 24 - 12 = 12 marbles. The answer is 12.", "36", 0.0),
    ("I do not know.", "3", 0.0),
])
def test_score_reads_the_final_answer(response, answer, reward):
    assert score_arithmetic(response, answer) == reward
