"""Verifiers that turn responses into rewards, and the guard that keeps a bad one from
stopping the run.

Every reward function takes ``(response_text, answer)`` and returns a float. A function
that raises, or (for the MATH verifier) takes longer than ``reward.timeout_seconds``,
gives reward 0 for that response and an error message the trainer counts and logs.

The MATH verifier uses ``math-verify``. Its own timeouts use ``signal.alarm``, which only
works on a process's main thread and would fire inside the trainer's own work, so they
are switched off and each verification runs in a worker process of a ``spawn`` pool with
a deadline: a worker stuck in sympy past it is killed and the pool rebuilt.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .math_data import last_boxed
from .problem import Problem
from .synthetic_task import score_synthetic

RewardFunction = Callable[[str, str], float]


@dataclass
class RewardBatch:
    rewards: list[float]
    errors: list[str] = field(default_factory=list)  # one line per failed response


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the response's last ``\\boxed{}`` is mathematically equal to ``answer``.

    A response without a boxed answer scores 0: the prompt asks for one, and a bare
    number elsewhere in a chain of thought is not the model's final answer.
    """
    from math_verify import parse, verify

    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    gold = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    target = parse("\\boxed{" + predicted + "}", parsing_timeout=None)
    return float(verify(gold, target, timeout_seconds=None))


def _quiet_worker() -> None:
    # math-verify warns on every call that its signal timeout is off: the pool's
    # deadline replaces it.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _call_safely(function: RewardFunction, response: str, answer: str) -> tuple[float, str | None]:
    try:
        return float(function(response, answer)), None
    except Exception as error:  # a reward function's bug must not stop training
        return 0.0, f"{type(error).__name__}: {error}"


class InProcessReward:
    """A cheap reward function called directly, each response guarded."""

    def __init__(self, function: RewardFunction) -> None:
        self.function = function

    def __call__(self, responses: Sequence[str], problems: Sequence[Problem]) -> RewardBatch:
        batch = RewardBatch([])
        for response, problem in zip(responses, problems, strict=True):
            reward, error = _call_safely(self.function, response, problem.answer)
            batch.rewards.append(reward)
            if error:
                batch.errors.append(error)
        return batch

    def close(self) -> None:
        pass


class PooledReward:
    """A reward function run in worker processes, each response with a deadline."""

    def __init__(self, function: RewardFunction, timeout_seconds: float, workers: int) -> None:
        self.function = function
        self.timeout_seconds = timeout_seconds
        self.workers = workers
        self._pool = None

    def _ensure_pool(self):
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.workers, initializer=_quiet_worker)
        return self._pool

    def __call__(self, responses: Sequence[str], problems: Sequence[Problem]) -> RewardBatch:
        pool = self._ensure_pool()
        pending = [
            pool.apply_async(_call_safely, (self.function, response, problem.answer))
            for response, problem in zip(responses, problems, strict=True)
        ]
        batch = RewardBatch([])
        stuck = False
        for result in pending:
            try:
                # Each response gets the full deadline from the moment it is awaited:
                # the queue ahead of it is bounded by the deadlines of those before.
                reward, error = result.get(timeout=self.timeout_seconds)
            except multiprocessing.TimeoutError:
                reward, error, stuck = 0.0, f"timeout after {self.timeout_seconds}s", True
            batch.rewards.append(reward)
            if error:
                batch.errors.append(error)
        if stuck:
            # A worker still inside sympy would hold the pool: kill it and start afresh.
            self.close()
        return batch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def load_function(spec: str) -> RewardFunction:
    """``"package.module:function"`` -> the function."""
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        raise ValueError(f"reward.function {spec!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module_name), attribute)


def build_reward(data_config, reward_config):
    """The task's verifier, or the configured function (pooled when a timeout is set)."""
    if reward_config.function:
        function = load_function(reward_config.function)
    elif data_config.task == "math":
        function = math_verify_reward
    else:
        return InProcessReward(score_synthetic)
    if reward_config.timeout_seconds > 0:
        return PooledReward(function, reward_config.timeout_seconds, reward_config.workers)
    return InProcessReward(function)
