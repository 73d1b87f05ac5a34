"""Arithmetic word problems in graded levels, for a small pretrained model on a CPU.

Each problem is drawn from a seed (names, objects and sentence forms vary) and its
answer is a whole number. The levels differ in the arithmetic and the story around it:

    plus          "What is 3 plus 4?"                                        a + b, no story, sum < 10
    single-digit  "Tom has 3 apples. He gets 4 more apples. How many ..."    a + b or a - b, one digit
    two-digit     "Lily has 24 books. She gets 38 more books. How many ..."  a + b or a - b, two digits
    multi-step    "Ben has 6 pencils. He gets 5 more, then gives 3 away..."  a + b - c

Calibrated on SmolLM2-135M-Instruct (``trainer/tools/calibrate.py``; its figures in
docs/trainer.md, "A real model on the CPU"): sampled at step 0 its accuracy runs from high
on ``plus`` to low on ``two-digit`` and ``multi-step``, the spread of easy and hard prompts
the paper's HA-DW is about. (A story around even "one more" made the easiest level hard.)

A response is scored by math-verify on the whole text: it takes the answer after "final
answer is", else the last ``\\boxed{}``, else the last number, and compares it with the
gold number (reward 1 or 0). The held-out set is drawn from a fixed seed, so every run
evaluates the same problems, and those stories are never drawn for training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .problem import Problem, seeded_rng

if TYPE_CHECKING:
    import numpy as np

NAMES = [("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Lily", "she"), ("Ben", "he"), ("Mia", "she"),
         ("Leo", "he"), ("Emma", "she")]
OBJECTS = ["apples", "books", "pencils", "coins", "stickers", "marbles", "cookies", "cards"]
HELD_OUT_SEED = 20261122  # fixed: every run is evaluated on the same problems
MAX_DRAWS = 1000  # per problem, before a level is declared exhausted


def _plus(rng: np.random.Generator, name: str, pronoun: str, thing: str) -> tuple[str, int]:
    a, b = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    forms = [f"What is {a} plus {b}?", f"How much is {a} plus {b}?", f"What do you get if you add {a} and {b}?",
             f"What is the sum of {a} and {b}?"]
    return forms[int(rng.integers(len(forms)))], a + b


def _add_or_take(rng: np.random.Generator, name: str, pronoun: str, thing: str, low: int, high: int) -> tuple[str, int]:
    a, b = (int(v) for v in rng.integers(low, high + 1, size=2))
    if rng.random() < 0.5:
        forms = [
            f"{name} has {a} {thing}. {pronoun.capitalize()} gets {b} more {thing}. How many {thing} does {name} have now?",
            f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have in total?",
        ]
        return forms[int(rng.integers(len(forms)))], a + b
    a, b = max(a, b), min(a, b)
    forms = [
        f"{name} has {a} {thing} and gives {b} of them away. How many {thing} does {name} have left?",
        f"There are {a} {thing} in a box. {name} takes {b} out. How many {thing} are still in the box?",
    ]
    return forms[int(rng.integers(len(forms)))], a - b


def _multi_step(rng: np.random.Generator, name: str, pronoun: str, thing: str) -> tuple[str, int]:
    a, b = (int(v) for v in rng.integers(2, 10, size=2))
    c = int(rng.integers(1, min(a + b, 10)))
    forms = [
        f"{name} has {a} {thing}. {pronoun.capitalize()} gets {b} more, then gives {c} away. How many {thing} does {name} have now?",
        f"There are {a} {thing} in a bag. {name} adds {b} more and then takes out {c}. How many {thing} are in the bag?",
    ]
    return forms[int(rng.integers(len(forms)))], a + b - c


# A level draws (question, answer) from (rng, name, pronoun, thing).
LEVELS: dict[str, Callable[[np.random.Generator, str, str, str], tuple[str, int]]] = {
    "plus": _plus,
    "single-digit": lambda rng, name, pronoun, thing: _add_or_take(rng, name, pronoun, thing, 1, 9),
    "two-digit": lambda rng, name, pronoun, thing: _add_or_take(rng, name, pronoun, thing, 10, 99),
    "multi-step": _multi_step,
}


def make_problem(level: str, rng: np.random.Generator, template: str) -> Problem:
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; expected one of {list(LEVELS)}")
    name, pronoun = NAMES[int(rng.integers(len(NAMES)))]
    thing = OBJECTS[int(rng.integers(len(OBJECTS)))]
    question, answer = LEVELS[level](rng, name, pronoun, thing)
    return Problem(template.replace("{question}", question), str(answer), level)


def held_out_problems(levels: list[str], per_level: int, template: str) -> list[Problem]:
    """``per_level`` distinct problems of each level, the same for every run."""
    rng = seeded_rng(HELD_OUT_SEED)
    problems: list[Problem] = []
    for level in levels:
        chosen: dict[str, Problem] = {}
        for _ in range(MAX_DRAWS * per_level):
            if len(chosen) == per_level:
                break
            problem = make_problem(level, rng, template)
            chosen.setdefault(problem.prompt, problem)
        if len(chosen) < per_level:
            raise ValueError(f"level {level!r} has fewer than {per_level} distinct problems")
        problems.extend(chosen.values())
    return problems


def sample_problems(levels: list[str], count: int, rng: np.random.Generator, template: str,
                    held_out: frozenset[str] = frozenset()) -> list[Problem]:
    """``count`` problems, each of a level drawn uniformly from ``levels``, none of them
    a held-out prompt."""
    chosen = rng.integers(len(levels), size=count)
    problems = []
    for index in chosen:
        for _ in range(MAX_DRAWS):
            problem = make_problem(levels[index], rng, template)
            if problem.prompt not in held_out:
                problems.append(problem)
                break
        else:
            raise ValueError(f"level {levels[index]!r} has almost no problems outside the held-out set: "
                             f"lower eval.problems_per_level")
    return problems


def score_arithmetic(response: str, answer: str) -> float:
    """1.0 when math-verify finds the gold number as the response's final answer."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    predicted = parse(response, parsing_timeout=None)
    return float(verify(gold, predicted, timeout_seconds=None))
