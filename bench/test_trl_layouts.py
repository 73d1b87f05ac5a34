"""The TRL layouts benchmark's quick check (``pytest bench/ --quick`` in CI): every trainer
of bench/trl_layouts.py trains its smallest case in a fresh process, so the benchmark
cannot rot. It times nothing against a threshold; the tokens each layout feeds are counts,
not timings, and are checked against each other."""

from __future__ import annotations

import math

import pytest
import trl_layouts

STEPS = 2


@pytest.fixture(scope="module")
def tiny_runs() -> dict[str, dict]:
    return {trainer: trl_layouts.run_in_fresh_process("tiny", trainer, STEPS) for trainer in trl_layouts.TRAINERS}


@pytest.mark.parametrize("trainer", trl_layouts.TRAINERS)
def test_every_trainer_trains_the_tiny_case(tiny_runs, trainer):
    run = tiny_runs[trainer]
    assert len(run["step_times"]) == STEPS
    assert all(math.isfinite(seconds) and seconds > 0 for seconds in run["step_times"])
    assert run["peak_rss_mb"] >= run["rss_before_train_mb"] > 0


def test_the_layouts_feed_fewer_tokens_than_padding(tiny_runs):
    """The model's input ids over the run: a group's prompt fed once to its micro-batch
    (shared_prompt, whole groups) < once to each micro-batch holding any of its rows
    (TRL's row shuffle) < each row's prompt and completion unpadded (packed) < every row
    padded to the longest (padded, as stock TRL)."""
    fed = {trainer: run["fed_tokens_per_step"] for trainer, run in tiny_runs.items()}
    assert fed["shared_prompt"] < fed["shared_prompt_rows"] < fed["packed"] < fed["padded"] == fed["stock"]
