"""The GPU check's correctness section: the conformance suite, the Triton-specific tests
(CUDA sync-debug, graph capture) and the compiled-graph tests with the Triton kernels
compiled, in a child pytest (dry run: the interpreter, a subset), and its report lines."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from gpu_progress import ROOT, say


@dataclass
class TestRun:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_tests(dry_run: bool, junit: Path, seconds: float | None) -> TestRun:
    """The conformance suite, the Triton-specific tests (CUDA sync-debug, graph capture)
    and the compiled ones, in a child pytest (in parallel where pytest-xdist is there)."""
    environment = dict(os.environ)
    if dry_run:
        environment["HADW_TEST_DEVICE"] = "cpu"
        environment["TRITON_INTERPRET"] = "1"
        selection = ["tests/conformance/test_surrogate_op.py", "-k", "grpo and (plain or hadw) and float32"]
    else:
        environment["HADW_TEST_DEVICE"] = "cuda"
        environment.pop("TRITON_INTERPRET", None)
        selection = ["tests/conformance", "tests/test_triton_specific.py", "tests/test_compile.py",
                     "tests/test_segment_attention.py"]
        if importlib.util.find_spec("xdist") is not None:
            selection += ["-n", str(min(12, max(1, (os.cpu_count() or 2) - 4)))]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selection]
    say("tests: " + " ".join(command[3:]))
    started = time.time()
    output = junit.with_suffix(".log")
    with output.open("w") as log:
        try:
            subprocess.run(command, cwd=ROOT, env=environment, check=False, timeout=seconds, stdout=log,
                           stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            say(f"tests: stopped at the time limit ({seconds:.0f} s)")
    run = TestRun(seconds=time.time() - started)
    progress = output.read_text()
    output.unlink()
    if not junit.exists():
        # Stopped before pytest wrote its report (pytest-xdist's teardown can take the last
        # seconds): the outcomes as its progress lines printed them, one character a test.
        marks = "".join(line.split("[")[0] for line in progress.splitlines() if line.rstrip().endswith("%]"))
        run.passed, run.skipped = marks.count("."), marks.count("s")
        run.failed = marks.count("F") + marks.count("E")
        run.failures.append(f"no report: stopped at the time limit ({seconds:.0f} s); the counts are pytest's "
                            f"progress marks ({run.failed} F/E), the failures' names are not known")
        return run
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            run.failed += 1
            detail = next(child for child in case if child.tag in ("failure", "error"))
            run.failures.append(f"{case.get('name')}: {(detail.get('message') or '')[:300]}")
        elif "skipped" in outcome:
            run.skipped += 1
        else:
            run.passed += 1
    say(f"tests: {run.passed} passed, {run.failed} failed, {run.skipped} skipped in {run.seconds:.0f} s")
    return run



def correctness_lines(tests: TestRun, dry_run: bool) -> list[str]:
    lines = ["## Correctness (compiled Triton kernels)" if not dry_run else "## Correctness", "",
             f"{tests.passed} passed, {tests.failed} failed, {tests.skipped} skipped ({tests.seconds:.0f} s).", ""]
    lines += [f"- FAILED {failure}" for failure in tests.failures[:50]]
    return lines
