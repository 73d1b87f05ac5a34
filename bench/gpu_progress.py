"""The GPU check's clock and its progress lines (stdout, as they happen), and the checkout
it checks."""

from __future__ import annotations

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START = time.time()


def say(message: str) -> None:
    print(f"[gpu_check {time.time() - START:6.1f}s] {message}", flush=True)
