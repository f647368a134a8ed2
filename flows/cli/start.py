"""When the command started: the report's wall time counts interpreter start-up and imports too."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path


def process_start() -> float:
    """When this process started (epoch seconds), read from /proc so interpreter start-up counts too."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()


_USUAL_GC = gc.get_threshold()


def collect_rarely() -> None:
    """While the command imports, run the cyclic GC rarely: Prefect's import alone builds hundreds of
    thousands of objects that live to the end, and scanning them again and again is ~15% of start-up CPU."""
    gc.set_threshold(100_000, 50, 100)


def settle() -> None:
    """Imports done: freeze what they built (never scanned again) and collect as usual from here on."""
    gc.freeze()
    gc.set_threshold(*_USUAL_GC)
