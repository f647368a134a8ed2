"""Settling (--settle-after M): a task whose first M rollouts all share one outcome gets no more.

Outcomes are read at the run's correct threshold, the one the reward statistics use. The decision reads
only committed or saved rewards, so a resumed chunk decides every task the way its first attempt did,
and which rollouts exist never depends on timing.

A task with a failed rollout among its first M is *pending*: it is neither settled nor given the rest,
so a failure can never change which rollouts a task gets. Its later rollouts stay missing (the audit
says so) until a retry or a resumed run answers its first M and the task is decided.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest
from rollflow.tasks.storage.rowjson import RolloutKey

SETTLED, OPEN, PENDING = "settled", "open", "pending"
SETTLED_AFTER = "settled_after"  # the `_rf` field of a settled task's rows, and the tasks file's


def settle_rule_text(after: int, repeats: int, threshold: float | None) -> str:
    """The rule in one sentence, for the report, the card and the CLI (`threshold` None: the collection's,
    which a rescoring does not know)."""
    at = "by the collection's verifier" if threshold is None else f"correct at reward >= {threshold:g}"
    return (
        f"each task first got {after} rollouts; a task whose {after} were all correct or all wrong "
        f"({at}) was settled and got no more, the others got {'up to' if threshold is None else 'all'} "
        f"{repeats}"
    )


def first_rollouts(collection: Any) -> int:
    """How many rollouts every task gets before any decision: M with settling, else all of them."""
    after = getattr(collection, "settle_after", None)
    return after if after is not None else collection.num_repeats


def line_reward(line: bytes) -> float | None:
    """The reward of one output line (None when it has none a statistic would count)."""
    reward = rowjson.loads(line).get("reward")
    return float(reward) if rowjson.is_reward(reward) else None


@dataclass
class TaskOutcomes:
    """Per task of a chunk: how many of its committed rollouts are correct, and how many have a reward."""

    threshold: float
    correct: dict[int, int] = field(default_factory=dict)
    rewarded: dict[int, int] = field(default_factory=dict)

    def add(self, task: int, reward: float | None) -> None:
        if reward is None:
            return
        self.rewarded[task] = self.rewarded.get(task, 0) + 1
        self.correct[task] = self.correct.get(task, 0) + int(reward >= self.threshold)

    def mixed(self) -> int:
        """Tasks with both correct and wrong rollouts: the learnable ones."""
        return sum(1 for t, n in self.rewarded.items() if 0 < self.correct.get(t, 0) < n)


def reward_at(
    key: RolloutKey, results: Mapping[RolloutKey, bytes], known: Mapping[RolloutKey, float] | None
) -> float | None:
    """A committed or saved rollout's reward: the one this attempt got, else read from its line."""
    if known is not None and key in known:
        return float(known[key])
    line = results.get(key)
    return None if line is None else line_reward(line)


def decide(
    tasks: Iterable[int],
    results: Mapping[RolloutKey, bytes],
    after: int,
    threshold: float,
    known: Mapping[RolloutKey, float] | None = None,
) -> dict[int, str]:
    """Each task's decision from its first `after` rewards: settled, open (gets the rest) or pending.
    `known`: rewards already at hand by key, so those lines are not parsed again."""
    decisions: dict[int, str] = {}
    for task in tasks:
        outcomes: set[bool] = set()
        for r in range(after):
            reward = reward_at((task, r), results, known)
            if reward is None:
                decisions[task] = PENDING
                break
            outcomes.add(reward >= threshold)
        else:
            decisions[task] = SETTLED if len(outcomes) == 1 else OPEN
    return decisions


def chunk_outcomes(
    keys: Iterable[RolloutKey],
    results: Mapping[RolloutKey, bytes],
    threshold: float,
    known: Mapping[RolloutKey, float] | None = None,
) -> TaskOutcomes:
    """Correct and rewarded counts per task over the committed rows of a chunk."""
    outcomes = TaskOutcomes(threshold)
    for key in keys:
        if key in results:
            outcomes.add(key[0], reward_at(key, results, known))
    return outcomes


def mixed_tasks(manifest: ChunkManifest) -> int:
    """The learnable tasks a committed chunk holds (0 for a chunk committed without the count)."""
    return int(manifest.stats.get("mixed_tasks", 0))


@dataclass
class LearnableTarget:
    """--until-learnable N: enough once the committed chunks hold N tasks with mixed outcomes.

    `before` counts the chunks committed complete before this run started (a resumed run counts them).
    """

    target: int
    before: int = 0

    def reached(self, outcomes: Sequence[Any]) -> bool:
        return self.before + sum(mixed_tasks(o.manifest) for o in outcomes) >= self.target


def learnable_target(
    until: int | None, committed: Mapping[int, ChunkManifest], pending: Iterable[int]
) -> LearnableTarget | None:
    """The run's target, counting what is already committed complete (None without --until-learnable)."""
    if until is None:
        return None
    waiting = set(pending)
    before = sum(mixed_tasks(m) for i, m in committed.items() if i not in waiting)
    return LearnableTarget(until, before)


def settling_report(
    after: int, repeats: int, threshold: float | None, settled_tasks: int, unasked: int, rows: int
) -> dict[str, Any]:
    """report.json's `settling`: the rule, the tasks it settled and the rollouts it never requested."""
    full = rows + unasked
    return {
        "settle_after": after,
        "num_repeats": repeats,
        "correct_threshold": threshold,
        "rule": settle_rule_text(after, repeats, threshold),
        "settled_tasks": settled_tasks,
        "rollouts_not_requested": unasked,
        "rollouts_saved_share": round(unasked / full, 6) if full else None,
        "tasks_file": "each settled task's line in the tasks file carries settled_after",
    }


def settling_markdown(d: dict[str, Any]) -> str:
    """report.md's `## Settling` section."""
    saved = d["rollouts_saved_share"]
    return "\n".join(
        [
            "## Settling",
            "",
            f"Rule (--settle-after {d['settle_after']}): {d['rule']}.",
            "",
            f"{d['settled_tasks']:,} tasks settled after {d['settle_after']} rollouts; "
            f"{d['rollouts_not_requested']:,} rollouts were never requested"
            + (f" ({saved:.1%} of full sampling)" if saved is not None else "")
            + "; they are recorded as settled in the chunk manifests, never as missing. "
            "A task settled this way may still have been learnable: its outcome was read from "
            f"{d['settle_after']} rollouts, not {d['num_repeats']}.",
            "",
        ]
    )


def marked(line: bytes, after: int) -> bytes:
    """A settled task's row carrying `_rf.settled_after`, so the dataset itself says which tasks settled
    (reverify and any reader see it without the tasks file); unchanged when it already does."""
    row = rowjson.loads(line)
    rf = row.get("_rf")
    if not isinstance(rf, dict) or rf.get(SETTLED_AFTER) == after:
        return line
    rf[SETTLED_AFTER] = after
    return rowjson.dumps(row)
