"""The wall time of one command, split by pipeline stage, for the run report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STAGES = ("startup", "diagnose", "tune", "collect", "verify", "publish")


@dataclass
class StageClock:
    """Wall time of a command from its start (the CLI process start, or the flow's), split by stage.

    Each `mark` charges the time since the previous mark to a stage, so the stages add up to the time
    elapsed at the last mark: nothing between two stages goes uncounted.
    """

    start: float = field(default_factory=time.time)
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    last_mark: float | None = None
    flow_started: float | None = None  # when the flow body began: what came before is start-up outside it

    def mark(self, stage: str) -> None:
        now = time.time()
        last = self.start if self.last_mark is None else self.last_mark
        self.stages[stage] += max(0.0, now - last)
        self.last_mark = now

    def elapsed(self) -> float:
        return max(0.0, (self.last_mark or time.time()) - self.start)

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.stages.items()}
