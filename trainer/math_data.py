"""MATH-style data from local files: JSON (a list of records), JSONL or Parquet.

Field names are configurable (``data.question_field``, ``data.answer_field``,
``data.level_field``). The answer field holds either the final answer (``"\\frac{1}{2}"``,
as in MATH-500 style files) or a full solution whose last ``\\boxed{...}`` is the answer
(the original MATH files: set ``data.answer_from_solution``). Prompts use the paper's
template (appendix "Prompt") unless configured otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .problem import Problem


def read_records(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open() as handle:
            return [json.loads(line) for line in handle if line.strip()]
    if path.suffix == ".json":
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict):  # {"data": [...]} or one record
            lists = [v for v in loaded.values() if isinstance(v, list)]
            loaded = lists[0] if len(lists) == 1 else [loaded]
        return list(loaded)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: expected a .json, .jsonl or .parquet file")


def first_record(path: Path) -> dict | None:
    """The first record, read cheaply, so a config check can see the field names."""
    if path.suffix == ".jsonl":
        with path.open() as handle:
            for line in handle:
                if line.strip():
                    return json.loads(line)
        return None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        for batch in table.iter_batches(batch_size=1):
            rows = batch.to_pylist()
            if rows:
                return rows[0]
        return None
    records = read_records(path)
    return records[0] if records else None


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


class MathDataset:
    """The records of ``data.train_files`` as problems, walked in a seeded order.

    ``problems(step, count, rank, world)`` is a pure function of its arguments, so a
    resumed run sees the same prompts as an uninterrupted one: epoch ``e`` is a fixed
    permutation drawn from ``seed + e``, and ranks take disjoint interleaved slices.
    """

    def __init__(self, data_config, seed: int) -> None:
        self.seed = seed
        self._epoch: int | None = None
        self._epoch_order = np.empty(0, dtype=np.int64)
        self.items: list[Problem] = []
        for name in data_config.train_files:
            for record in read_records(Path(name)):
                self.items.append(self._problem(record, data_config, name))
        if not self.items:
            raise ValueError(f"no usable records in {data_config.train_files}")

    @staticmethod
    def _problem(record: dict, data_config, source: str) -> Problem:
        question = str(record[data_config.question_field]).strip()
        answer = str(record[data_config.answer_field])
        if data_config.answer_from_solution:
            boxed = last_boxed(answer)
            if boxed is None:
                raise ValueError(f"{source}: a solution has no \\boxed{{}} answer: {answer[:80]!r}")
            answer = boxed
        level = str(record.get(data_config.level_field, "all"))
        prompt = data_config.prompt_template.replace("{question}", question)
        return Problem(prompt, answer.strip(), level)

    def problems(self, step: int, count: int, rank: int = 0, world: int = 1) -> list[Problem]:
        size = len(self.items)
        start = step * count * world + rank * count
        chosen = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, size)
            chosen.append(self.items[int(self._order(epoch)[offset])])
        return chosen

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:  # steps walk epochs in order: keep the current one
            self._epoch = epoch
            self._epoch_order = np.random.default_rng([self.seed, epoch]).permutation(len(self.items))
        return self._epoch_order
