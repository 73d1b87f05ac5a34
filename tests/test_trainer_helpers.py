"""Reward functions for the trainer tests, at module level so that spawned reward
workers and trainer subprocesses import them by name. Holds no tests itself."""

import os
import time

from trainer.tasks.synthetic_task import score_synthetic


def nothing_right(response: str, answer: str) -> float:
    """Every response wrong: every group degenerate, every update skipped."""
    return 0.0


def raises(response: str, answer: str) -> float:
    raise RuntimeError("this verifier is broken")


def synthetic_but_raises_on_odd(response: str, answer: str) -> float:
    """The synthetic verifier with a bug: every prompt with an odd answer raises."""
    if int(answer) % 2:
        raise RuntimeError("this verifier is broken on odd answers")
    return score_synthetic(response, answer)


def hangs_on_seven(response: str, answer: str) -> float:
    if answer == "7":
        time.sleep(60)
    return float(response == answer)


_calls = 0


def synthetic_then_crash(response: str, answer: str) -> float:
    """The synthetic verifier, until the process dies abruptly after
    CRASH_AFTER_RESPONSES calls: a stand-in for a machine failure mid-run."""
    global _calls
    _calls += 1
    if _calls > int(os.environ["CRASH_AFTER_RESPONSES"]):
        os._exit(17)
    return score_synthetic(response, answer)


def any_number(response: str, answer: str) -> float:
    """An easy task: a response is right when it holds a number, whatever the prompt.
    A random policy answers one 4 times in 10; a policy learns it in a few dozen steps."""
    return float(any(character.isdigit() for character in response))
