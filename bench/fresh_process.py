"""The pytest side of ``worker.py``: starts a case in a fresh process and drives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
WORKER = BENCH_DIR / "worker.py"


class CaseFailed(Exception):
    """The case could not run to the end here; ``status`` says why (for the table)."""

    def __init__(self, status: str, reason: str, report: dict):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.report = report


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    # One compile thread: no pool of compile workers competing with the timed cores.
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # Never time the Triton interpreter by accident.
    env.pop("TRITON_INTERPRET", None)
    return env


class Worker:
    """One case in its own process: ``ready()``, then ``step()`` per timed round, then
    ``finish()`` for the memory figures. Any failure raises :class:`CaseFailed`."""

    def __init__(self, worker_args: list[str], threads: int, memory_cap_gb: float):
        self._stderr = tempfile.TemporaryFile(mode="w+")
        command = [
            sys.executable, str(WORKER), *worker_args, "--threads", str(threads),
            "--memory-cap-gb", str(memory_cap_gb), "--serve",
        ]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, cwd=REPO_ROOT, env=worker_env(threads),
        )
        self.report: dict = {}
        self.step_seconds: list[float] = []

    def _receive(self, expected: str) -> dict:
        line = self._process.stdout.readline()
        if not line:
            raise CaseFailed(*self._death(), self.report)
        message = json.loads(line)
        self.report.update({k: v for k, v in message.items() if k not in ("event", "seconds")})
        if message["event"] == "done" and message["status"] != "ok":
            raise CaseFailed(message["status"], message.get("reason", ""), self.report)
        if message["event"] != expected:
            raise CaseFailed("error", f"worker sent {message['event']!r}, expected {expected!r}", self.report)
        return message

    def _death(self) -> tuple[str, str]:
        code = self._process.wait()
        self._stderr.seek(0)
        tail = " | ".join(self._stderr.read().strip().splitlines()[-3:])
        if code == -signal.SIGKILL:
            return "killed", "SIGKILL, most likely the kernel's OOM killer"
        return "crashed", f"exit code {code}: {tail[-300:]}"

    def _send(self, command: str) -> None:
        try:
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            raise CaseFailed(*self._death(), self.report) from None

    def ready(self) -> dict:
        return self._receive("ready")

    def step(self) -> None:
        self._send("step")
        self.step_seconds.append(self._receive("stepped")["seconds"])

    def finish(self) -> dict:
        self._send("finish")
        self._receive("done")
        self._process.wait()
        return self.report

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._stderr.close()
