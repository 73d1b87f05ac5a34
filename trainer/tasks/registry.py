"""The tasks a run trains on (``data.task``), one row each: its difficulty levels, how
its problems are drawn or loaded, its verifier, its fixed held-out set, the data keys it
owns and its own checks of the data section; and the config's data and eval sections.

The config's validation (:func:`check_data_section`), the reward (``rewards.py``), the
loop's prompts and its evaluation, and ``tools/calibrate.py`` read a task's row and never
compare its name: a new task is a module of its own and a row of :data:`TASKS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import Field

from ..section import section
from . import arithmetic_task, math_data, synthetic_task
from .problem import Problem, RewardFunction, seeded_rng

if TYPE_CHECKING:
    import numpy as np


class PromptSource(Protocol):
    """A run's problems, built once from its task's row (:meth:`Task.prompt_source`)."""

    levels: list[str]  # the levels its problems carry, in the order the per-level curves list them
    held_out: list[Problem]  # the fixed held-out set the evaluation scores (empty: none)

    def problems(self, step: int, count: int, rank: int, world: int) -> list[Problem]:
        """The ``count`` problems of ``rank`` (of ``world``) at rollout batch ``step``; the
        same however often it is asked (a resumed run sees an uninterrupted one's)."""


# (levels, count, rng, data section, held-out prompts not to draw) -> problems
Draw = Callable[[list[str], int, "np.random.Generator", Any, frozenset[str]], list[Problem]]


def _no_further_checks(data, model_path: str) -> None:
    pass


@dataclass(frozen=True)
class Task:
    name: str
    # The reward when reward.function is empty: (response, answer) -> float.
    verifier: RewardFunction
    # The verifier can hang (math-verify, whose own timeout is off: rewards.py), so it runs
    # in the reward pool under reward.timeout_seconds, which must then be positive.
    verifier_needs_deadline: bool
    # The levels data.levels picks from, easy to hard (empty: the task's data brings its own).
    levels: tuple[str, ...] = ()
    # Problems drawn afresh each step from the levels (seeded by the run's seed, the step
    # and the rank) ...
    draw: Draw | None = None
    # ... or loaded: (data section, seed) -> the run's prompt source.
    load: Callable[[Any, int], PromptSource] | None = None
    # (levels, problems per level, data section) -> the fixed held-out set eval.every
    # scores; None: the task has none.
    held_out: Callable[[list[str], int, Any], list[Problem]] | None = None
    # (data section, model.path) -> None: the task's own checks of the data section,
    # raising ValueError naming the key.
    check: Callable[[Any, str], None] = _no_further_checks
    # A dataclass of the data section's keys this task alone reads, with their defaults:
    # the data section is composed of them (:data:`DataConfig`), and with another task
    # each of them left at its default.
    data_fields: type | None = None

    def __post_init__(self) -> None:
        if (self.draw is None) == (self.load is None):
            raise ValueError(f"task {self.name!r} needs one way to its problems: draw or load")
        if self.draw is not None and not self.levels:
            raise ValueError(f"task {self.name!r} draws its problems by level, and names none")

    def prompt_source(self, data, eval_config, seed: int) -> PromptSource:
        """This run's problems (``eval_config``: the eval section, which asks for the
        held-out set)."""
        if self.load is not None:
            return self.load(data, seed)
        return DrawnProblems(self, data, eval_config, seed)


class DrawnProblems:
    """The prompt source of a task that draws its problems by level: ``data.levels`` (or
    all of the task's), each step's problems drawn from ``[seed, step, rank]``, none of
    them a held-out prompt."""

    def __init__(self, task: Task, data, eval_config, seed: int) -> None:
        if task.draw is None:
            raise ValueError(f"task {task.name!r} loads its problems rather than drawing them")
        self.task, self.data, self.seed = task, data, seed
        self._draw: Draw = task.draw
        self.levels = list(data.levels) or list(task.levels)
        self.held_out: list[Problem] = []
        if eval_config.every and task.held_out is not None:
            self.held_out = task.held_out(self.levels, eval_config.problems_per_level, data)
        self._held_out_prompts = frozenset(problem.prompt for problem in self.held_out)

    def problems(self, step: int, count: int, rank: int, world: int) -> list[Problem]:
        rng = seeded_rng([self.seed, step, rank])
        return self._draw(self.levels, count, rng, self.data, self._held_out_prompts)


def _check_text_prompts(data, model_path: str) -> None:
    """A task whose prompts are text in ``data.prompt_template``, which a pretrained
    model's tokenizer reads (the tiny model's reads the synthetic task alone)."""
    if not model_path:
        raise ValueError(
            f"data.task={data.task!r} needs model.path: the tiny model's word-level tokenizer cannot read its text"
        )
    if "{question}" not in data.prompt_template:
        raise ValueError("data.prompt_template must contain {question}")


def _check_math(data, model_path: str) -> None:
    _check_text_prompts(data, model_path)
    math_data.check_math_data(data)


TASKS: dict[str, Task] = {task.name: task for task in (
    Task(
        "synthetic",
        verifier=synthetic_task.score_synthetic,
        verifier_needs_deadline=False,
        levels=tuple(synthetic_task.LEVELS),
        draw=lambda levels, count, rng, data, held_out: synthetic_task.sample_problems(
            levels, count, rng, data.context_tokens, data.exemplars, data.prompt_pool),
        check=synthetic_task.check_synthetic_data,
        data_fields=synthetic_task.SyntheticData,
    ),
    Task(
        "arithmetic",
        verifier=arithmetic_task.score_arithmetic,
        verifier_needs_deadline=True,
        levels=tuple(arithmetic_task.LEVELS),
        draw=lambda levels, count, rng, data, held_out: arithmetic_task.sample_problems(
            levels, count, rng, data.prompt_template, held_out),
        held_out=lambda levels, per_level, data: arithmetic_task.held_out_problems(
            levels, per_level, data.prompt_template),
        check=_check_text_prompts,
    ),
    Task(
        "math",
        verifier=math_data.math_verify_reward,
        verifier_needs_deadline=True,
        load=math_data.MathDataset,
        check=_check_math,
        data_fields=math_data.MathFiles,
    ),
)}

# The paper's appendix "Prompt" template, as its example prompt reads: the appendix
# spells it "{question}. Let's think", which puts a period after the question mark.
PAPER_PROMPT_TEMPLATE = (
    "{question} Let's think step by step and output the final answer within \\boxed{}."
)


@section
class SharedData:
    """The data section's keys that are no one task's."""

    # Not a Literal of TASKS' names: a task is its row alone, and a row registered after
    # this module is imported is a choice too; check_data_section reads the registry.
    task: str = "synthetic"
    # the difficulty levels to draw prompts from; empty: all of the task's levels
    levels: list[str] = field(default_factory=list)
    prompt_template: str = PAPER_PROMPT_TEMPLATE
    apply_chat_template: bool = False
    max_prompt_tokens: int = 1024


# The config's data section: the shared keys, then each task's own (its row's
# data_fields), in the rows' order; the bases reversed, since a dataclass takes its bases'
# fields last base first.
_DATA_PARTS = (SharedData, *(row.data_fields for row in TASKS.values() if row.data_fields))
if TYPE_CHECKING:
    # A type checker cannot read the bases of a class built at run time: to it, the data
    # section is the shared keys and those of the tasks above (a task with data_fields
    # of its own is added here too, or its keys read from a DataConfig fail the check).
    @section
    class DataConfig(math_data.MathFiles, synthetic_task.SyntheticData, SharedData):
        pass
else:
    DataConfig = section(type("DataConfig", tuple(reversed(_DATA_PARTS)), {"__module__": __name__}))


@section
class EvalConfig:
    """The config's eval section: greedy accuracy per level on the task's fixed held-out
    set, at step 0, every ``every`` rollout batches, and at the end; 0: no evaluation."""

    every: int = Field(default=0, ge=0)
    problems_per_level: int = Field(default=32, gt=0)


def check_data_section(data, eval_config, model_path: str) -> Task:
    """The data section's checks and the eval section's (which asks for the task's
    held-out set), the task's own among them; returns the task's row. Raises ValueError
    naming the key (the fields' own choices and bounds are checked when the sections are
    built)."""
    if data.task not in TASKS:
        raise ValueError(f"data.task must be one of {tuple(TASKS)}, got {data.task!r}")
    task = TASKS[data.task]
    for level in data.levels:
        if level not in task.levels:
            raise ValueError(f"data.levels[] must be one of {task.levels}, got {level!r}")
    for other in TASKS.values():
        if other is task or other.data_fields is None:
            continue
        defaults = other.data_fields()
        for key in dataclasses.fields(defaults):
            if getattr(data, key.name) != getattr(defaults, key.name):
                raise ValueError(f"data.{key.name} belongs to the {other.name} task, not data.task={data.task!r}")
    task.check(data, model_path)
    if eval_config.every and task.held_out is None:
        with_held_out = " or ".join(repr(name) for name, row in TASKS.items() if row.held_out is not None)
        raise ValueError(f"eval.every needs a task with a held-out set: data.task={with_held_out}")
    return task
