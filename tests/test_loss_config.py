"""The loss's options as one object: ``config=LossConfig`` and the keywords build the same
loss, never together; the batch's required positions; the linear loss's shape checks
without log-probs."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from hadw_kernels import (
    HADWGRPOLoss,
    LinearHADWGRPOLoss,
    LossConfig,
    fused_hadw_grpo_loss,
    fused_linear_hadw_grpo_loss,
)
from hadw_kernels.objectives.table import OBJECTIVE_OPTIONS, OBJECTIVES

OPTIONS = dict(group_size=2, beta=0.04, kl_estimator="k2", dual_clip=3.0, epsilon_high=0.28, lambda_scale=1.5)


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch, width, hidden, vocab = 4, 5, 8, 16
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[1, 3:] = False
    return dict(
        logprobs=-torch.rand(batch, width, generator=generator, dtype=torch.float64) - 0.5,
        old=-torch.rand(batch, width, generator=generator, dtype=torch.float64) - 0.5,
        ref=-torch.rand(batch, width, generator=generator, dtype=torch.float64) - 0.5,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64),
        mask=mask,
        hidden=torch.randn(batch, width, hidden, generator=generator, dtype=torch.float64),
        weight=torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) / 3,
        labels=torch.randint(0, vocab, (batch, width), generator=generator),
    )


def _surrogate(data, **options):
    logprobs = data["logprobs"].clone().requires_grad_()
    loss, metrics = fused_hadw_grpo_loss(logprobs, data["old"], data["rewards"], data["mask"], anchor=0.4,
                                         ref_logprobs=data["ref"], return_metrics=True, backend="torch", **options)
    loss.backward()
    return loss.detach(), logprobs.grad, metrics


def _linear(data, **options):
    hidden = data["hidden"].clone().requires_grad_()
    weight = data["weight"].clone().requires_grad_()
    loss = fused_linear_hadw_grpo_loss(hidden, weight, data["labels"], data["old"], data["rewards"], data["mask"],
                                       anchor=0.4, ref_logprobs=data["ref"], backend="torch", **options)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_config_and_keywords_build_the_same_loss(loss_type):
    data = _batch()
    by_keywords = _surrogate(data, loss_type=loss_type, **OPTIONS)
    by_config = _surrogate(data, config=LossConfig.build(loss_type, **OPTIONS))
    assert torch.equal(by_keywords[0], by_config[0]) and torch.equal(by_keywords[1], by_config[1])
    assert by_keywords[2].keys() == by_config[2].keys()
    assert all(torch.equal(by_keywords[2][name], by_config[2][name]) for name in by_keywords[2])
    # A different config gives a different loss: the config is really what is used.
    assert not torch.equal(_surrogate(data, config=LossConfig.build(loss_type, group_size=2))[0], by_config[0])


def test_linear_loss_takes_the_config_with_its_entropy_coefficient():
    data = _batch(1)
    options = dict(OPTIONS, entropy_coef=0.01)
    by_keywords = _linear(data, loss_type="dapo", **options)
    by_config = _linear(data, config=LossConfig.build("dapo", **options))
    assert all(torch.equal(a, b) for a, b in zip(by_keywords, by_config))
    assert not torch.equal(_linear(data, config=LossConfig.build("dapo", **OPTIONS))[0], by_config[0])


def test_modules_hold_a_config():
    data = _batch(2)
    config = LossConfig.build("grpo", **OPTIONS)
    module = HADWGRPOLoss(config=config, backend="torch")
    loss = module(data["logprobs"], data["old"], data["rewards"], data["mask"], anchor=0.4, ref_logprobs=data["ref"])
    assert torch.equal(loss, _surrogate(data, config=config)[0])
    assert "config=LossConfig(" in repr(module)
    with pytest.raises(TypeError, match="not both"):
        LinearHADWGRPOLoss(config=config, beta=0.1)


@pytest.mark.parametrize("keyword", [dict(loss_type="dapo"), dict(beta=0.0), dict(group_size=2), dict(dual_clip=2.0)])
def test_config_and_an_option_keyword_together_are_refused(keyword):
    data = _batch()
    with pytest.raises(TypeError, match=rf"not both: got config and \['{next(iter(keyword))}'\]"):
        _surrogate(data, config=LossConfig.build("grpo", group_size=2), **keyword)


def test_a_config_that_is_not_a_loss_config_is_refused():
    with pytest.raises(TypeError, match="config must be a LossConfig"):
        _surrogate(_batch(), config={"loss_type": "grpo"})


def test_a_hand_built_config_is_validated():
    config = LossConfig(group_size=2, normalize_std=True, loss_agg_mode="token-average", epsilon_low=0.2,
                        epsilon_high=0.2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token-average'"):
        _surrogate(_batch(), config=config)


def test_response_mask_is_a_required_position():
    data = _batch()
    with pytest.raises(TypeError, match="response_mask"):
        fused_hadw_grpo_loss(data["logprobs"], data["old"], data["rewards"], group_size=2)
    with pytest.raises(TypeError, match="response_mask"):
        fused_linear_hadw_grpo_loss(data["hidden"], data["weight"], data["labels"], data["old"], data["rewards"],
                                    group_size=2)


def test_linear_loss_checks_the_batch_against_the_hidden_states():
    data = _batch()
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, H\] with \[B, T\] = \(4, 4\) \(response_mask's shape\)"):
        _linear(dict(data, mask=data["mask"][:, :4]), group_size=2)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(4, 4\), response_mask \(4, 5\)"):
        _linear(dict(data, old=data["old"][:, :4]), group_size=2)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        _linear(dict(data, rewards=data["rewards"].to("meta")), group_size=2)


def test_the_option_keywords_are_the_config_fields():
    import dataclasses

    from hadw_kernels.config.option_types import LossOptions

    assert set(LossOptions.__annotations__) == {"loss_type"} | {f.name for f in dataclasses.fields(LossConfig)}


def test_an_unknown_option_keyword_is_refused():
    with pytest.raises(TypeError, match=r"unknown options \['loss_typ'\]"):
        _surrogate(_batch(), loss_typ="dapo", group_size=2)
    with pytest.raises(TypeError, match=r"unknown options \['block_row'\]"):
        LinearHADWGRPOLoss(block_row=64)


def test_the_entropy_bonus_is_the_linear_loss_s_only():
    with pytest.raises(TypeError, match="entropy_coef needs the entropy"):
        _surrogate(_batch(), group_size=2, entropy_coef=0.01)
    with pytest.raises(TypeError, match="unknown options"):
        HADWGRPOLoss(entropy_coef=0.01)
    LinearHADWGRPOLoss(entropy_coef=0.01)


def test_a_config_holding_an_entropy_bonus_is_refused_by_the_log_prob_loss():
    """The keyword form was refused; a config holding it was accepted and its bonus
    dropped without a word."""
    config = LossConfig.build("grpo", group_size=2, entropy_coef=0.5)
    with pytest.raises(TypeError, match="entropy_coef needs the entropy"):
        _surrogate(_batch(), config=config)
    with pytest.raises(TypeError, match="entropy_coef needs the entropy"):
        HADWGRPOLoss(config=config)
    LinearHADWGRPOLoss(config=config)
    _surrogate(_batch(), config=LossConfig.build("grpo", group_size=2, entropy_coef=0.0))


FIELD_TYPES = {
    "group_size": "an int or None", "normalize_std": "a bool", "loss_agg_mode": "a string",
    "objective": "a string", "ratio_level": "a string", "epsilon_low": "a number", "epsilon_high": "a number",
    "std_eps": "a number", "lambda_scale": "a number", "beta": "a number", "kl_estimator": "a string",
    "entropy_coef": "a number", "loss_normalizer": "a number or None", "max_response_length": "an int or None",
    "rollout_correction": "a RolloutCorrection or None", "off_policy_mask_threshold": "a number or None",
    "top_entropy_quantile": "a number", "entropy_mask_dtype": "a string", "kl_bias_correction": "a bool",
    "kl_bias_ratio": "a string", "advantage_estimator": "a string",
    # Every objective's own option (objectives.table.OBJECTIVES): a number, or None for its default.
    **{name: "a number or None" for name in OBJECTIVE_OPTIONS},
}


def test_every_loss_config_field_is_listed_here():
    import dataclasses

    assert set(FIELD_TYPES) == {field.name for field in dataclasses.fields(LossConfig)}


@pytest.mark.parametrize("name", sorted(FIELD_TYPES))
def test_a_value_of_the_wrong_type_names_the_option_and_the_type(name):
    """beta="0.1" and dual_clip="3" raised "'<=' not supported between instances of
    'int' and 'str'", naming neither; every option is checked by its annotation."""
    wrong = [0.5] if FIELD_TYPES[name] in ("a string", "a bool") else ["3"]
    if FIELD_TYPES[name].startswith("an int"):
        wrong += [2.5, True]
    if FIELD_TYPES[name].startswith("a number"):
        wrong += [True]
    for value in wrong:
        expected = rf"{name} must be {FIELD_TYPES[name]}, got {value!r} \({type(value).__name__}\)"
        with pytest.raises(TypeError, match=expected):
            LossConfig.build("grpo", **{name: value})
        with pytest.raises(TypeError, match=expected):  # the keyword form (the linear loss takes every option)
            LinearHADWGRPOLoss(**{name: value})


def test_loss_config_build_lists_its_options_for_an_unknown_one():
    with pytest.raises(TypeError, match=r"unknown options \['clip_ratio'\]; LossConfig's options are \['advantage_estimator', 'beta', "):
        LossConfig.build("grpo", clip_ratio=0.2)


def test_every_metric_says_what_it_is_a_mean_over():
    from hadw_kernels.tables.metrics import CORRECTION_METRIC_NAMES, METRIC_MEAN_OVER, METRIC_NAMES

    assert tuple(METRIC_MEAN_OVER) == METRIC_NAMES + CORRECTION_METRIC_NAMES
    assert set(METRIC_MEAN_OVER.values()) <= {"tokens", "ratios", "responses", "groups"}


def test_a_call_s_config_is_built_once_per_set_of_options_and_never_hides_an_error():
    """The losses keep the config of each set of keyword options (a quarter of a small
    call's host time was building it): the same options give the same object, a value of
    another type is still refused (False == 0, but a bool is no number), and an invalid set
    raises on every call."""
    from hadw_kernels.config.call_config import call_config

    first = call_config(None, {"loss_type": "dapo", "epsilon_high": 0.3}, linear=False)
    assert call_config(None, {"loss_type": "dapo", "epsilon_high": 0.3}, linear=False) is first
    assert call_config(None, {"loss_type": "dapo", "epsilon_high": 0.4}, linear=False).epsilon_high == 0.4
    assert call_config(None, {"loss_type": "dapo", "epsilon_low": 0}, linear=False).epsilon_low == 0
    for _ in range(2):
        with pytest.raises(TypeError, match="epsilon_low must be a number"):
            call_config(None, {"loss_type": "dapo", "epsilon_low": False}, linear=False)
        with pytest.raises(ValueError, match="epsilon_low"):
            call_config(None, {"loss_type": "dapo", "epsilon_low": -1.0}, linear=False)
    # A value that does not hash (a list) is not cached: it is refused by name, every time.
    for _ in range(2):
        with pytest.raises(TypeError, match="epsilon_low must be a number"):
            call_config(None, {"loss_type": "dapo", "epsilon_low": [0.1]}, linear=False)
    # A rollout correction with rejection filters hashes: its config is kept too.
    from hadw_kernels import RolloutCorrection

    correction = RolloutCorrection(rejection={"seq_mean_k3": 0.01})
    built = call_config(None, {"rollout_correction": correction}, linear=False)
    assert built.rollout_correction == correction
    assert call_config(None, {"rollout_correction": correction}, linear=False) is built


def test_kernel_options_are_a_fresh_dict_each_call():
    """The op options are formed once per config, but a caller that edits its dict (tests
    refusing a ratio form do) must not change the next call's."""
    config = LossConfig.build("vespo")
    edited = config.kernel_options()
    edited["ratio_level"] = -1
    assert config.kernel_options()["ratio_level"] != -1


# --- the objectives' options, declared once in their rows ----------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_the_option_fields_and_keywords_come_from_the_rows():
    """LossConfig has a field per objective option (a number or None, None by default),
    in the table's order, and LossOptions a keyword; nothing but their generated block
    (hadw_kernels/tools/codegen.py) declares them."""
    import dataclasses

    from hadw_kernels.config.option_types import LossOptions

    fields = {field.name: field for field in dataclasses.fields(LossConfig)}
    names = list(fields)
    first = names.index(next(iter(OBJECTIVE_OPTIONS)))
    assert names[first:first + len(OBJECTIVE_OPTIONS)] == list(OBJECTIVE_OPTIONS)
    assert all(fields[name].default is None for name in OBJECTIVE_OPTIONS)
    assert set(OBJECTIVE_OPTIONS) <= set(LossOptions.__annotations__)
    from hadw_kernels.tools.codegen import FIELDS_END, FIELDS_START

    head, rest = (ROOT / "hadw_kernels" / "config" / "loss_config.py").read_text().split(FIELDS_START)
    source = head + rest.split(FIELDS_END)[1]  # loss_config.py but its generated fields
    assert not [name for name in OBJECTIVE_OPTIONS if re.search(rf"\b{name}\b", source)], \
        "loss_config.py names an objective option: declare it in its row of objectives/table.py"


def _named_objective_comparisons(path) -> list[str]:
    """The comparisons in ``path`` with an objective's name (``x == "gmpo"``, ``x in
    ("clip", "sapo")``)."""
    import ast

    def names_objective(operand) -> bool:
        elements = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        return any(isinstance(element, ast.Constant) and element.value in OBJECTIVES for element in elements)

    tree = ast.parse(path.read_text())
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(names_objective(operand) for operand in [node.left, *node.comparators])]


# Where the package compares a value with an objective's name: objectives.py, whose
# formulas are the objectives' own (the objectives that read whole responses are found by
# their rows' response step: docs/architecture.md, "Adding an objective").
NAMED_OBJECTIVE_BRANCHES = {
    "objectives/formulas.py": ["objective == 'dppo_tv'"],
}


def test_no_check_is_keyed_by_an_objective_s_name():
    """No module of the package compares a value with an objective's name (each check is
    its row's, LossConfig's included) but the branches listed above."""
    package = ROOT / "hadw_kernels"
    found = {str(path.relative_to(package)): _named_objective_comparisons(path)
             for path in sorted(package.rglob("*.py"))}
    assert {path: found for path, found in found.items() if found} == NAMED_OBJECTIVE_BRANCHES


def test_a_check_keyed_by_an_objective_s_name_is_found(tmp_path):
    source = tmp_path / "trial.py"
    source.write_text("def check(config):\n    if config.objective in ('sapo', 'other'):\n        raise ValueError\n")
    assert _named_objective_comparisons(source) == ["config.objective in ('sapo', 'other')"]


def _expected_refusal(objective: str, name: str, value: float) -> str | None:
    option = OBJECTIVES[objective].options[name]
    for bounds in option.bounds:
        if not bounds.hold(value):
            return f"{name} must {bounds.says}, got {value!r}"
    for lower, upper in OBJECTIVES[objective].increasing:
        low, high = (value, OBJECTIVES[objective].options[upper].default) if name == lower else \
            (OBJECTIVES[objective].options[lower].default, value) if name == upper else (0.0, 1.0)
        if not low < high:
            return f"{lower} must be below {upper}, got {low!r} and {high!r}"
    return None


@pytest.mark.parametrize("objective, name", [(owner, name) for name, owners in OBJECTIVE_OPTIONS.items()
                                              for owner in owners])
def test_each_option_is_checked_by_its_row(objective, name):
    """Every option's value is held to its row's bounds (and an increasing pair to its
    order) by LossConfig, with the row's words in the error, whatever the objective."""
    for value in (-1e40, -1.0, 0.0, 1e-40, 2e-4, 0.5, 1.0, 1.5, 7.0, 1e40, math.inf, -math.inf, math.nan):
        expected = _expected_refusal(objective, name, value)
        if expected is None:
            assert LossConfig.build("grpo", objective=objective, **{name: value}).option(name) == value
        else:
            with pytest.raises(ValueError, match=re.escape(expected)):
                LossConfig.build("grpo", objective=objective, **{name: value})


@pytest.mark.parametrize("objective", [name for name, row in OBJECTIVES.items()
                                       if any(option.required for option in row.options.values())])
def test_a_required_option_left_out_is_refused_by_its_row(objective):
    required = [option for option in OBJECTIVES[objective].options.values() if option.required]
    with pytest.raises(ValueError, match=rf"objective '{objective}' needs {required[0].name} \("):
        LossConfig.build("grpo", objective=objective)


def test_every_field_range_names_a_field_and_holds_its_default():
    """config.FIELD_BOUNDS: each bound is a field's, and the field's default (if any) is in it."""
    from hadw_kernels.config.loss_config import FIELD_BOUNDS

    fields = {field.name: field for field in dataclasses.fields(LossConfig)}
    assert set(FIELD_BOUNDS) <= set(fields)
    for name, bounds in FIELD_BOUNDS.items():
        default = fields[name].default
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert bounds.hold(default), name
