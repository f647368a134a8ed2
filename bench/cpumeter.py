"""CPU seconds and peak memory of the processes a bench selects, sampled while its run goes: engines and
pools end their processes with the run, and processes that are not this one's waited-for children are
missed by RUSAGE_CHILDREN."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import psutil


class CpuMeter:
    """CPU seconds of the processes `kind` selects, sampled while a run goes: Ray ends a job's worker
    processes with the job, so a reading after the run would miss them."""

    def __init__(self, kind: Callable[[psutil.Process], str | None]) -> None:
        self.kind = kind
        self.first: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], tuple[str, float]] = {}
        self.rss: dict[tuple[int, float], tuple[str, int]] = {}  # each process's peak resident memory
        self.names: dict[tuple[int, float], str] = {}
        self.running = False  # processes first seen after the start count from 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _sample(self) -> None:
        for proc in psutil.process_iter():
            try:
                kind = self.kind(proc)
                if kind is None:
                    continue
                times = proc.cpu_times()
                key = (proc.pid, proc.create_time())
                rss = proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.first.setdefault(key, 0.0 if self.running else times.user + times.system)
            if key not in self.names:
                with contextlib.suppress(psutil.Error):
                    self.names[key] = f"{proc.pid} {' '.join(proc.cmdline())[:90]}"
            self.last[key] = (kind, times.user + times.system)
            self.rss[key] = (kind, max(rss, self.rss.get(key, (kind, 0))[1]))

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._sample()
        self.running = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def seconds(self, kind: str) -> float:
        return sum(cpu - self.first.get(key, 0.0) for key, (k, cpu) in self.last.items() if k == kind)

    def by_process(self, kind: str) -> list[tuple[str, float]]:
        """Each process's CPU seconds, largest first: where an engine's cost sits."""
        rows = [(self.names.get(key, str(key[0])), cpu - self.first.get(key, 0.0))
                for key, (k, cpu) in self.last.items() if k == kind]  # fmt: skip
        return sorted(rows, key=lambda row: -row[1])

    def peak_rss_mb(self, kind: str) -> float:
        """The processes' peaks summed, each at its own peak."""
        return sum(rss for k, rss in self.rss.values() if k == kind) / 2**20
