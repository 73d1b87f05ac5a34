"""Checkpoints and resume: no pickle of the trainer's own is
ever loaded, a damaged checkpoint is named and skipped for the newest intact one, a torn
last line of metrics.jsonl is ignored, and resuming a run that does not exist fails.

No model is built: a stand-in engine writes and reads what DeepSpeed would.
"""

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("yaml", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

import torch

REPO = Path(__file__).resolve().parents[1]

from hadw_kernels import DifficultyAnchor, PromptHistory
from trainer.checkpoint_files import CheckpointError, completed_checkpoints, select_checkpoint
from trainer.config import ConfigError
from trainer.engine.checkpoint import load_checkpoint, save_checkpoint
from trainer.engine.metrics_log import MetricsLog, read_metrics
from trainer.run import resume_point


class _Engine:
    """Writes and reads a file as DeepSpeed's save_checkpoint/load_checkpoint would."""

    def save_checkpoint(self, directory, tag, save_latest):
        (Path(directory) / tag).mkdir(parents=True)
        (Path(directory) / tag / "model_states.pt").write_bytes(b"weights" * 1000)

    def load_checkpoint(self, directory, tag, **_):
        data = (Path(directory) / tag / "model_states.pt").read_bytes()
        if data != b"weights" * 1000:
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        return directory, {}


class _Exploit:
    """Unpickling this runs code: it creates the file named by ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _anchor_after(rewards):
    anchor = DifficultyAnchor()
    for reward in rewards:
        anchor.observe(reward, count=8)
    return anchor


def test_rng_and_trainer_state_round_trip_as_json(tmp_path):
    anchor = _anchor_after([0.2, 0.4, 0.3])
    history = PromptHistory(discount=0.8)
    history.update(torch.tensor([1.0, 0.0, 1.0, 1.0]), [7, 7, 9, 9])
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_checkpoint(tmp_path, 3, _Engine(), anchor, keep=2, history=history)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restored, restored_history = DifficultyAnchor(), PromptHistory(discount=0.8)
    assert load_checkpoint(tmp_path / "step-00000003", _Engine(), restored, restored_history) == 3
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert restored.state_dict() == anchor.state_dict()
    assert restored_history.state_dict() == history.state_dict() and len(restored_history) == 2
    # Everything the trainer wrote itself is JSON (DeepSpeed's files are its own).
    for name in ("trainer_state.json", "rank0.json", "manifest.json"):
        json.loads((tmp_path / "step-00000003" / name).read_text())
    assert not list((tmp_path / "step-00000003").glob("*.pt"))


def test_resuming_a_checkpoint_of_before_the_history_says_it_starts_afresh(tmp_path):
    save_checkpoint(tmp_path, 2, _Engine(), _anchor_after([0.5]), keep=2, history=PromptHistory())
    state_file = tmp_path / "step-00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["history"]
    state_file.write_text(json.dumps(state))
    with pytest.warns(UserWarning, match="holds no prompts' history: prompt_history's baselines start from the prior"):
        assert load_checkpoint(tmp_path / "step-00000002", _Engine(), DifficultyAnchor(), PromptHistory()) == 2


def test_a_crafted_rank_file_cannot_run_code(tmp_path):
    """rank<r>.pt was once loaded with weights_only=False, so a crafted file ran
    arbitrary code on --resume. The trainer's state is JSON now: a pickle is an error."""
    save_checkpoint(tmp_path, 2, _Engine(), _anchor_after([0.5]), keep=2, history=PromptHistory())
    checkpoint = tmp_path / "step-00000002"
    marker = tmp_path / "exploited"
    payload = pickle.dumps(_Exploit(marker))
    for name in ("rank0.pt", "rank0.json"):  # the old name and the new one
        (checkpoint / name).write_bytes(payload)
    with pytest.raises(CheckpointError, match="rank0.json"):
        load_checkpoint(checkpoint, _Engine(), DifficultyAnchor(), PromptHistory())
    assert not marker.exists()


def test_a_truncated_checkpoint_is_named_and_the_newest_intact_one_used(tmp_path):
    """A truncated file once gave a raw traceback after vLLM had started."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save_checkpoint(root, step, _Engine(), _anchor_after([0.5] * step), keep=3, history=PromptHistory())
    model_file = root / "step-00000006" / "state" / "model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])  # a copy cut short
    (root / "step-00000004" / "rank0.json").write_text("{}")  # altered after it was written
    checkpoint, warnings = select_checkpoint(root)
    assert checkpoint == root / "step-00000002"
    assert str(model_file) in warnings[0] and "truncated" in warnings[0]
    assert "rank0.json" in warnings[1]
    assert "falling back to" in warnings[-1]
    assert load_checkpoint(checkpoint, _Engine(), DifficultyAnchor(), PromptHistory()) == 2

    (root / "step-00000002" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        select_checkpoint(root)


def test_a_checkpoint_deepspeed_cannot_read_is_named(tmp_path):
    save_checkpoint(tmp_path, 2, _Engine(), _anchor_after([0.5]), keep=2, history=PromptHistory())
    (tmp_path / "step-00000002" / "state" / "model_states.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"DeepSpeed could not load .*step-00000002"):
        load_checkpoint(tmp_path / "step-00000002", _Engine(), DifficultyAnchor(), PromptHistory())


def test_a_torn_last_line_of_metrics_is_ignored_on_resume(tmp_path):
    """A run killed while appending leaves half a line, on which resume once crashed."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    log = MetricsLog(path, total_steps=5, first_step=2, enabled=True, progress=False)
    log.write({"step": 3})
    log.close()
    assert read_metrics(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    # A damaged line that is not the last is not a torn write: an error naming it.
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_the_progress_bar_tells_step_times_apart():
    """t(roll/rew/train/sync) had 0.1 s resolution: two layouts' train times of 12 and 46 ms
    both read 0.0. Three significant digits, in ms below a second."""
    from trainer.engine.metrics_log import summary

    row = {"reward/mean": 0.5, "acc/copy": 0.5, "anchor/belief": 0.4, "anchor/eta": 0.1, "phi_mean": 1.0,
           "clip_frac": 0.0, "entropy_mean": 2.0, "tokens_per_s": 300.0, "time/rollout": 0.0987,
           "time/reward": 0.0004, "time/train": 0.0123, "time/sync": 1.5}
    assert "t(roll/rew/train/sync)=98.7ms/0.4ms/12.3ms/1.5s" in summary(row)
    assert "train/sync)=98.7ms/0.4ms/45.6ms/1.5s" in summary({**row, "time/train": 0.0456})


def test_resuming_a_run_that_does_not_exist_fails_unless_asked(tmp_path):
    """--resume of a mistyped run name once silently started a new run at step 0."""
    missing = tmp_path / "runs" / "typo"
    with pytest.raises(ConfigError, match="there is no run at .*typo.*--start-if-missing"):
        resume_point(missing, resume=True, start_if_missing=False)
    assert resume_point(missing, resume=True, start_if_missing=True) == (None, [])

    existing = tmp_path / "runs" / "real"
    existing.mkdir(parents=True)
    (existing / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="pass --resume"):
        resume_point(existing, resume=False, start_if_missing=False)
    assert resume_point(existing, resume=True, start_if_missing=False) == (
        None, [f"{existing} has no checkpoint yet: it starts again at step 0"])
    save_checkpoint(existing / "checkpoints", 1, _Engine(), _anchor_after([0.5]), keep=2, history=PromptHistory())
    assert resume_point(existing, resume=True, start_if_missing=False) == (
        existing / "checkpoints" / "step-00000001", [])
    assert [step for step, _ in completed_checkpoints(existing / "checkpoints")] == [1]


def test_a_run_directory_is_claimed_by_one_process(tmp_path):
    """Two runs of one run.name started together both passed the check for an existing
    run and trained into one directory: the first to start claims it (a lock file made
    atomically), the second is refused naming the first's pid, and the lock goes with
    the run; a lock whose process is gone is taken over."""
    from trainer.run import LOCK_FILE, claimed_run_directory

    run_dir = tmp_path / "runs" / "same-name"
    with claimed_run_directory(run_dir):
        assert (run_dir / LOCK_FILE).read_text() == str(__import__("os").getpid())
        with pytest.raises(ConfigError, match=r"another trainer process \(pid \d+\) is running in .*another run.name"):
            with claimed_run_directory(run_dir):
                pass
    assert not (run_dir / LOCK_FILE).exists()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / LOCK_FILE).write_text(gone.stdout.strip())
    with claimed_run_directory(run_dir):
        pass
    assert not (run_dir / LOCK_FILE).exists()


def test_a_second_run_of_a_claimed_name_stops_before_it_builds_anything(tmp_path):
    from trainer.run import LOCK_FILE

    run_dir = tmp_path / "runs" / "busy"
    run_dir.mkdir(parents=True)
    (run_dir / LOCK_FILE).write_text(str(__import__("os").getpid()))  # this test's process: alive
    result = subprocess.run(
        [sys.executable, str(REPO / "trainer" / "run.py"), "--set", "run.name=busy", "--set",
         f"run.output_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "another trainer process" in result.stderr, result.stderr[-2000:]
    assert sorted(path.name for path in run_dir.iterdir()) == [LOCK_FILE]  # nothing written


def test_a_resume_of_a_live_run_is_refused_before_it_says_anything_else(tmp_path):
    """It first printed "has no checkpoint yet: it starts again at step 0" and only then
    was refused by the lock."""
    from trainer.run import LOCK_FILE

    run_dir = tmp_path / "runs" / "live"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / LOCK_FILE).write_text(str(__import__("os").getpid()))  # this test's process: alive
    result = subprocess.run(
        [sys.executable, str(REPO / "trainer" / "run.py"), "--resume", "--set", "run.name=live", "--set",
         f"run.output_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("config error: another trainer process"), result.stderr[-2000:]
    assert "no checkpoint" not in result.stderr


def test_an_exported_master_port_in_use_is_named(tmp_path):
    """One process without a launcher on an exported MASTER_PORT that another run holds:
    refused at startup saying what to do, not a torch.distributed traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        environment = {key: value for key, value in __import__("os").environ.items()
                       if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        result = subprocess.run(
            [sys.executable, str(REPO / "trainer" / "run.py"), "--set", f"run.output_dir={tmp_path}"],
            capture_output=True, text=True, timeout=300, env={**environment, "MASTER_PORT": str(port)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"MASTER_PORT={port} is in use" in result.stderr and "unset MASTER_PORT" in result.stderr


# One process without a launcher whose rendezvous port another process binds after the
# trainer's check and before its rendezvous: two runs started at once.
_PORT_TAKEN_BETWEEN = """
import os, socket, sys
from trainer.config import ConfigError, load_config
from trainer.engine import environment
if sys.argv[1] == "exported":
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
environment.prepare_environment(load_config(None, ["run.threads=1"]))
checked = os.environ["MASTER_PORT"]
taken = socket.socket()
taken.bind(("127.0.0.1", int(checked)))
taken.listen()
try:
    print("started", environment.init_distributed(), os.environ["MASTER_PORT"] != checked)
except ConfigError as error:
    print("refused", error)
"""


@pytest.mark.slow
@pytest.mark.parametrize("port", ["exported", "picked"])
def test_a_port_taken_between_the_check_and_the_rendezvous(port):
    """Two runs started at once with one exported MASTER_PORT both passed the check before
    either bound it, and the loser died in torch.distributed with a DistNetworkError
    traceback: it gets the named error. A port the trainer picked itself is replaced by
    another free one."""
    import os

    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    result = subprocess.run([sys.executable, "-c", _PORT_TAKEN_BETWEEN, port], capture_output=True, text=True,
                            timeout=300, env={**environment, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    if port == "exported":
        assert "refused MASTER_PORT=" in result.stdout, result.stdout + result.stderr[-2000:]
        assert "taken by another process after the trainer found it free" in result.stdout
        assert "unset MASTER_PORT" in result.stdout
    else:
        assert "started (0, 1) True" in result.stdout, result.stdout + result.stderr[-2000:]
