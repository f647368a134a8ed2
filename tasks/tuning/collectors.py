"""How many collector processes a local run uses: more than one only when the client is the limit.

One event loop collects at most what one core parses. When, at the level the tuner chose, the collecting
process used nearly a core (`CLIENT_BOUND`) while the machine had whole cores idle, the backend still had
room the client could not use: the collect stage then runs a collector process per such core (a local
Dask cluster's workers, under the run's one share book, exactly once). The busy cores come from
/proc/stat over the same step, or under a container's CPU quota from its cgroup, whose quota then counts
as its cores (None elsewhere: then one collector, and why).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

CLIENT_BOUND = 0.85  # of a core: the collecting process is the limit
SPARE_CORE = 0.75  # the least idle CPU worth another collector: most of a core
MAX_COLLECTORS = 64


CGROUP = "/sys/fs/cgroup"  # cgroup v2: a container's CPU quota (cpu.max) and what it used (cpu.stat)


def cpu_quota() -> float | None:
    """The cores a CPU quota allows this process's cgroup (None: no quota, or no cgroup v2 to say)."""
    try:
        with open(f"{CGROUP}/cpu.max", "rb") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == b"max" else int(quota) / int(period)


def machine_busy_s() -> float | None:
    """CPU seconds the cores this process may use have spent busy so far: under a quota, its cgroup's;
    else every core's since boot (/proc/stat). None where neither says (not Linux)."""
    if cpu_quota() is not None:
        try:
            with open(f"{CGROUP}/cpu.stat", "rb") as f:
                usage = next(line.split()[1] for line in f if line.startswith(b"usage_usec "))
            return int(usage) / 1e6
        except (OSError, StopIteration, ValueError):
            return None
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
    """The cores this process may run on: its affinity, and no more than a CPU quota allows."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


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
    """From the tuner's readings at its chosen level (`client_cores`, `busy_cores` over their wall time)."""
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
