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
SPARE_CORE = 0.75  # an idle core: one at least this idle takes another collector
MAX_COLLECTORS = 64


CGROUP = "/sys/fs/cgroup"  # v2: cpu.max and cpu.stat; v1: cpu/cpu.cfs_quota_us and cpuacct/cpuacct.usage


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def cpu_quota() -> float | None:
    """The cores a CPU quota allows this process's cgroup (cgroup v2 or v1); None without one."""
    try:
        if (v2 := _read(f"{CGROUP}/cpu.max")) is not None:
            quota, period = v2.split()[:2]
            return None if quota == b"max" else int(quota) / int(period)
        v1, period = _read(f"{CGROUP}/cpu/cpu.cfs_quota_us"), _read(f"{CGROUP}/cpu/cpu.cfs_period_us")
        if v1 is None or period is None or int(v1) <= 0:
            return None
        return int(v1) / int(period)
    except ValueError:
        return None  # a file not in the kernel's form says nothing


def _cgroup_busy_s() -> float | None:
    """The CPU seconds this process's cgroup has used (v2 cpu.stat, else v1 cpuacct.usage)."""
    try:
        if (v2 := _read(f"{CGROUP}/cpu.stat")) is not None:
            line = next(x for x in v2.splitlines() if x.startswith(b"usage_usec "))
            return int(line.split()[1]) / 1e6
        v1 = _read(f"{CGROUP}/cpuacct/cpuacct.usage")
        return None if v1 is None else int(v1) / 1e9
    except (StopIteration, ValueError):
        return None


def machine_busy_s() -> float | None:
    """CPU seconds the cores this process may use have spent busy so far: under a quota, its cgroup's;
    else every core's since boot (/proc/stat). None where neither says (not Linux)."""
    if cpu_quota() is not None:
        return _cgroup_busy_s()
    raw = _read("/proc/stat")
    if not raw or not raw.startswith(b"cpu "):
        return None
    mine = _affinity()
    lines = raw.splitlines()
    if mine is not None and len(mine) < (os.cpu_count() or 0):  # a cpuset: its own cores' lines only
        picked = [x for x in lines if x[3:4].isdigit() and int(x.split()[0][3:]) in mine]
    else:
        picked = lines[:1]  # the sum over every core
    busy = 0
    for line in picked:
        ticks = [int(x) for x in line.split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _affinity() -> set[int] | None:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:
        return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity, and no more than a CPU quota allows."""
    mine = _affinity()
    cores = len(mine) if mine is not None else os.cpu_count() or 1
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
        return Collectors(1, "auto: no tuning reading at or below the chosen level; --collectors N sets it")
    client, busy = best.get("client_cores"), best.get("busy_cores")
    if client is None or busy is None:
        return Collectors(1, "auto: the readings at the chosen level do not say how busy the cores were")
    idle = max(0.0, cores - busy)
    where = f"at parallelism {best.get('parallelism')}: the collecting process used {client:.2f} of a core"
    if client < CLIENT_BOUND:
        return Collectors(1, f"auto: {where}, so the client is not the limit", client, idle)
    extra = math.floor(idle + 1 - SPARE_CORE)  # a core at least SPARE_CORE idle takes one more
    if extra == 0:
        why = f"auto: {where}, but the machine had {idle:.2f} of {cores} cores idle: one collector"
        return Collectors(1, why, client, idle)
    count = min(MAX_COLLECTORS, cores, 1 + extra)
    why = f"auto: {where} and {idle:.2f} of {cores} cores were idle: {count} collector processes"
    return Collectors(count, why, client, idle)
