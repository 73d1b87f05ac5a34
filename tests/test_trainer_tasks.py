"""The task registry: a task is its row, which the config's checks, the reward, the
loop's prompts and evaluation and the calibration read; the rows draw the problems the
loop drew before the registry; each part's check reports a ConfigError naming its key;
the trainer's config loads no numerics library (torch, numpy) before the run sets the
thread count; the policy passes the loss the options validation checks."""

import ast
import dataclasses
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("yaml", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

import numpy as np

from trainer.config import ConfigError, load_config, validate
from trainer.engine.loop import Trainer
from trainer.engine.settings import loss_options
from trainer.tasks import arithmetic_task, rewards, synthetic_task
from trainer.tasks.problem import Problem
from trainer.tasks.registry import TASKS, Task
from trainer.tasks.rewards import InProcessReward, build_reward

REPO = Path(__file__).resolve().parents[1]


def _parity(response: str, answer: str) -> float:
    return float(response.strip() == answer)


def _parity_problem(level: str, rng) -> Problem:
    value = int(rng.integers(100 if level == "hard" else 10))
    return Problem(f"parity {value} ?", "even" if value % 2 == 0 else "odd", level)


def _parity_check(data, model_path: str) -> None:
    if data.prompt_template.count("{question}") > 1:
        raise ValueError("data.prompt_template may hold {question} once for the parity task")


PARITY = Task(
    "parity",
    verifier=_parity,
    verifier_needs_deadline=False,
    levels=("easy", "hard"),
    draw=lambda levels, count, rng, data, held_out: [
        _parity_problem(levels[int(rng.integers(len(levels)))], rng) for _ in range(count)],
    held_out=lambda levels, per_level, data: [Problem(f"parity {i} ?", "even" if i % 2 == 0 else "odd", level)
                                              for level in levels for i in range(per_level)],
    check=_parity_check,
)


def _prompts(config) -> types.SimpleNamespace:
    """The loop's prompt source and its problems, as the Trainer builds them (without a model)."""
    trainer = types.SimpleNamespace(config=config, prompts_per_rank=4, rank=1, world_size=2)
    Trainer._build_prompt_source(trainer)
    trainer.first = Trainer._problems(trainer, 0)
    return trainer


def test_a_new_task_is_its_row_alone(monkeypatch):
    """A throwaway task registered in the registry alone is validated, scored, drawn,
    evaluated and calibrated: nothing else names the tasks."""
    monkeypatch.setitem(TASKS, "parity", PARITY)
    config = load_config(None, ["data.task=parity", "data.levels=[hard]", "eval.every=2",
                                "eval.problems_per_level=3"])
    validate(config)
    with pytest.raises(ConfigError, match=r"data.levels\[\] must be one of \('easy', 'hard'\), got 'copy'"):
        validate(load_config(None, ["data.task=parity", "data.levels=[copy]"]))
    with pytest.raises(ConfigError, match="may hold {question} once for the parity task"):
        validate(load_config(None, ["data.task=parity", "data.prompt_template='{question} or {question}'"]))

    reward = build_reward(config.data, config.reward)
    assert isinstance(reward, InProcessReward) and reward.function is _parity

    trainer = _prompts(config)
    assert trainer.levels == ["hard"]
    assert [problem.prompt for problem in trainer.held_out] == ["parity 0 ?", "parity 1 ?", "parity 2 ?"]
    expected = PARITY.draw(["hard"], 4, np.random.default_rng([config.train.seed, 0, 1]), config.data, frozenset())
    assert trainer.first == expected and all(problem.level == "hard" for problem in expected)
    assert reward([problem.answer for problem in expected], expected).rewards == [1.0] * 4

    # A task without a held-out set, one whose verifier needs a deadline: read from the row.
    monkeypatch.setitem(TASKS, "parity", dataclasses.replace(PARITY, held_out=None, verifier_needs_deadline=True))
    with pytest.raises(ConfigError, match=r"eval.every needs a task with a held-out set: data.task='arithmetic'$"):
        validate(load_config(None, ["data.task=parity", "eval.every=2"]))
    with pytest.raises(ConfigError, match="the parity task's verifier needs reward.timeout_seconds > 0"):
        validate(load_config(None, ["data.task=parity", "reward.timeout_seconds=0"]))
    monkeypatch.setattr(rewards, "PooledReward", lambda function, timeout, workers: ("pooled", function, timeout))
    assert build_reward(config.data, config.reward) == ("pooled", _parity, config.reward.timeout_seconds)


def test_the_type_checker_s_data_section_holds_every_task_s_keys():
    """registry.py declares DataConfig a second time for type checkers, by hand (they
    cannot read the bases of the class built at run time): its bases are the shared keys
    and every registered task's data_fields, so a task with keys of its own fails here
    until it is added there."""
    from trainer.tasks import registry

    tree = ast.parse(Path(registry.__file__).read_text())
    declared = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "DataConfig"]
    assert len(declared) == 1
    bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in declared[0].bases}
    assert bases == {part.__name__ for part in registry._DATA_PARTS}


def test_an_unknown_task_names_the_registry_s_tasks():
    with pytest.raises(ConfigError, match=r"data.task must be one of \('synthetic', 'arithmetic', 'math'\), "
                                          r"got 'chess'"):
        validate(load_config(None, ["data.task=chess"]))


def test_a_row_names_one_way_to_its_problems():
    with pytest.raises(ValueError, match="needs one way to its problems"):
        dataclasses.replace(PARITY, load=lambda data, seed: None)
    with pytest.raises(ValueError, match="names none"):
        dataclasses.replace(PARITY, levels=())


def test_the_rows_draw_what_the_loop_drew_before_the_registry(tmp_path):
    """The synthetic and arithmetic rows draw each step's problems from [seed, step, rank],
    as the loop did itself, so a run trains on the same prompts as before."""
    synthetic = _prompts(load_config(None, ["data.context_tokens=3", "train.seed=5"]))
    assert synthetic.levels == list(synthetic_task.LEVELS) and synthetic.held_out == []
    assert synthetic.first == synthetic_task.sample_problems(list(synthetic_task.LEVELS), 4,
                                                             np.random.default_rng([5, 0, 1]), 3)

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 256, "num_attention_heads": 4}')
    config = load_config(None, ["data.task=arithmetic", f"model.path={model}", "rollout.engine=hf", "eval.every=5",
                                "eval.problems_per_level=2", "data.levels=[plus,two-digit]"])
    validate(config)
    arithmetic = _prompts(config)
    template = config.data.prompt_template
    held_out = arithmetic_task.held_out_problems(["plus", "two-digit"], 2, template)
    assert arithmetic.held_out == held_out
    assert arithmetic.first == arithmetic_task.sample_problems(
        ["plus", "two-digit"], 4, np.random.default_rng([0, 0, 1]), template, frozenset(p.prompt for p in held_out))


def test_each_part_s_check_is_a_config_error_naming_its_key():
    for override, message in (("model.dtype=float16", "model.dtype must be one of"),
                              ("model.num_heads=3", "model.hidden_size=64 is not divisible by model.num_heads=3"),
                              ("data.levels=[plus]", "data.levels[] must be one of"),
                              ("eval.every=3", "eval.every needs a task with a held-out set"),
                              ("reward.workers=0", "reward.workers must be positive")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(load_config(None, [override]))


def test_the_policy_passes_the_loss_the_options_validation_checks(monkeypatch):
    from trainer.engine import policy

    captured = {}
    monkeypatch.setattr(policy, "fused_linear_hadw_grpo_loss", lambda *args, **options: captured.update(options))
    config = load_config(None, ["algorithm.loss_type=dapo", "algorithm.epsilon_high=0.28", "rollout.temperature=0.7",
                                "algorithm.loss_backend=torch"])
    batch = types.SimpleNamespace(labels=None, response_mask=None, cu_seqlens=None, per_segment=lambda values: values)
    policy.policy_loss(None, None, batch, None, None, config, loss_normalizer=1.0)
    assert {name: captured[name] for name in loss_options(config)} == loss_options(config)
    assert loss_options(config)["epsilon_high"] == 0.28 and loss_options(config)["temperature"] == 0.7


def test_the_config_loads_no_numerics_library():
    """run.py imports the config (and through it each part's checks) before it sets the
    thread count torch and numpy read when they load (engine/environment.py)."""
    code = ("import sys, trainer.run, trainer.tools.calibrate; "
            "print(sorted(name for name in ('numpy', 'torch') if name in sys.modules))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert shown.returncode == 0 and shown.stdout.strip() == "[]", shown.stderr[-2000:]


def test_a_prompt_pool_makes_prompts_recur_as_a_large_dataset_s_do():
    """data.prompt_pool: each step's prompts drawn from one fixed pool of distinct prompts
    (the same for every seed, as a dataset is one file), so that over 200 steps of 64
    prompts a prompt of a pool of 5000 recurs about 12800 / 5000 = 2.6 times, where the
    levels' 152 problems recur every 2-3 steps."""
    from collections import Counter

    def visits(overrides):
        config = load_config(None, ["train.prompts_per_step=64"] + overrides)
        validate(config)
        source = TASKS["synthetic"].prompt_source(config.data, config.eval, config.train.seed)
        return Counter(problem.prompt for step in range(200) for problem in source.problems(step, 64, 0, 1))

    assert len(visits([])) == 10 + 10 + 100 + 2 ** synthetic_task.COUNT_LENGTH  # every problem, ~84 visits each
    pooled = visits(["data.prompt_pool=5000"])
    pool = synthetic_task.prompt_pool(tuple(synthetic_task.LEVELS), 5000)
    assert len({problem.prompt for problem in pool}) == 5000
    assert set(pooled) <= {problem.prompt for problem in pool}
    assert 2.5 < sum(pooled.values()) / len(pooled) < 3.5  # visits of a prompt drawn at all
    assert max(pooled.values()) < 12
    # Another seed draws other prompts of the same pool.
    assert set(visits(["data.prompt_pool=5000", "train.seed=1"])) <= {problem.prompt for problem in pool}
    # Each prompt is an identifier (its own number, 4 digits) before a problem whose answer
    # it leaves as it was: the verifier reads the response alone.
    for problem in pool[:50]:
        identifier, question = problem.prompt.split(" ", 4)[:4], problem.prompt.split(" ", 4)[4]
        assert all(token.isdigit() for token in identifier)
        assert synthetic_task.score_synthetic(problem.answer, problem.answer) == 1.0
        assert question.split()[0] == problem.level
    assert synthetic_task.pool_id_tokens(5000) == 4 and synthetic_task.pool_id_tokens(0) == 0


@pytest.mark.parametrize("overrides, message", [
    (["data.prompt_pool=-1"], "data.prompt_pool must be non-negative"),
    (["data.prompt_pool=100", "data.context_tokens=3"], "data.prompt_pool draws prompts that recur"),
])
def test_a_prompt_pool_is_refused_where_it_cannot_recur(overrides, message):
    # (with another task, as each of a task's own keys: test_trainer_config.py)
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides))
