"""Reward statistics of a run, built chunk by chunk while the audit streams its rows, then merged.

Everything kept is a count, a sum or a fixed-bin histogram (plus Chan et al.'s mean and M2), so a
chunk's statistics take constant memory and any chunks' statistics merge, in any order, into the run's.
Pure Python: no I/O and no Prefect (Pillow is imported only when rewards.png is drawn).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollflow.tasks.collect.percentiles import shown_share

BINS = 10
BIN_EDGES: tuple[float, ...] = tuple(i / BINS for i in range(BINS + 1))
"""Fixed edges over [0, 1]: histograms of different chunks line up bin for bin, so they add."""


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass
class TaskRewards:
    """One task's rollouts reduced to what pass@k and the correct shares need."""

    index: int
    rollouts: int
    correct: int
    reward_sum: float
    squares: float = 0.0  # sum of squared rewards, for the per-task standard deviation

    @property
    def mean(self) -> float:
        return self.reward_sum / self.rollouts if self.rollouts else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation of the task's rewards."""
        mean = self.mean
        return math.sqrt(max(0.0, self.squares / self.rollouts - mean * mean)) if self.rollouts else 0.0

    def add(self, reward: float, threshold: float) -> None:
        """One more rollout of this task."""
        self.rollouts += 1
        self.correct += int(reward >= threshold)
        self.reward_sum += reward
        self.squares += reward * reward

    def as_line(self, **extra: Any) -> bytes:
        """One newline-terminated JSON line, for a per-task rewards file (reverify adds the old mean)."""
        row = {
            "task_index": self.index,
            "rollouts": self.rollouts,
            "correct": self.correct,
            "mean_reward": self.mean,
            "std_reward": round(self.std, 12),
            **extra,
        }
        return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


class TaskGrouper:
    """Rows ordered by (task, rollout) in, finished tasks out: one task in memory at a time.

    Any change of task index closes the open task, so rows must arrive grouped by task (the audit
    counts rows out of order itself, and its verdict is not ok then).
    """

    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold = threshold
        self._open: TaskRewards | None = None

    def add(self, task_index: int, reward: float) -> TaskRewards | None:
        """Count one rollout; return the previous task when this row starts a new one."""
        task = self._open
        if task is not None and task.index == task_index:
            task.add(reward, self.threshold)
            return None
        self._open = TaskRewards(task_index, 0, 0, 0.0)
        self._open.add(reward, self.threshold)
        return task

    def finish(self) -> TaskRewards | None:
        """The last task, once the rows are done (None when there were none)."""
        task, self._open = self._open, None
        return task


@dataclass
class Histogram:
    """Ten equal bins over [0, 1] (1.0 in the last) and the two tails, counted apart."""

    counts: list[int] = field(default_factory=lambda: [0] * BINS)
    below_0: int = 0
    above_1: int = 0

    def add(self, value: float) -> None:
        if value < 0:
            self.below_0 += 1
        elif value > 1:
            self.above_1 += 1
        else:
            self.counts[min(bisect.bisect_right(BIN_EDGES, value) - 1, BINS - 1)] += 1

    def merge(self, other: Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.below_0 += other.below_0
        self.above_1 += other.above_1

    def as_dict(self) -> dict[str, Any]:
        return {
            "bins": list(BIN_EDGES),
            "counts": list(self.counts),
            "below_0": self.below_0,
            "above_1": self.above_1,
        }


def pass_ks(max_k: int) -> list[int]:
    """The k of pass@k reported: 1, 2, 4, 8, ... up to max_k (the number of repeats)."""
    ks: list[int] = []
    k = 1
    while k <= max_k:
        ks.append(k)
        k *= 2
    return ks


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k), the ratio as a product so no binomial grows huge."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(k):
        miss *= (n - c - i) / (n - i)
    return 1.0 - miss


@dataclass
class RewardStats:
    """A chunk's (or, merged, a run's) reward statistics: per rollout and per task.

    The audit calls `add_reward` for every rewarded row and `add_task` for every task the
    `TaskGrouper` finishes; `add_task(t, rewards)` does both at once.
    """

    threshold: float = 1.0
    max_k: int = 1
    count: int = 0
    reward_sum: float = 0.0
    mean: float = 0.0
    m2: float = 0.0
    min_reward: float | None = None
    max_reward: float | None = None
    rewards: Histogram = field(default_factory=Histogram)
    tasks: int = 0
    all_correct: int = 0
    none_correct: int = 0
    mixed: int = 0
    task_means: Histogram = field(default_factory=Histogram)
    pass_sum: dict[int, float] = field(default_factory=dict)
    pass_tasks: dict[int, int] = field(default_factory=dict)
    settled: int = 0  # tasks settled after their first rollouts (--settle-after), among `tasks`
    settled_split: int = 0  # of them, tasks a rescoring split (a verifier other than the one that settled)

    def state(self) -> dict[str, Any]:
        """Everything, JSON-ready and exact (the audit cache keeps a chunk's stats between runs)."""
        out = dataclasses.asdict(self)
        out["pass_sum"] = {str(k): v for k, v in self.pass_sum.items()}
        out["pass_tasks"] = {str(k): v for k, v in self.pass_tasks.items()}
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RewardStats:
        fields = dict(state)
        fields["rewards"] = Histogram(**fields["rewards"])
        fields["task_means"] = Histogram(**fields["task_means"])
        fields["pass_sum"] = {int(k): v for k, v in fields["pass_sum"].items()}
        fields["pass_tasks"] = {int(k): v for k, v in fields["pass_tasks"].items()}
        return cls(**fields)

    def add_reward(self, reward: float) -> None:
        """One rollout's reward (Welford's update: stable however many rollouts)."""
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward!r} is not a finite number")
        self.count += 1
        self.reward_sum += reward
        delta = reward - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (reward - self.mean)
        self.min_reward = reward if self.min_reward is None else min(self.min_reward, reward)
        self.max_reward = reward if self.max_reward is None else max(self.max_reward, reward)
        self.rewards.add(reward)

    def add_task(
        self,
        task: TaskRewards,
        rewards: Iterable[float] | None = None,
        settled: bool = False,
        rescored: bool = False,
    ) -> None:
        """One finished task; with `rewards`, its rollouts' rewards too.

        A `settled` task (its first rollouts all correct or all wrong, so it got no more) counts in
        pass@k at its one outcome for every k: 1 when all were correct, 0 when none was (SETTLED_PASS_RULE).
        A `rescored` settled task whose new rewards split counts as mixed and stays out of pass@k: its few
        rollouts cannot estimate pass@k beyond their number, and more were never asked.
        """
        if not 0 <= task.correct <= task.rollouts or task.rollouts < 1:
            raise ValueError(f"task {task.index}: {task.correct} correct of {task.rollouts} rollouts")
        split = settled and 0 < task.correct < task.rollouts
        if split and not rescored:
            raise ValueError(f"task {task.index} is settled with mixed outcomes")
        for reward in rewards or ():
            self.add_reward(reward)
        self.tasks += 1
        self.task_means.add(task.mean)
        if task.correct == task.rollouts:
            self.all_correct += 1
        elif task.correct == 0:
            self.none_correct += 1
        else:
            self.mixed += 1
        self.settled += int(settled)
        self.settled_split += int(split)
        if split or (task.rollouts < self.max_k and not settled):  # short of max_k rollouts: out of every k
            return
        for k in pass_ks(self.max_k):
            value = float(task.correct > 0) if settled else unbiased_pass_at_k(task.rollouts, task.correct, k)
            self.pass_sum[k] = self.pass_sum.get(k, 0.0) + value
            self.pass_tasks[k] = self.pass_tasks.get(k, 0) + 1

    def merge(self, other: RewardStats) -> None:
        """Add another chunk's statistics into these (the order of merging does not matter)."""
        if (other.threshold, other.max_k) != (self.threshold, self.max_k):
            raise ValueError("only statistics with the same threshold and max_k merge")
        self._merge_moments(other)
        self.rewards.merge(other.rewards)
        self.task_means.merge(other.task_means)
        self.tasks += other.tasks
        self.all_correct += other.all_correct
        self.none_correct += other.none_correct
        self.mixed += other.mixed
        self.settled += other.settled
        self.settled_split += other.settled_split
        for k, value in other.pass_sum.items():
            self.pass_sum[k] = self.pass_sum.get(k, 0.0) + value
            self.pass_tasks[k] = self.pass_tasks.get(k, 0) + other.pass_tasks[k]

    def _merge_moments(self, other: RewardStats) -> None:
        """Chan et al.'s parallel update of count, mean and M2; min and max."""
        if other.count == 0:
            return
        total = self.count + other.count
        delta = other.mean - self.mean
        self.mean += delta * other.count / total
        self.m2 += other.m2 + delta * delta * self.count * other.count / total
        self.count = total
        self.reward_sum += other.reward_sum
        lows = [v for v in (self.min_reward, other.min_reward) if v is not None]
        highs = [v for v in (self.max_reward, other.max_reward) if v is not None]
        self.min_reward, self.max_reward = min(lows), max(highs)

    @property
    def std(self) -> float | None:
        """Population standard deviation of the rewards (None before any)."""
        return math.sqrt(max(self.m2, 0.0) / self.count) if self.count else None

    def pass_at_k(self) -> dict[int, float]:
        """Mean pass@k over the tasks with all `max_k` rollouts rewarded: one set of tasks for every k,
        so the figures compare (a task with failed rollouts would otherwise leave only the higher k)."""
        return {k: self.pass_sum[k] / n for k, n in sorted(self.pass_tasks.items())}

    def _share(self, tasks: int) -> dict[str, Any]:
        return {"tasks": tasks, "share": _round(tasks / self.tasks) if self.tasks else None}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, floats rounded to 6 digits (the fields themselves keep full precision)."""
        return {
            "rollouts": self.count,
            "mean": _round(self.mean) if self.count else None,
            "std": _round(self.std),
            "min": _round(self.min_reward),
            "max": _round(self.max_reward),
            "histogram": self.rewards.as_dict(),
            "tasks": self.tasks,
            "task_mean_histogram": self.task_means.as_dict(),
            "correct_threshold": self.threshold,
            "all_correct": self._share(self.all_correct),
            "none_correct": self._share(self.none_correct),
            "mixed": self._share(self.mixed),
            "pass_at_k": {str(k): round(v, 6) for k, v in self.pass_at_k().items()},
            "pass_at_k_tasks": {str(k): n for k, n in sorted(self.pass_tasks.items())},
            "settled": self._share(self.settled),
            **({"settled_split": self._share(self.settled_split)} if self.settled_split else {}),
            **({"settled_rule": SETTLED_PASS_RULE} if self.settled else {}),
        }


SETTLED_PASS_RULE = (
    "statistics are over the rollouts that exist; a settled task counts as all correct or none correct by "
    "its first rollouts, and in pass@k at that one outcome for every k (1 or 0)"
)


def _shares(d: dict[str, Any]) -> str:
    if not d["tasks"]:
        return "no tasks"
    return (
        f"{shown_share(d['all_correct']['share'])} all correct, {shown_share(d['none_correct']['share'])} "
        f"none, {shown_share(d['mixed']['share'])} mixed (learnable)"
    )


def summary_line(d: dict[str, Any]) -> str:
    """One line for the CLI: the mean, the task shares, the smallest and the largest pass@k."""
    if not d["rollouts"]:
        return "rewards: none recorded"
    parts = [f"rewards: mean {d['mean']:.3g} ± {d['std']:.2g} over {d['rollouts']:,} rollouts"]
    if d["tasks"]:
        parts.append(f"{d['tasks']:,} tasks: {_shares(d)}")
    ks = list(d["pass_at_k"])
    if ks:
        parts.append(", ".join(f"pass@{k} {d['pass_at_k'][k]:.3g}" for k in dict.fromkeys([ks[0], ks[-1]])))
    return "; ".join(parts)


def rewards_markdown(d: dict[str, Any], image: str | None = None) -> str:
    """The `## Rewards` section of report.md (`image`: rewards.png's file name or a data: URI)."""
    if not d["rollouts"]:
        return "## Rewards\n\nNo rewards recorded.\n"
    lines = [
        "## Rewards",
        "",
        f"Mean reward **{d['mean']:.3g}** ± {d['std']:.2g} (population std) over {d['rollouts']:,} "
        f"rollouts, min {d['min']:g}, max {d['max']:g}; a rollout is correct at reward >= "
        f"{d['correct_threshold']:g}.",
        "",
        "| tasks | count | share |",
        "|---|---:|---:|",
    ]
    for key, label in [("all_correct", "all correct"), ("none_correct", "none correct"), ("mixed", "mixed")]:
        share = d[key]["share"]
        lines.append(f"| {label} | {d[key]['tasks']:,} | {shown_share(share)} |")
    lines += [f"| **all** | {d['tasks']:,} | |", ""]
    settled = d.get("settled") or {}
    if settled.get("tasks"):
        lines += [
            f"{settled['tasks']:,} tasks ({shown_share(settled['share'])}) were settled after their first "
            f"rollouts (--settle-after): {d['settled_rule']}.",
            "",
        ]
    split = (d.get("settled_split") or {}).get("tasks") or 0
    if split:
        lines += [
            f"{split:,} of the settled tasks have split rewards now (this verifier disagrees with the one "
            "that settled them): they count as mixed, and are left out of pass@k, which their few "
            "rollouts cannot estimate.",
            "",
        ]
    if d["pass_at_k"]:
        behind = d.get("pass_at_k_tasks", {})
        lines += [
            f"pass@k (unbiased estimate) over {pass_at_k_tasks(d)}, the same tasks for every k:",
            "",
            "| k | pass@k | tasks |",
            "|---:|---:|---:|",
        ]
        lines += [f"| {k} | {v:.4f} | {behind.get(k, 0):,} |" for k, v in d["pass_at_k"].items()]
    if image:
        lines += ["", f"![per-task mean reward histogram]({image})"]
    return "\n".join([*lines, ""])


def pass_at_k_counted(d: dict[str, Any]) -> int:
    """The tasks pass@k is over (the same for every k)."""
    return max((d.get("pass_at_k_tasks") or {}).values(), default=0)


def pass_at_k_tasks(d: dict[str, Any]) -> str:
    """Which tasks pass@k is over, and why any were left out."""
    counted = pass_at_k_counted(d)
    split = (d.get("settled_split") or {}).get("tasks") or 0
    short = d["tasks"] - counted - split
    why = [f"{split:,} settled tasks now split"] if split else []
    if short > 0:
        why.append(f"{short:,} short of their rollouts (failed, or never collected)")
    return f"{counted:,} of {d['tasks']:,} tasks" + (f" (left out: {'; '.join(why)})" if why else "")


def rewards_png(d: dict[str, Any]) -> bytes:
    """Bars of the per-task mean reward histogram (the tails in grey), the task shares as title."""
    from rollflow.tasks.publish.barchart import GREY, PAPER, Bar, bar_chart

    hist = d["task_mean_histogram"]
    width = hist["bins"][1] - hist["bins"][0]
    bars = [
        Bar(x, width, count, edge=PAPER) for x, count in zip(hist["bins"][:-1], hist["counts"], strict=True)
    ]
    tails = [(-width, hist["below_0"], "below 0"), (1.0, hist["above_1"], "above 1")]
    bars += [Bar(x, width, count, GREY, label) for x, count, label in tails if count]
    return bar_chart(bars, f"rollflow rewards: {_shares(d)}", "mean reward of a task's rollouts", "tasks")
