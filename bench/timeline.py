"""The backend's in-flight count over a run, polled from the simulator's GET /stats: where a run's time
goes that is not serving rollouts (before the first request, ramping up, the tail under full load).

`Timeline(url, full)` polls 20 times a second while it is entered; `line()` says, from its start (the
command's start): the first request, when in-flight first reached `full`, the mean in flight between
then and the last time it was at `full`, and the tail after that to the last completion.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

POLL_S = 0.05


class Timeline:
    def __init__(self, url: str, full: int) -> None:
        self.url, self.full = url.rstrip("/") + "/stats", full
        self.points: list[tuple[float, int, int]] = []  # (seconds from start, completed, in flight)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with urllib.request.urlopen(self.url, timeout=2) as resp:
                stats = json.load(resp)
            self.points.append((time.perf_counter() - self.t0, stats["completed"], stats["in_flight"]))
            self._stop.wait(POLL_S)

    def __enter__(self) -> Timeline:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def line(self) -> str:
        pts = self.points
        done0 = pts[0][1]
        busy = [p for p in pts if p[2] > 0 or p[1] > done0]
        if not busy:
            return "no requests seen"
        first = busy[0][0]
        at_full = [p for p in pts if p[2] >= self.full]
        last_done = next(p[0] for p in pts if p[1] == pts[-1][1])
        if not at_full:
            return (
                f"first request {first:.2f} s, never {self.full} in flight, last completion {last_done:.2f} s"
            )
        full_at, full_end = at_full[0][0], at_full[-1][0]
        middle = [p[2] for p in pts if full_at <= p[0] <= full_end]
        return (
            f"first request {first:.2f} s, {self.full} in flight at {full_at:.2f} s, mean in flight "
            f"{sum(middle) / len(middle):.1f} until {full_end:.2f} s, last completion {last_done:.2f} s "
            f"(tail {last_done - full_end:.2f} s)"
        )
