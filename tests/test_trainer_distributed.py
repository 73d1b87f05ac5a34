"""Two ranks under torchrun on the CPU: both hold the same difficulty anchor, because
y_t is all-reduced over the ranks' rewards (each rank samples different prompts); and
under ZeRO-3 with a token budget below one group's tokens, where each rank packs its own
responses into micro-batches and the ranks must agree on how many forwards to run."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the trainer extra is not installed (scripts/setup_venv.sh)")
pytestmark = pytest.mark.slow  # trainer runs in subprocesses

REPO = Path(__file__).resolve().parents[1]

from trainer.checkpoint_files import latest_checkpoint
from trainer.engine.metrics_log import read_metrics


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("batching", [
    ["train.micro_batch_prompts=1", "algorithm.loss_type=dr_grpo"],
    # A group of 4 responses holds more than 12 tokens: groups are split, and the ranks'
    # packings differ in count (ZeRO-3 gathers parameters in every forward).
    ["train.micro_batch_tokens=12", "train.zero_stage=3", "algorithm.loss_type=dapo"],
], ids=["by-prompts", "token-budget-zero3"])
def test_two_ranks_hold_the_same_anchor(tmp_path, batching):
    overrides = [
        f"run.output_dir={tmp_path}", "run.name=two", "run.progress=false", "train.steps=3",
        "train.prompts_per_step=8", "train.mini_batch_prompts=4", "rollout.group_size=4", *batching,
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), str(REPO / "trainer" / "run.py")]
    command += [arg for override in overrides for arg in ("--set", override)]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]

    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    # y_t is over both ranks' 2 x 4 prompts x 4 responses: a multiple of 1/32.
    for row in rows:
        assert (row["reward/mean"] * 32) == pytest.approx(round(row["reward/mean"] * 32))
        if row["rollout/logprob_gap"] is not None:  # vLLM on both ranks, synced
            assert row["rollout/logprob_gap"] < 1e-3
    checkpoint = latest_checkpoint(tmp_path / "two" / "checkpoints")
    anchors = [json.loads((checkpoint / f"rank{rank}.json").read_text())["anchor"] for rank in (0, 1)]
    assert anchors[0] == anchors[1]
    assert anchors[0]["step"] == 3
    assert anchors[0]["observations"] == [row["reward/mean"] for row in rows]
    if "train.micro_batch_tokens=12" in batching:
        assert all(row["update/skipped"] or row["micro_batches"] > 2 for row in rows)
