"""The objectives' table (objectives.table.OBJECTIVES, objectives.py): every objective's declared
derivative is autograd's of its value, at random points and at the edges (clip bounds,
delta, the dual-clip bound, A = 0), so the kernels that transcribe the derivative
transcribe the reference's gradient."""

import dataclasses
import math

import pytest
import torch

from hadw_kernels.config.loss_config import LossConfig
from hadw_kernels.config.presets import LOSS_PRESETS
from hadw_kernels.objectives import formulas as objectives
from hadw_kernels.objectives.table import OBJECTIVE_NAMES, OBJECTIVE_OPTIONS, OBJECTIVES

# Options away from the defaults where they exist, so each one is exercised.
OPTIONS = {
    "clip": [dict(), dict(dual_clip=3.0), dict(delta=1.5, epsilon_high=0.3), dict(delta=1.1, epsilon_high=0.3)],
    "cispo_cap": [dict(ratio_cap=1.7)],
    "cispo_clip": [dict(epsilon_low=0.1, epsilon_high=0.3)],
    "sapo": [dict(sapo_temperature_pos=0.8, sapo_temperature_neg=1.3)],
    "gmpo": [dict()],
    "vespo": [dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)],
    "gpg": [dict()],
    "dppo_tv": [dict(ratio_cap=1.4, epsilon_low=0.15, epsilon_high=0.25)],
    "dppo_kl": [dict(ratio_cap=1.4, epsilon_low=0.05, epsilon_high=0.1)],
    "dro": [dict(dro_beta=0.7)],
    "clip_cov": [dict(epsilon_low=0.1, epsilon_high=0.3)],
    "kl_cov": [dict(ppo_kl_coef=0.6)],
}

# A trial row's formulas: the checks of a row read none of them.
TRIAL_FORMULAS = {"value": objectives.clip_value, "slope": objectives.clip_slope}


def _config(objective, options):
    return LossConfig.build("grpo", objective=objective, **options)


def _points(config):
    """Ratios at random and on every edge: 1 +- eps, delta, the dual-clip bound's c."""
    generator = torch.Generator().manual_seed(0)
    edges = [1 - config.epsilon_low, 1 + config.epsilon_high, 1.0, 0.5, 3.0]
    for name in ("delta", "dual_clip", "ratio_cap"):
        if name in OBJECTIVES[config.objective].options and config.option(name) is not None:
            edges.append(config.option(name))
    ratio = torch.cat([torch.exp(0.8 * torch.randn(200, generator=generator, dtype=torch.float64)),
                       torch.tensor(edges, dtype=torch.float64)])
    advantage = torch.randn(ratio.numel(), generator=generator, dtype=torch.float64)
    advantage[::7] = 0.0
    advantage[-len(edges):] = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0][:len(edges)] + [-1.0] * (len(edges) - 5),
                                           dtype=torch.float64)
    logprob = -torch.rand(ratio.numel(), generator=generator, dtype=torch.float64) * 4
    weight = torch.rand(ratio.numel(), generator=generator, dtype=torch.float64) * 2
    # The behaviour log-probs apart from the ratio (a variable of its own here), some equal
    # to the current ones (|x| at 0), all <= 0 (DPPO's probabilities).
    old_logprob = -torch.rand(ratio.numel(), generator=generator, dtype=torch.float64) * 4
    old_logprob[::9] = logprob[::9]
    return ratio, advantage, logprob, old_logprob, weight


@pytest.mark.parametrize("objective, options", [(name, o) for name in OBJECTIVE_NAMES for o in OPTIONS[name]],
                         ids=lambda value: str(value))
def test_declared_derivative_is_autograds(objective, options):
    config = _config(objective, options)
    ratio, advantage, logprob, old_logprob, weight = _points(config)
    ratio = ratio.clone().requires_grad_()
    logprob = logprob.clone().requires_grad_()
    value = OBJECTIVES[objective].value(ratio, advantage, logprob, old_logprob, weight, config)
    d_ratio, d_logprob = torch.autograd.grad(value.sum(), [ratio, logprob], allow_unused=True, materialize_grads=True)
    declared_ratio, declared_logprob = OBJECTIVES[objective].slope(ratio.detach(), advantage, logprob.detach(),
                                                                   old_logprob, weight, config)
    torch.testing.assert_close(declared_ratio, d_ratio, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(declared_logprob, d_logprob, rtol=1e-12, atol=1e-12)


def test_every_preset_resolves():
    for loss_type in LOSS_PRESETS:
        config = LossConfig.build(loss_type)
        for name in OBJECTIVES[config.objective].options:
            config.option(name)  # the default or the preset's


def test_options_of_another_objective_are_refused():
    for option, owners in OBJECTIVE_OPTIONS.items():
        other = next(name for name in OBJECTIVE_NAMES if name not in owners)
        with pytest.raises(ValueError, match=f"{option} is an option of the '{owners[0]}'"):
            LossConfig.build("grpo", objective=other, **{option: 2.0})


@pytest.mark.parametrize("options, match", [
    (dict(objective="cispo_cap", ratio_cap=0.2), "TRL recommends 5"),
    (dict(objective="clip", delta=0.0), "delta must be a finite positive number"),
    (dict(objective="sapo", sapo_temperature_pos=0.0), "sapo_temperature_pos"),
    (dict(objective="vespo", vespo_k_neg=-1.0), "vespo_k_neg"),
    (dict(objective="gmpo", ratio_level="token"), "takes ratio_level in"),
    (dict(objective="gpg", ratio_level="sequence"), "takes ratio_level in"),
    (dict(objective="ppo"), "unknown objective"),
    (dict(ratio_level="response"), "takes ratio_level in"),
])
def test_bad_objective_options(options, match):
    with pytest.raises(ValueError, match=match):
        LossConfig.build("grpo", **options)


def test_vespo_weight_matches_its_formula():
    config = _config("vespo", OPTIONS["vespo"][0])
    summed = torch.tensor([-30.0, -2.0, 0.0, 0.5, 25.0], dtype=torch.float64)
    for sign, (k, lam) in ((1.0, (1.5, 2.5)), (-1.0, (2.5, 1.5))):
        phi = objectives.vespo_weight(summed, torch.full_like(summed, sign), config)
        log_w = summed.clamp(math.log(1e-8), 20.0)
        expected = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        torch.testing.assert_close(phi, torch.nan_to_num(expected, nan=0.0, posinf=0.0, neginf=0.0))
    assert objectives.vespo_weight(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                                   config).item() == pytest.approx(1.0)  # phi(1) = 1


def test_gmpo_clips_the_harmful_side_only():
    config = LossConfig.build("gmpo")  # log-space range 0.4
    log_ratio = torch.tensor([-1.0, -0.1, 0.1, 1.0], dtype=torch.float64)
    up = objectives.gmpo_log_ratio(log_ratio, torch.ones(4, dtype=torch.float64), config)
    down = objectives.gmpo_log_ratio(log_ratio, -torch.ones(4, dtype=torch.float64), config)
    zero = objectives.gmpo_log_ratio(log_ratio, torch.zeros(4, dtype=torch.float64), config)
    assert up.tolist() == pytest.approx([-1.0, -0.1, 0.1, 0.4])
    assert down.tolist() == pytest.approx([-0.4, -0.1, 0.1, 1.0])
    assert zero.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_a_row_with_more_options_than_slots_is_refused():
    from hadw_kernels.objectives.table import NON_NEGATIVE, OPTION_SLOTS, Objective, Option

    options = tuple(Option(f"trial_{index}", 1.0, (NON_NEGATIVE,), "a trial option") for index in range(OPTION_SLOTS))
    assert len(Objective(options=options, gradient="ratio", **TRIAL_FORMULAS).options) == OPTION_SLOTS
    extra = Option("trial_extra", 1.0, (NON_NEGATIVE,), "one too many")
    with pytest.raises(ValueError, match=rf"at most {OPTION_SLOTS} options \(the Triton kernels' option slots"):
        Objective(options=(*options, extra), gradient="ratio", **TRIAL_FORMULAS)


def test_a_shared_option_declared_otherwise_or_elsewhere_is_refused():
    """Objectives that share an option declare it alike but for its default, at one index
    of their option vectors (the kernels read it by one constant): refused otherwise, with
    an error that ``python -O`` keeps."""
    from hadw_kernels.objectives.table import NON_NEGATIVE, POSITIVE, Objective, Option, shared_options

    scale = Option("trial_scale", 1.0, (POSITIVE,), "a trial option")
    other = Option("trial_other", 1.0, (NON_NEGATIVE,), "another")
    alike = {"a": Objective(options=(scale,), gradient="ratio", **TRIAL_FORMULAS),
             "b": Objective(options=(dataclasses.replace(scale, default=2.0),), gradient="ratio", **TRIAL_FORMULAS)}
    assert shared_options(alike) == {"trial_scale": ("a", "b")}
    unlike = {**alike, "c": Objective(options=(dataclasses.replace(scale, bounds=(NON_NEGATIVE,)),), gradient="ratio",
                                      **TRIAL_FORMULAS)}
    with pytest.raises(ValueError, match="'trial_scale' is declared otherwise in 'c' than in 'a'"):
        shared_options(unlike)
    moved = {**alike, "c": Objective(options=(other, scale), gradient="ratio", **TRIAL_FORMULAS)}
    with pytest.raises(ValueError, match="'trial_scale' sits at another index of 'c'"):
        shared_options(moved)


def test_a_row_s_defaults_keep_its_bounds():
    from hadw_kernels.objectives.table import POSITIVE, Objective, Option

    with pytest.raises(ValueError, match="its default -1.0 is out of its bounds"):
        Objective(options=(Option("trial", -1.0, (POSITIVE,), "a trial option"),), gradient="ratio",
                  **TRIAL_FORMULAS)


def test_a_row_s_response_step_is_checked():
    """A response step is one of RESPONSE_STEPS, on an objective without the token ratio
    form (which reads no whole response) and, for log_ratio_sum, that selects no tokens
    (both would be its one per-token weight)."""
    from hadw_kernels.objectives.table import Objective

    with pytest.raises(ValueError, match="response step is one of"):
        Objective(options=(), gradient="ratio", **TRIAL_FORMULAS, ratio_levels=("sequence",),
                  response_step="log_ratio_mean")
    with pytest.raises(ValueError, match="takes no token ratio form"):
        Objective(options=(), gradient="ratio", **TRIAL_FORMULAS, response_step="clipped_log_ratio_mean",
                  response_formula=objectives.gmpo_log_ratio)
    with pytest.raises(ValueError, match="not both"):
        Objective(options=(), gradient="detached_weight", **TRIAL_FORMULAS, ratio_levels=("sequence",),
                  selection=objectives.kl_cov_selection,
                  response_step="log_ratio_sum", response_formula=objectives.vespo_weight)


def test_a_response_step_comes_with_its_formula_and_only_then():
    from hadw_kernels.objectives.table import Objective

    with pytest.raises(ValueError, match="has its formula"):
        Objective(options=(), gradient="ratio", **TRIAL_FORMULAS, ratio_levels=("sequence",),
                  response_step="clipped_log_ratio_mean")
    with pytest.raises(ValueError, match="has its formula"):
        Objective(options=(), gradient="ratio", **TRIAL_FORMULAS, response_formula=objectives.gmpo_log_ratio)


def test_only_the_formula_files_name_an_objective_s_code():
    """The kernels branch on the row's fields (its response step, its gradient route), and
    on an objective's code only in their formula files, one branch per objective: a new
    objective is its row and its formulas (docs/architecture.md, "Adding an objective")."""
    import re
    from pathlib import Path

    from hadw_kernels.backends import cpp_constants

    root = Path(__file__).resolve().parents[1]
    code = re.compile(r"\b(?:OBJECTIVE_(?:{})|kObjective(?:{}))\b".format(
        "|".join(name.upper() for name in OBJECTIVE_NAMES),
        "|".join(cpp_constants._identifier(name) for name in OBJECTIVE_NAMES)))
    sources = [*sorted((root / "hadw_kernels" / "triton").glob("*.py")), *sorted((root / "csrc").iterdir())]
    naming = {str(path.relative_to(root)) for path in sources if code.search(path.read_text())}
    # codes.py defines the codes (python -m hadw_kernels.tools.codegen writes it).
    assert naming == {"hadw_kernels/triton/codes.py", "hadw_kernels/triton/token_math.py", "csrc/token_math.h"}
