"""Verifiers that turn responses into rewards, the guard that keeps a bad one from
stopping the run, and the config's reward section with its checks.

Every reward function takes ``(response_text, answer)`` and returns a float: the task's
verifier (its row in ``registry.py``) or ``reward.function``. A function that raises, or
(with ``reward.timeout_seconds``) takes longer than that, gives reward 0 for that response
and an error message the trainer counts and logs.

The verifiers of the arithmetic and MATH tasks use ``math-verify``. Its own timeouts use
``signal.alarm``, which only works on a process's main thread and would fire inside the
trainer's own work, so they are switched off and each verification runs in a ``spawn``
worker process with a deadline: a worker stuck in sympy past it is killed and replaced,
and the other responses of the batch go on in the remaining workers.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import Field

from ..section import section
from .problem import Problem, RewardFunction
from .registry import TASKS, Task


@section
class RewardConfig:
    """The config's reward section."""

    # "package.module:function" taking (response, answer) -> float; empty: the task's own
    function: str = ""
    # > 0 runs the function in worker processes with this deadline per response (the
    # MATH verifier always needs one); 0 calls it in process.
    timeout_seconds: float = Field(default=10.0, ge=0)
    workers: int = Field(default=1, gt=0)


@dataclass
class RewardBatch:
    rewards: list[float]
    errors: list[str] = field(default_factory=list)  # one line per failed response


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


def _worker_main(connection, function: RewardFunction) -> None:
    """A reward worker: answers (index, response, answer) requests until told to stop."""
    _quiet_worker()
    connection.send("ready")
    while (request := connection.recv()) is not None:
        index, response, answer = request
        connection.send((index, *_call_safely(function, response, answer)))


class _Worker:
    """One spawned worker process and the request it is busy with."""

    def __init__(self, context, function: RewardFunction) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, function), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0

    def stop(self, kill: bool) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.connection.send(None)
            except OSError:
                self.process.kill()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()


class PooledReward:
    """A reward function run in worker processes, each response with its own deadline.

    A response is handed to an idle worker and timed from that moment, so a response
    never waits out another's deadline. A worker still busy at its deadline (stuck in
    sympy, say) is killed and replaced, and only its response scores 0: one bad response
    costs one timeout, not the rest of the batch. Workers start once and are reused.
    """

    def __init__(self, function: RewardFunction, timeout_seconds: float, workers: int) -> None:
        self.function = function
        self.timeout_seconds = timeout_seconds
        self.size = workers
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []

    def __call__(self, responses: Sequence[str], problems: Sequence[Problem]) -> RewardBatch:
        answers = [problem.answer for problem in problems]
        if len(answers) != len(responses):
            raise ValueError(f"{len(responses)} responses for {len(answers)} problems")
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self._context, self.function))
        results: dict[int, tuple[float, str | None]] = {}
        queue = list(range(len(responses)))
        queue.reverse()  # pop() from the end hands the responses out in order
        while len(results) < len(responses):
            for worker in self._workers:
                if worker.ready and worker.task is None and queue:
                    worker.task = queue.pop()
                    worker.deadline = time.monotonic() + self.timeout_seconds
                    worker.connection.send((worker.task, responses[worker.task], answers[worker.task]))
            busy = [w for w in self._workers if w.task is not None]
            waits = [w.deadline - time.monotonic() for w in busy]
            ready = multiprocessing.connection.wait(
                [w.connection for w in self._workers], timeout=max(0.0, min(waits)) if waits else None
            )
            for index, worker in enumerate(self._workers):
                if worker.connection in ready:
                    try:
                        message = worker.connection.recv()
                    except EOFError:  # the worker died (crashed, or killed from outside)
                        if not worker.ready:
                            worker.process.join()
                            raise RuntimeError(
                                f"a reward worker exited while starting (exit code {worker.process.exitcode}): "
                                f"can {self.function!r} be imported in a fresh process?"
                            ) from None
                        if worker.task is not None:
                            results[worker.task] = (0.0, "the reward worker died")
                        self._replace(index, kill=True)
                        continue
                    if message == "ready":
                        worker.ready = True
                    else:
                        task, reward, error = message
                        results[task] = (reward, error)
                        worker.task = None
                elif worker.task is not None and time.monotonic() >= worker.deadline:
                    results[worker.task] = (0.0, f"timeout after {self.timeout_seconds}s")
                    self._replace(index, kill=True)
        batch = RewardBatch([])
        for index in range(len(responses)):
            reward, error = results[index]
            batch.rewards.append(reward)
            if error:
                batch.errors.append(error)
        return batch

    def _replace(self, index: int, kill: bool) -> None:
        self._workers[index].stop(kill)
        self._workers[index] = _Worker(self._context, self.function)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop(kill=False)
        self._workers = []


def load_function(spec: str) -> RewardFunction:
    """``"package.module:function"`` -> the function; errors say which part failed."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError("must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"cannot import module {module_name!r} ({error}); is it on PYTHONPATH?") from error
    function = getattr(module, attribute, None)
    if function is None:
        raise AttributeError(f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(function):
        raise TypeError(f"{module_name}.{attribute} is a {type(function).__name__}, not a function")
    return function


def check_reward_section(reward_config, task: Task) -> None:
    """The reward section's checks for ``task`` (its registry row): the function imports,
    and a verifier that needs a deadline has one. Raises ValueError naming the key."""
    if reward_config.function:
        try:
            load_function(reward_config.function)
        except (ImportError, AttributeError, TypeError, ValueError) as error:
            raise ValueError(f"reward.function={reward_config.function!r}: {error}") from None
    elif task.verifier_needs_deadline and reward_config.timeout_seconds == 0:
        raise ValueError(f"the {task.name} task's verifier needs reward.timeout_seconds > 0 (math-verify's own "
                         f"timeout is off)")


def build_reward(data_config, reward_config):
    """The task's verifier, or the configured function (pooled when a timeout is set)."""
    if reward_config.function:
        function = load_function(reward_config.function)
    else:
        task = TASKS[data_config.task]
        if not task.verifier_needs_deadline:
            return InProcessReward(task.verifier)
        function = task.verifier
    if reward_config.timeout_seconds > 0:
        return PooledReward(function, reward_config.timeout_seconds, reward_config.workers)
    return InProcessReward(function)
