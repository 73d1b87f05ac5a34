"""What a prompt source hands the trainer: the prompt text, the answer a verifier checks
the response against, and a difficulty label for per-level accuracy curves; and how a
response is scored against that answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# (response text, answer) -> reward
RewardFunction = Callable[[str, str], float]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    level: str


def encode_prompt(tokenizer, prompt: str, *, apply_chat_template: bool, max_prompt_tokens: int) -> list[int]:
    """A prompt's token ids as the policy sees it: the chat template's user turn or the
    plain text, cut to its last ``max_prompt_tokens`` (the template's instruction comes
    after the question)."""
    if apply_chat_template:
        # return_dict=False: transformers 5 otherwise returns a BatchEncoding (a Mapping,
        # not a dict), whose keys were once sent to vLLM as token ids.
        ids = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        ))
    else:
        ids = tokenizer(prompt).input_ids
    return ids[-max_prompt_tokens:]


def seeded_rng(seed: int | list[int]) -> np.random.Generator:
    """numpy's generator for ``seed``, which every task draws its problems from.

    numpy is imported here rather than at the top: the task registry loads with the
    config, which run.py imports before it sets the thread count (engine/environment.py)
    that numpy's BLAS reads once, when numpy loads."""
    import numpy as np

    return np.random.default_rng(seed)
