"""Benchmark session: options, the case matrix, and the summary written at the end.

    pytest bench/            full sweep (G = 8..64, the dense cases, Qwen3's vocabulary;
                             how long it takes: docs/benchmarks.md)
    pytest bench/ --quick    one small shape per case, for CI (or HADW_BENCH_QUICK=1)

The table and the plot go to bench/results/ (git-ignored) and the table is printed at
the end of the session.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# `pytest bench/` from a checkout that was not pip-installed still finds the package.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import matrix  # noqa: E402
from report import LEGEND, markdown_tables, write_reports  # noqa: E402

ROWS = pytest.StashKey[list]()
STARTED = pytest.StashKey[tuple]()
PATHS = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("hadw-bench")
    group.addoption("--quick", action="store_true", help="one small shape per case (CI); or HADW_BENCH_QUICK=1")
    group.addoption("--bench-rounds", type=int, default=None, help="timed steps per case, at least (default 3, quick 2; short steps get more)")
    group.addoption(
        "--bench-memory-cap-gb", type=float, default=16.0,
        help="address-space cap of a case above its baseline: beyond it the case reports out of memory",
    )


def quick_mode(config) -> bool:
    return config.getoption("--quick") or os.environ.get("HADW_BENCH_QUICK", "") not in ("", "0")


def timed_rounds(config) -> int:
    rounds = config.getoption("--bench-rounds")
    if rounds is not None:
        return rounds
    return matrix.QUICK_ROUNDS if quick_mode(config) else matrix.FULL_ROUNDS


def pytest_configure(config):
    config.stash[ROWS] = []
    config.stash[STARTED] = (time.monotonic(), os.getloadavg()[0], _git_commit())


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        from hadw_kernels.backends import BACKENDS

        cases = matrix.cases(quick_mode(metafunc.config), BACKENDS)
        metafunc.parametrize("case", cases, ids=[case.id for case in cases])


@pytest.fixture
def bench_settings(request) -> dict:
    config = request.config
    return {
        "rounds": timed_rounds(config),
        "quick": quick_mode(config),
        "memory_cap_gb": config.getoption("--bench-memory-cap-gb"),
    }


@pytest.fixture
def record_row(request):
    return request.config.stash[ROWS].append


def _cpu_model() -> str:
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in output.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True, cwd=REPO_ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def session_meta(config) -> dict:
    import torch

    from hadw_kernels import available_backends

    started, load_at_start, commit_at_start = config.stash[STARTED]
    quick = quick_mode(config)
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "mode": "quick" if quick else "full",
        "machine": f"{os.cpu_count()} CPUs (nproc), {_cpu_model()}, {platform.system()} {platform.machine()}",
        "load average (1 min) at start / end": f"{load_at_start:.1f} / {os.getloadavg()[0]:.1f}",
        "session wall time": f"{time.monotonic() - started:.0f} s",
        "commit at start (the working tree is what runs)": commit_at_start,
        "versions": (
            f"torch {torch.__version__}, liger-kernel {_version('liger-kernel')}, "
            f"cut-cross-entropy {_version('cut-cross-entropy')}, trl {_version('trl')}, Python {platform.python_version()}"
        ),
        "hadw backends available here": ", ".join(available_backends()),
        "per case": (
            "fresh process, torch.set_num_threads(the case's threads), fp32, "
            f"1 warm-up, then {timed_rounds(config)} timed forward+backward steps (more, up to "
            f"{matrix.MOST_ROUNDS}, until {matrix.timed_seconds_for(False, quick):g} s of steps are timed), "
            "then 1 profiled step; a dense case: each implementation in "
            f"{matrix.dense_processes(quick)} such processes in turns with the others', "
            f"each timing at least {matrix.least_rounds_for(True, quick, timed_rounds(config))} rounds and "
            f"{matrix.timed_seconds_for(True, quick):g} s, the first with the profiled step"
        ),
    }


def pytest_sessionfinish(session):
    rows = session.config.stash[ROWS]
    if not rows:
        return
    stem = "loss_step_quick" if quick_mode(session.config) else "loss_step"
    session.config.stash[PATHS] = write_reports(rows, session_meta(session.config), RESULTS_DIR, stem)



def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash[ROWS]
    if not rows:
        return
    terminalreporter.section("loss step: time and peak memory")
    terminalreporter.write_line(markdown_tables(rows))
    terminalreporter.write_line(LEGEND)
    for kind, path in config.stash.get(PATHS, {}).items():
        terminalreporter.write_line(f"{kind}: {path}")
