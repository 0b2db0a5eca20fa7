"""Peak memory of one run, in a process that may hold several (experiments train variant after variant).

    meter = RunMemory(device)      # at the run's start: the high-water marks are reset here
    ...                            # the run
    meter.report()                 # {"peak_rss_bytes", "rss_growth_bytes", "peak_rss_scope", ...}

A process's own peak (ru_maxrss, torch.cuda.max_memory_allocated) is the largest of every run it
held, so a small variant trained after a large one would report the large one's figure. Linux keeps
the resident-set high-water mark (VmHWM, which ru_maxrss reads) per process, and writing "5" to
/proc/self/clear_refs sets it back to the current RSS: the mark read at the end is then this run's
peak, and its growth over the RSS it started from is what the run itself added (earlier runs'
garbage is collected and the allocator's free pages returned first, so that start is what is live).
Where the mark cannot be reset (not Linux, no permission) the figure is the process's peak since it
started, and the report says so: `peak_rss_scope` "process" instead of "run". CUDA: the allocator's
peak is reset per device.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from typing import Any

import torch

RESET_SLACK = 4 << 20
"""Right after a reset the mark equals the current RSS; a mark still further above it than this
means the kernel took the write but kept the mark (then the figure is the process's)."""

_marks: list[int] = []
"""VmHWM just before each reset in this process: the peaks a later reset would otherwise erase
(an outer meter, and the process's own peak, still count them)."""


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes, from /proc/self/status ({} where there is none)."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024          # the kernel writes kB
    return out


def _rusage_peak() -> int:
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024   # bytes on macOS, KiB on Linux


def process_peak_rss_bytes() -> int:
    """The process's peak RSS since it started, across any runs' resets of the mark."""
    return max([_status().get("VmHWM") or _rusage_peak(), *_marks])


def release_free_memory() -> None:
    """Collect unreachable objects and hand the C allocator's free pages back to the system (glibc's
    malloc_trim), so the RSS a run starts from is what is live, not what earlier runs freed: glibc
    keeps freed heap pages resident, and a later, smaller run would otherwise start (and peak) there."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):     # not glibc: nothing to trim
        pass


def reset_rss_peak() -> int | None:
    """Set this process's RSS high-water mark back to its current RSS (Linux). Returns how many
    resets this process has made so far (the marks erased from then on belong to the caller's run),
    or None where the mark cannot be reset."""
    before = _status().get("VmHWM")
    if before is None:
        return None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    _marks.append(before)   # the write may have erased it even where the reset is not trusted below
    now = _status()
    if now.get("VmHWM", before) - now.get("VmRSS", 0) > RESET_SLACK:
        return None
    return len(_marks)


class RunMemory:
    """This run's peak memory: RSS (every device), and the CUDA allocator's on a CUDA device."""

    def __init__(self, device: torch.device | None = None):
        release_free_memory()
        self.epoch = reset_rss_peak()
        status = _status()
        self.baseline = status.get("VmRSS")
        self.start_peak = status.get("VmHWM") or _rusage_peak()
        self.cuda = device if device is not None and device.type == "cuda" else None
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
            self.device_baseline = int(torch.cuda.memory_allocated(self.cuda))

    def report(self) -> dict[str, Any]:
        """peak_rss_bytes: this run's peak RSS (scope "run"), or the process's (scope "process");
        rss_growth_bytes: that peak less the RSS the run started from (None where the process's peak
        may predate the run); peak_device_memory_bytes / device_memory_growth_bytes: the same for the
        CUDA allocator (None off CUDA)."""
        status = _status()
        if self.epoch is not None:
            peak = max([status["VmHWM"], *_marks[self.epoch:]])      # later (nested) resets' marks too
        else:
            peak = process_peak_rss_bytes()
        # without a reset the growth is known only when the run raised the process's mark
        known = self.baseline is not None and (self.epoch is not None or peak > self.start_peak)
        out: dict[str, Any] = {"peak_rss_bytes": peak, "rss_growth_bytes": peak - self.baseline if known else None,
                               "peak_rss_scope": "run" if self.epoch is not None else "process",
                               "peak_device_memory_bytes": None, "device_memory_growth_bytes": None}
        if self.cuda is not None:
            dev_peak = int(torch.cuda.max_memory_allocated(self.cuda))
            out.update(peak_device_memory_bytes=dev_peak, device_memory_growth_bytes=dev_peak - self.device_baseline)
        return out
