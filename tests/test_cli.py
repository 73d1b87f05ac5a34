"""The command-line tools: a bad argument is refused as argparse refuses one (the usage
line, one message naming the flag, exit code 2, no traceback), ``--help`` shows every
option's default, the demo prints the same for the same seed, and the trainer's
commands run from any directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _demo(argv):
    from hadw_kernels.tools.demo import main

    return main(argv)


def _plan(argv):
    from hadw_kernels.tools.plan import main

    return main(argv)


def _theory(argv):
    from hadw_kernels.theory.__main__ import main

    return main(argv)


def _probe(argv):
    from trainer.tools.probe import parse_args

    return parse_args(argv)


def _compare(argv):
    from trainer.tools.compare import main

    return main(argv)


def _calibrate(argv):
    from trainer.tools.calibrate import main

    return main(argv)


def _bias(argv):
    from trainer.tools.bias import main

    return main(argv)


def _plot(argv):
    from trainer.tools.plot import main

    return main(argv)


TOOLS = {"demo": _demo, "plan": _plan, "theory": _theory, "probe": _probe, "compare": _compare,
         "calibrate": _calibrate, "plot": _plot, "bias": _bias}

BAD_ARGUMENTS = [
    ("demo", ["--steps", "0"], "--steps"),
    ("demo", ["--group-size", "1"], "--group-size"),
    ("demo", ["--vocab", "-3"], "--vocab"),
    ("demo", ["--length", "x"], "--length"),
    ("demo", ["--seed", "-1"], "--seed"),
    ("demo", ["--loss-type", "ppo"], "--loss-type"),
    ("demo", ["--backend", "cuda-magic"], "--backend"),
    ("plan", ["-G", "0"], "--group-size/-G"),
    ("plan", ["--response-length", "-5"], "--response-length"),
    ("plan", ["--prompt-length", "-1"], "--prompt-length"),
    ("plan", ["--prompts", "0"], "--prompts"),
    ("plan", ["--gpus", "0"], "--gpus"),
    ("plan", ["--gpu-memory-gib", "-1"], "--gpu-memory-gib"),
    ("plan", ["--gpu-memory-gib", "nan"], "--gpu-memory-gib"),
    ("plan", ["--gpu-memory-gib", "0"], "--gpu-memory-gib"),
    ("plan", ["--overhead-gib", "inf"], "--overhead-gib"),
    ("plan", ["--overhead-gib", "-2"], "--overhead-gib"),
    ("theory", ["--anchor", "1.5"], "--anchor"),
    ("theory", ["--group-size", "1"], "--group-size"),
    ("theory", ["--groups", "0"], "--groups"),
    ("theory", ["--lambda-scale", "0"], "--lambda-scale"),
    ("theory", ["--reward-scale", "nan"], "--reward-scale"),
    ("theory", ["--spread-thresholds", "0.1", "-1"], "--spread-thresholds"),
    ("theory", ["--out", str(REPO / "README.md")], "--out"),  # an existing file
    ("theory", ["--out", str(REPO / "README.md" / "figures")], "--out"),  # inside one
    ("probe", ["--json", str(REPO / "docs")], "--json"),  # a directory
    ("probe", ["--json", str(REPO / "README.md" / "probe.json")], "--json"),
    ("compare", ["--table", str(REPO / "README.md" / "table.md")], "--table"),
    ("compare", ["--plot", str(REPO / "docs")], "--plot"),
    ("probe", ["--micro-batch-tokens", "-5"], "--micro-batch-tokens"),
    ("probe", ["--micro-batch-tokens", "5"], "--micro-batch-tokens"),  # below one sequence's 80 tokens
    ("probe", ["--max-budget-tokens", "0"], "--max-budget-tokens"),
    ("probe", ["--max-budget-tokens", "79"], "--max-budget-tokens"),
    ("probe", ["--memory-limit-gib", "-1"], "--memory-limit-gib"),
    ("probe", ["--memory-limit-gib", "nan"], "--memory-limit-gib"),
    ("probe", ["--steps", "-1"], "--steps"),
    ("probe", ["--steps", "0"], "--steps"),  # nothing to measure without --find-max-budget
    ("probe", ["-G", "0"], "--group-size/-G"),
    ("probe", ["-L", "0"], "--response-length/-L"),
    ("probe", ["-P", "0"], "--prompt-length/-P"),
    ("probe", ["--prompts", "0"], "--prompts"),
    ("probe", ["--threads", "-1"], "--threads"),
    ("probe", ["--seed", "-1"], "--seed"),
    ("compare", ["--steps", "0"], "--steps"),
    ("compare", ["--seeds", "0", "-1"], "--seeds"),
    ("compare", ["--lr-scale", "-1"], "--lr-scale"),
    ("calibrate", ["--prompts", "0"], "--prompts"),
    ("plot", [str(REPO / "docs")], "run_dir"),  # no metrics.jsonl
    ("plot", [str(REPO), "--out", str(REPO / "docs")], "--out"),
    ("calibrate", ["--seed", "-1"], "--seed"),
    ("bias", ["--groups", "0"], "--groups"),
    ("bias", ["--reference", "1"], "--reference"),
    ("bias", ["--group-sizes", "4", "1"], "--group-sizes"),
    ("bias", ["--steps", "0"], "--steps"),
]


@pytest.mark.parametrize("tool, argv, flag", BAD_ARGUMENTS, ids=[f"{t}{''.join(a)}" for t, a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_a_usage_error_naming_the_flag(tool, argv, flag, capsys):
    """Each ran (a negative budget reported, a plan for -1 GiB), or ended in a traceback
    (the probe's --steps -1: StatisticsError; the plan's -G 0 before its message)."""
    with pytest.raises(SystemExit) as exited:
        TOOLS[tool](argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "Traceback" not in err
    [message] = [line for line in err.splitlines() if ": error: " in line]
    assert f"error: argument {flag}: " in message, message


def test_the_demo_refuses_a_backend_that_cannot_run_here(monkeypatch, capsys):
    import hadw_kernels.tools.demo

    monkeypatch.setattr(hadw_kernels.tools.demo, "available_backends", lambda device: ["torch"])
    with pytest.raises(SystemExit) as exited:
        _demo(["--backend", "cpp"])
    assert exited.value.code == 2
    message = "error: argument --backend: 'cpp' cannot run on the CPU here; available: ['torch']"
    assert message in capsys.readouterr().err


def test_gpu_check_refuses_a_round_count_below_one():
    completed = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--rounds", "0"],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert "error: argument --rounds: must be at least 1, got 0" in completed.stderr


def _option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in ``--help`` (its flags line and help), by its first flag."""
    section = help_text.split("options:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n(?=  -)", section)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}


@pytest.mark.parametrize("tool", ["demo", "plan", "probe", "theory", "compare", "bias"])
def test_help_shows_every_option_s_default(tool, capsys):
    """The demo's, probe's and plan's --help described few options and no defaults."""
    with pytest.raises(SystemExit) as exited:
        TOOLS[tool](["--help"])
    assert exited.value.code == 0
    entries = _option_entries(capsys.readouterr().out)
    assert len(entries) > 4
    for flag, entry in entries.items():
        if flag != "-h":
            assert re.search(r"\S.* \(default: .*\)$", entry), entry


def test_help_shows_the_actual_defaults(capsys):
    with pytest.raises(SystemExit):
        _plan(["--help"])
    entries = _option_entries(capsys.readouterr().out)
    assert entries["--gpus"].endswith("(default: 8)") and entries["--model"].endswith("(default: Qwen3-4B)")
    with pytest.raises(SystemExit):
        _probe(["--help"])
    entries = _option_entries(capsys.readouterr().out)
    assert entries["--micro-batch-tokens"].endswith("(default: 0)")
    assert entries["--max-budget-tokens"].endswith(f"(default: {1 << 21})")


def test_probe_help_describes_it_once_and_whole(capsys):
    """The description was the docstring's first line, cut mid-sentence, and the whole
    docstring followed as the epilog, so its start was printed twice."""
    with pytest.raises(SystemExit):
        _probe(["--help"])
    out = capsys.readouterr().out
    assert out.count("Peak memory and throughput of real train steps") == 1
    assert "at a chosen token budget: ``python -m trainer.tools.probe``." in " ".join(out.split())
    assert "--find-max-budget`` bisects" in out  # the details follow, as written


@pytest.mark.slow
def test_the_trainer_commands_run_from_the_checkout(tmp_path):
    """The wheel installs the library only: each trainer command runs as a file from any
    directory (it puts its checkout on the path) and as a module from the checkout's
    root, and the probe writes only where it is told (--json)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("PYTHONPATH", None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    figures = tmp_path / "out" / "probe.json"
    probe = ["--preset", "tiny", "--device", "cpu", "-G", "2", "-L", "4", "-P", "2", "--steps", "1",
             "--threads", "1", "--json", str(figures)]
    completed = subprocess.run([sys.executable, str(REPO / "trainer" / "tools" / "probe.py"), *probe], cwd=elsewhere,
                               env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(figures.read_text())["preset"] == "tiny"
    assert list(elsewhere.iterdir()) == []
    for module in ("trainer.run", "trainer.tools.probe", "trainer.tools.compare", "trainer.tools.calibrate",
                   "trainer.tools.plot", "trainer.tools.bias"):
        as_file = REPO.joinpath(*module.split(".")).with_suffix(".py")
        for command, cwd in (([sys.executable, "-m", module, "--help"], REPO),
                             ([sys.executable, str(as_file), "--help"], elsewhere)):
            shown = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
            assert shown.returncode == 0 and shown.stdout.startswith("usage:"), (command, shown.stderr[-2000:])
    assert list(elsewhere.iterdir()) == []


def _demo_output(seed: int) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "hadw_kernels.tools.demo", "--seed", str(seed), "--steps", "2", "--prompts", "2",
         "--group-size", "4", "--length", "16", "--hidden", "32", "--vocab", "64"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


@pytest.mark.slow
def test_the_demo_prints_the_same_for_the_same_seed():
    """Its LM head came from the global generator: every run printed another loss."""
    first = _demo_output(0)
    assert "step 2: loss" in first
    assert _demo_output(0) == first
    assert _demo_output(1) != first
