"""What a prompt source hands the trainer: the prompt text, the answer a verifier checks
the response against, and a difficulty label for per-level accuracy curves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    level: str
