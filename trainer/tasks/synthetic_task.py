"""A verifiable task a tiny random model can learn on a CPU in minutes.

Every prompt asks for one digit; the levels differ in how much the model must learn to
find it:

    copy  "copy 7 ?"           -> 7        read one token at a fixed position
    next  "next 7 ?"           -> 8        a 10-entry successor table (mod 10)
    add   "add 3 5 ?"          -> 8        a 100-entry sum table (mod 10)
    count "count 1 0 1 1 0 ?"  -> 3        aggregate over five positions

A response is right when its first number is the answer. A random policy over the small
vocabulary is right seldom but not never, so groups of 8 are neither all wrong nor all
right often enough to learn from (its score: docs/trainer.md, "The synthetic task";
tests/test_trainer_rewards.py holds it to a range).

``data.context_tokens`` puts that many random digits before each prompt, which the answer
ignores: a long-prompt workload (shared-prompt packing, docs/trainer.md) on the same task.
``data.exemplars`` puts that many solved problems before each prompt, the same for every
prompt of a run: few-shot exemplars, a prefix every prompt shares (the prefix-tree
layout, docs/layouts.md).
``data.prompt_pool`` draws each step's prompts from a fixed pool of that many distinct
prompts instead, as a large dataset is seen: the levels hold 152 distinct problems, which
at 64 prompts a step recur every 2-3 steps, so each pool prompt carries an identifier of
its own before the problem (digits the answer ignores). A prompt of a pool of N then
recurs about steps x prompts / N times in a run (docs/estimators.md, where the prompt
history falls to its prior).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from pydantic import Field

from ..section import section
from .problem import Problem

if TYPE_CHECKING:
    import numpy as np

DIGITS = [str(d) for d in range(10)]
LEVELS = {"copy": 1, "next": 2, "add": 3, "count": 4}  # name -> difficulty rank
COUNT_LENGTH = 5
# The longest prompt in tokens, [BOS] and "?" included: a count problem.
MAX_SYNTHETIC_PROMPT_TOKENS = COUNT_LENGTH + 3
SPECIAL_TOKENS = ["[PAD]", "[BOS]", "[EOS]"]
VOCABULARY = SPECIAL_TOKENS + DIGITS + list(LEVELS) + ["?"]

_FIRST_NUMBER = re.compile(r"\d+")
EXEMPLAR_SEED = 20261202
# The pool's own seed: one pool for every run and seed, as a dataset is one file.
POOL_SEED = 20261205


@section
class SyntheticData:
    """The data section's keys this task alone reads (its row's ``data_fields``)."""

    # random digits before each prompt, which the answer ignores (a long-prompt workload); 0: none
    context_tokens: int = Field(default=0, ge=0)
    # this many solved problems (the same for every prompt of the run) before each prompt,
    # few-shot exemplars every prompt shares (the prefix tree lays them out once a
    # micro-batch); 0: none
    exemplars: int = Field(default=0, ge=0)
    # draw each step's prompts (uniformly, with replacement) from a fixed pool of this many
    # distinct prompts, each an identifier then a problem (:func:`prompt_pool`), so that a
    # prompt recurs about steps x prompts_per_step / prompt_pool times in a run, as the
    # prompts of a large dataset do; 0: every problem drawn afresh from the levels (152
    # distinct prompts in all)
    prompt_pool: int = Field(default=0, ge=0)


def check_synthetic_data(data, model_path: str) -> None:
    """The synthetic task's check across its keys (each key's bound is its field's)."""
    if data.prompt_pool and data.context_tokens:
        raise ValueError("data.prompt_pool draws prompts that recur, which data.context_tokens's fresh random digits "
                         "would make new every time: set one of them")


def make_problem(level: str, rng: np.random.Generator) -> Problem:
    if level == "copy":
        a = int(rng.integers(10))
        return Problem(f"copy {a} ?", str(a), level)
    if level == "next":
        a = int(rng.integers(10))
        return Problem(f"next {a} ?", str((a + 1) % 10), level)
    if level == "add":
        a, b = (int(x) for x in rng.integers(10, size=2))
        return Problem(f"add {a} {b} ?", str((a + b) % 10), level)
    if level == "count":
        bits = rng.integers(2, size=COUNT_LENGTH)
        return Problem("count " + " ".join(map(str, bits)) + " ?", str(int(bits.sum())), level)
    raise ValueError(f"unknown synthetic level {level!r}; expected one of {list(LEVELS)}")


def exemplar_text(levels: list[str], count: int) -> str:
    """``count`` solved problems of ``levels``, each its prompt then its answer: the same
    text for every call with these arguments (its own seed, not the run's draws)."""
    import numpy as np

    rng = np.random.default_rng(EXEMPLAR_SEED)
    problems = [make_problem(levels[int(i)], rng) for i in rng.integers(len(levels), size=count)]
    return " ".join(f"{problem.prompt} {problem.answer}" for problem in problems)


def pool_id_tokens(size: int) -> int:
    """The tokens of a pool prompt's identifier (its digits): 0 without a pool."""
    return len(str(size - 1)) if size else 0


@functools.lru_cache(maxsize=4)
def prompt_pool(levels: tuple[str, ...], size: int) -> tuple[Problem, ...]:
    """``size`` distinct problems, the same for every run and seed: each of a level drawn
    uniformly from ``levels``, its prompt led by an identifier of its own (a number below
    ``size`` in :func:`pool_id_tokens` digits, the numbers shuffled), which the answer
    ignores and which makes every prompt of the pool distinct however few problems the
    levels hold."""
    import numpy as np

    rng = np.random.default_rng(POOL_SEED)
    width = pool_id_tokens(size)
    identifiers = rng.permutation(size)
    problems = [make_problem(levels[int(i)], rng) for i in rng.integers(len(levels), size=size)]
    return tuple(Problem(" ".join(f"{int(identifier):0{width}d}") + " " + problem.prompt, problem.answer,
                         problem.level) for identifier, problem in zip(identifiers, problems))


def sample_problems(levels: list[str], count: int, rng: np.random.Generator,
                    context_tokens: int = 0, exemplars: int = 0, pool: int = 0) -> list[Problem]:
    """``count`` problems, each of a level drawn uniformly from ``levels`` (or, with
    ``pool``, each drawn uniformly from :func:`prompt_pool`), each prompt after
    ``exemplars`` solved problems common to every prompt (:func:`exemplar_text`) and
    ``context_tokens`` random digits the answer does not depend on."""
    if pool:
        drawn = prompt_pool(tuple(levels), pool)
        problems = [drawn[int(i)] for i in rng.integers(pool, size=count)]
    else:
        chosen = rng.integers(len(levels), size=count)
        problems = [make_problem(levels[i], rng) for i in chosen]
    if context_tokens:
        problems = [Problem(" ".join(map(str, rng.integers(10, size=context_tokens))) + " " + problem.prompt,
                            problem.answer, problem.level) for problem in problems]
    if exemplars:
        preamble = exemplar_text(levels, exemplars)
        problems = [Problem(f"{preamble} {problem.prompt}", problem.answer, problem.level) for problem in problems]
    return problems


def score_synthetic(response: str, answer: str) -> float:
    """1.0 when the first number in the response equals the answer, else 0.0."""
    match = _FIRST_NUMBER.search(response)
    return float(match is not None and match.group() == answer)
