"""How many collector processes a local run uses: more than one only when the client is the limit.

One event loop collects at most what one core parses. When, at the tuner's best step, the collecting
process used nearly a core (`CLIENT_BOUND`) while the machine had whole cores idle, the backend still had
room the client could not use: the collect stage then runs a collector process per such core (a local
Dask cluster's single-threaded workers, under the run's one share book, exactly once). The machine's
busy cores come from /proc/stat over the same step (None elsewhere: then one collector, and why).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

CLIENT_BOUND = 0.85  # of a core: the collecting process is the limit
SPARE_CORE = 0.75  # the least idle CPU worth another collector: most of a core
MAX_COLLECTORS = 64


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (Linux; None elsewhere)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Collectors:
    count: int
    why: str
    client_cores: float | None = None  # the collecting process's CPU at the step judged, in cores
    idle_cores: float | None = None  # the machine's idle cores then

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "why": self.why,
            **({} if self.client_cores is None else {"client_cores": round(self.client_cores, 2)}),
            **({} if self.idle_cores is None else {"idle_cores": round(self.idle_cores, 2)}),
        }


def asked_collectors(count: int) -> Collectors:
    return Collectors(count, f"--collectors {count}")


def auto_collectors(best: dict[str, Any] | None, cores: int) -> Collectors:
    """From the tuner's best step (its `client_cores` and `busy_cores` over its wall time)."""
    if best is None:
        return Collectors(1, "auto: no tuning step measured the client; give --collectors N to set it")
    client, busy = best.get("client_cores"), best.get("busy_cores")
    if client is None or busy is None:
        return Collectors(1, "auto: this platform does not say how busy its cores are; one collector")
    idle = max(0.0, cores - busy)
    where = f"at parallelism {best.get('parallelism')}: the collecting process used {client:.2f} of a core"
    if client < CLIENT_BOUND:
        return Collectors(1, f"auto: {where}, so the client is not the limit", client, idle)
    extra = math.floor(idle / max(client, SPARE_CORE))  # each more takes about what the one took
    if extra == 0:
        why = f"auto: {where}, but the machine had {idle:.2f} of {cores} cores idle: one collector"
        return Collectors(1, why, client, idle)
    count = min(MAX_COLLECTORS, cores, 1 + extra)
    why = f"auto: {where} and {idle:.2f} of {cores} cores were idle: {count} collector processes"
    return Collectors(count, why, client, idle)
