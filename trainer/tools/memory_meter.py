"""The memory a piece of work peaks at, on a GPU or a CPU (the probe's figures,
``trainer.tools.probe``): :class:`MemoryMeter`, one interface over CUDA's allocator
statistics and the process's resident set, and the glibc heap helpers that keep freed
tensors from counting on the CPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class RssSampler:
    """Peak resident set of this process, sampled every ``interval`` seconds by a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        return self.process.memory_info().rss

    def __enter__(self) -> "RssSampler":
        self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is None:
            raise RuntimeError("RssSampler exited without being entered")
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def trim_heap() -> None:
    """Gives freed C heap back to the OS (glibc), so an earlier trial's pages do not count."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pin_mmap_threshold() -> None:
    """Large blocks always from mmap, returned to the OS when freed (glibc). By default
    glibc raises its mmap threshold to the size of each mmapped block it frees, so later
    tensors of that size come from the heap and their freed pages stay resident: the
    high-water mark then depends on how often that happened (it varied from run to run
    of one step), not only on what the step holds."""
    try:
        import ctypes

        m_mmap_threshold = -3  # glibc's malloc.h
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 128 * 1024)
    except (OSError, AttributeError):
        pass


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def kernel_peak_available() -> bool:
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


class MemoryMeter:
    """One interface over CUDA's allocator statistics and the CPU's resident set: the
    kernel's exact high-water mark (VmHWM, reset through /proc/self/clear_refs) on Linux,
    else RSS sampled by a thread (which can miss a short peak)."""

    def __init__(self, device) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.kernel_peak = not self.cuda and kernel_peak_available()
        if not self.cuda:
            pin_mmap_threshold()
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated (absolute, model states included)"
        elif self.kernel_peak:
            self.method = ("process RSS high-water mark (VmHWM, reset after malloc_trim; mmap threshold pinned) "
                           "(peak above the pre-step baseline; absolute peak against --memory-limit-gib)")
        else:
            self.method = ("process RSS sampled every 2 ms by a psutil thread after malloc_trim (peak above the "
                           "pre-step baseline; absolute peak against --memory-limit-gib)")

    def measure(self, work: Callable[[], None]) -> dict:
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            work()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            return {"baseline_bytes": baseline, "peak_bytes": peak, "peak_above_baseline_bytes": peak - baseline}
        trim_heap()
        if self.kernel_peak:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # VmHWM := the resident set now
            baseline = status_bytes("VmRSS")
            work()
            peak = status_bytes("VmHWM")
            return {"baseline_bytes": baseline, "peak_bytes": peak, "peak_above_baseline_bytes": peak - baseline}
        with RssSampler() as sampler:
            baseline = sampler.peak
            work()
        return {"baseline_bytes": baseline, "peak_bytes": sampler.peak,
                "peak_above_baseline_bytes": sampler.peak - baseline}
