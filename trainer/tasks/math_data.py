"""MATH-style data from local files: JSON (a list of records), JSONL or Parquet.

Field names are configurable (``data.question_field``, ``data.answer_field``,
``data.level_field``). The answer field holds either the final answer (``"\\frac{1}{2}"``,
as in MATH-500 style files) or a full solution whose last ``\\boxed{...}`` is the answer
(the original MATH files: set ``data.answer_from_solution``). Prompts use the paper's
template (appendix "Prompt") unless configured otherwise. A response scores 1 when its
last ``\\boxed{}`` equals the answer (:func:`math_verify_reward`).
"""

from __future__ import annotations

import json
import re
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING

from ..section import section
from .problem import Problem, seeded_rng

if TYPE_CHECKING:
    import numpy as np

# The files data.train_files may name.
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")

MAX_REPORTED_ROWS = 10


@section
class MathFiles:
    """The data section's keys the math task alone reads (its row's ``data_fields``): local
    JSON / JSONL / Parquet files and their field names."""

    train_files: list[str] = field(default_factory=list)
    question_field: str = "problem"
    answer_field: str = "answer"
    # True when the answer field holds a full solution whose last \boxed{} is the answer
    answer_from_solution: bool = False
    level_field: str = "level"


class DataError(ValueError):
    """Records that cannot become problems; the message names each bad row."""


def read_records(path: Path) -> list[tuple[str, object]]:
    """``(where, record)`` pairs; ``where`` names the row for error messages ("line 3" of
    a JSONL file, "record 3" of a JSON list or Parquet table, counted from 1)."""
    if path.suffix == ".jsonl":
        records = []
        with path.open() as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    records.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}, line {number} is not JSON: {error}") from None
        return records
    if path.suffix == ".json":
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise DataError(f"{path} is not JSON: {error}") from None
        if isinstance(loaded, dict):  # {"data": [...]} or one record
            lists = [v for v in loaded.values() if isinstance(v, list)]
            loaded = lists[0] if len(lists) == 1 else [loaded]
        if not isinstance(loaded, list):
            raise DataError(f"{path} holds neither a list of records nor a mapping")
        return [(f"record {number}", record) for number, record in enumerate(loaded, start=1)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [(f"record {number}", record) for number, record in enumerate(rows, start=1)]
    raise DataError(f"{path}: expected a .json, .jsonl or .parquet file")


def problem_from_record(record: object, data_config) -> Problem:
    """One record as a problem; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"is a {type(record).__name__}, not a record of fields")
    values = {}
    for key in ("question_field", "answer_field"):
        name = getattr(data_config, key)
        if name not in record:
            raise ValueError(f"has no field {name!r} (data.{key}; fields: {sorted(record)})")
        value = record[name]
        # null would become the string "None" and train against it
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"has an empty {name!r} field ({value!r})")
        values[key] = str(value).strip()
    answer = values["answer_field"]
    if data_config.answer_from_solution:
        boxed = last_boxed(answer)
        if boxed is None or not boxed.strip():
            raise ValueError(f"has a solution without a \\boxed{{}} answer: {values['answer_field'][:60]!r}")
        answer = boxed
    level = record.get(data_config.level_field)
    level = "all" if level is None else str(level)
    prompt = data_config.prompt_template.replace("{question}", values["question_field"])
    return Problem(prompt, answer.strip(), level)


def load_problems(data_config) -> list[Problem]:
    """Every record of ``data.train_files`` as a problem, each row checked first: one
    error lists every bad row (the first few of them, and how many there are)."""
    problems, bad = [], []
    for name in data_config.train_files:
        path = Path(name)
        records = read_records(path)
        if not records:
            bad.append(f"{path} holds no records")
        for where, record in records:
            try:
                problems.append(problem_from_record(record, data_config))
            except ValueError as error:
                bad.append(f"{path}, {where} {error}")
    if bad:
        shown = "\n  ".join(bad[:MAX_REPORTED_ROWS])
        more = f"\n  ... and {len(bad) - MAX_REPORTED_ROWS} more" if len(bad) > MAX_REPORTED_ROWS else ""
        raise DataError(f"{len(bad)} bad row(s) in data.train_files:\n  {shown}{more}")
    return problems


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for index in range(opening, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1 : index]
    return None


def check_math_data(data_config) -> None:
    """The math task's own checks of the data section: its files exist, and every row of
    them becomes a problem (a bad row fails now, not mid-run)."""
    if not data_config.train_files:
        raise ValueError("data.task='math' needs data.train_files (local JSON, JSONL or Parquet files)")
    for name in data_config.train_files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"data.train_files: {path} does not exist")
        if path.suffix not in DATA_SUFFIXES:
            raise ValueError(f"data.train_files: {path} is not one of {DATA_SUFFIXES}")
    load_problems(data_config)


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the response's last ``\\boxed{}`` is mathematically equal to ``answer``.

    A response without a boxed answer scores 0: the prompt asks for one, and a bare
    number elsewhere in a chain of thought is not the model's final answer.
    """
    from math_verify import parse, verify

    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    gold = parse("\\boxed{" + _without_percent(answer) + "}", parsing_timeout=None)
    target = parse("\\boxed{" + _without_percent(predicted) + "}", parsing_timeout=None)
    return float(verify(gold, target, timeout_seconds=None))


def _without_percent(text: str) -> str:
    """``10\\%`` -> ``10``: math-verify reads a percentage as its number, but only with
    the ANTLR 4.13 LaTeX grammar; with ANTLR 4.9 (which omegaconf, hence verl, pins) it
    keeps ``10\\%`` as text and a right answer would score 0."""
    return re.sub(r"\\?%", "", text)


class MathDataset:
    """The records of ``data.train_files`` as problems, walked in a seeded order: the
    math task's prompt source (tasks/registry.py).

    ``problems(step, count, rank, world)`` is a pure function of its arguments, so a
    resumed run sees the same prompts as an uninterrupted one: epoch ``e`` is a fixed
    permutation drawn from ``seed + e``, and ranks take disjoint interleaved slices. The
    levels are the files' own; there is no held-out set.
    """

    def __init__(self, data_config, seed: int) -> None:
        self.seed = seed
        self._epoch: int | None = None
        self._epoch_order: np.ndarray | None = None
        self.items: list[Problem] = load_problems(data_config)
        self.levels = sorted({item.level for item in self.items})
        self.held_out: list[Problem] = []

    def problems(self, step: int, count: int, rank: int = 0, world: int = 1) -> list[Problem]:
        size = len(self.items)
        start = step * count * world + rank * count
        chosen = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, size)
            chosen.append(self.items[int(self._order(epoch)[offset])])
        return chosen

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch or self._epoch_order is None:  # steps walk epochs in order: keep the current one
            self._epoch = epoch
            self._epoch_order = seeded_rng([self.seed, epoch]).permutation(len(self.items))
        return self._epoch_order
