"""When the command started: the report's wall time counts interpreter start-up and imports too."""

from __future__ import annotations

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
