"""verify: prove every expected (task, rollout) is present exactly once, valid, with a numeric reward."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

from rollflow.tasks.collect.routing import row_agent
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.publish.rewards import RewardStats, TaskGrouper
from rollflow.tasks.publish.row_stats import RowStory
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger

AUDIT_DIR = "audit"


@dataclass
class ChunkAudit:
    """What one committed chunk holds, checked line by line against its plan."""

    chunk: int
    sha256: str = ""
    expected: int = 0
    rows: int = 0
    unique: int = 0
    duplicates: int = 0
    invalid: int = 0
    out_of_order: int = 0
    missing_reward: int = 0
    failed: int = 0
    output_tokens: int = 0
    settled_tasks: int = 0  # --settle-after: tasks that settled after their first rollouts
    settled_rollouts: int = 0  # their rollouts never requested: not expected, never missing
    sha_matches: bool = True
    committed: bool = True
    data_lost: bool = False
    problems: list[str] = field(default_factory=list)
    rewards: dict[str, Any] = field(default_factory=dict)  # RewardStats.state() of its rewarded rows
    story: dict[str, Any] = field(default_factory=dict)  # RowStory.state(): tokens, finish reasons, params
    agents: dict[str, dict[str, float]] = field(default_factory=dict)  # agent -> AGENT_FIGURES

    @property
    def missing(self) -> int:
        return max(0, self.expected - self.unique)


AUDIT_FIELDS = {f.name for f in fields(ChunkAudit)}  # a cached audit of an older version may hold more
AGENT_FIGURES = ("rollouts", "rewarded", "reward_sum", "failed")  # per agent, summed over chunks


def _agent_add(agents: dict[str, dict[str, float]], name: str, **figures: float) -> None:
    into = agents.setdefault(name, dict.fromkeys(AGENT_FIGURES, 0))
    for key, value in figures.items():
        into[key] += value


def agent_rows(agents: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """report.json's `agents`: each agent's rollouts, failed rollouts and reward mean (NeMo Gym's per-agent
    view of a dataset that mixes agents)."""
    return {
        name: {
            "rollouts": int(f["rollouts"]),
            "failed": int(f["failed"]),
            "reward_mean": round(f["reward_sum"] / f["rewarded"], 6) if f["rewarded"] else None,
        }
        for name, f in sorted(agents.items())
    }


def tasks_path(chunk: int) -> str:
    """A chunk's per-task reward lines (tasks.jsonl is their concatenation in chunk order)."""
    return f"{AUDIT_DIR}/{chunk:05d}.tasks.jsonl"


def audit_chunk(
    ledger: Ledger, spec: ChunkSpec, manifest: ChunkManifest, num_repeats: int, threshold: float = 1.0
) -> ChunkAudit:
    """Stream one chunk object and check it against its plan and manifest; its reward statistics and
    per-task lines are computed on the same pass.

    The cached result is reused only while the object itself is unchanged (same manifest sha256 and the
    same size + mtime/ETag stamp as when it was audited) and was counted at the same correct threshold;
    anything else is read and hashed again.
    """
    cache_rel = f"{AUDIT_DIR}/{spec.index:05d}.json"
    store = ledger.store
    try:
        stamp = ledger.chunk_stamp(spec.index)
    except FileNotFoundError:
        return _lost_data(spec, manifest, num_repeats)
    if store.exists(cache_rel) and store.exists(tasks_path(spec.index)):
        cached = orjson.loads(store.read_bytes(cache_rel))
        same = cached.get("rewards", {}).get("threshold") == threshold and "agents" in cached
        if cached.pop("stamp", None) == stamp and cached.get("sha256") == manifest.sha256 and same:
            return ChunkAudit(**{k: v for k, v in cached.items() if k in AUDIT_FIELDS})
    unasked = sum(num_repeats - n for n in manifest.settled.values())
    check = _LineCheck(
        ChunkAudit(
            chunk=spec.index,
            expected=spec.good_rows * num_repeats - unasked,
            failed=manifest.failed,
            settled_tasks=len(manifest.settled),
            settled_rollouts=unasked,
        ),
        range(spec.first_task, spec.first_task + spec.num_tasks),
        num_repeats,
        RewardStats(threshold=threshold, max_k=num_repeats),
        TaskGrouper(threshold),
        settled=manifest.settled,
    )
    digest = hashlib.sha256()
    with ledger.open_chunk(spec.index) as fh:
        for lineno, line in enumerate(fh, start=1):
            digest.update(line)
            check.line(lineno, line)
    check.task_done(check.grouper.finish())
    audit = check.audit
    _count_failures_by_agent(ledger, spec.index, audit.agents)
    audit.rewards = check.stats.state()
    audit.story = check.story.state()
    audit.unique = len(check.seen)
    audit.sha256 = digest.hexdigest()
    audit.sha_matches = audit.sha256 == manifest.sha256
    if not audit.sha_matches:
        audit.problems.append(
            "its data object does not match its manifest's sha256 (changed after commit): the commit was "
            "withdrawn, so the next run of the same command collects this chunk again"
        )
    del audit.problems[20:]
    if audit.sha_matches:
        store.write_bytes(tasks_path(spec.index), b"".join(check.task_lines))
        store.write_bytes(cache_rel, orjson.dumps({**asdict(audit), "stamp": stamp}))
    return audit


def _count_failures_by_agent(ledger: Ledger, chunk: int, agents: dict[str, dict[str, float]]) -> None:
    """Each failure record's agent (the row it failed for names it), beside the agents' rollouts."""
    path = ledger.failures_path(chunk)
    if not ledger.store.exists(path):
        return
    for line in ledger.store.read_bytes(path).splitlines():
        if line.strip():
            record = rowjson.read_row(line)
            name = row_agent(record.get("row") if isinstance(record.get("row"), dict) else record)
            if name is not None:
                _agent_add(agents, name, failed=1)


def _lost_data(spec: ChunkSpec, manifest: ChunkManifest, num_repeats: int) -> ChunkAudit:
    """A manifest whose data object is gone vouches for nothing: the chunk counts as never committed."""
    return ChunkAudit(
        chunk=spec.index,
        expected=spec.good_rows * num_repeats,
        failed=manifest.failed,
        committed=False,
        data_lost=True,
        problems=[
            "its data object is gone while its manifest remains: the commit was withdrawn, so the next "
            "run of the same command collects this chunk again"
        ],
    )


@dataclass
class _LineCheck:
    """One output row at a time: valid, inside the chunk, once, in order, rewarded; counted in `audit`."""

    audit: ChunkAudit
    tasks: range
    num_repeats: int
    stats: RewardStats
    grouper: TaskGrouper
    settled: dict[int, int] = field(default_factory=dict)  # task -> rollouts it got before it settled
    seen: set[tuple[int, int]] = field(default_factory=set)
    last: tuple[int, int] = (-1, -1)
    task_lines: list[bytes] = field(default_factory=list)  # one short line per task of this chunk
    story: RowStory = field(default_factory=RowStory)

    def task_done(self, task: Any) -> None:
        if task is None:
            return
        after = self.settled.get(task.index)
        if after is not None and (0 < task.correct < task.rollouts or task.rollouts != after):
            self.audit.invalid += 1
            self.audit.problems.append(
                f"task {task.index} is recorded as settled after {after} rollouts, but holds {task.rollouts} "
                f"with {task.correct} correct: the settle rule does not give that"
            )
            after = None
        self.stats.add_task(task, settled=after is not None)
        self.task_lines.append(task.as_line() if after is None else task.as_line(settled_after=after))

    def line(self, lineno: int, line: bytes) -> None:
        audit = self.audit
        audit.rows += 1
        try:
            row, key = rowjson.read_keyed(line)
        except rowjson.RowError as exc:
            audit.invalid += 1
            audit.problems.append(f"line {lineno}: not a valid output row ({exc.problem})")
            return
        if key[0] not in self.tasks or not 0 <= key[1] < self.settled.get(key[0], self.num_repeats):
            audit.invalid += 1
            audit.problems.append(f"line {lineno}: (task, rollout) {key} is outside this chunk")
            return
        if key in self.seen:
            audit.duplicates += 1
            return
        self.seen.add(key)
        audit.out_of_order += int(key < self.last)
        self.last = key
        reward = row.get("reward")
        agent = row_agent(row)
        if agent is not None:
            rewarded = rowjson.is_reward(reward)
            _agent_add(
                self.audit.agents,
                agent,
                rollouts=1,
                rewarded=int(rewarded),
                reward_sum=reward if rewarded else 0,
            )
        if rowjson.is_reward(reward):
            self.stats.add_reward(float(reward))
            self.task_done(self.grouper.add(key[0], float(reward)))
        else:
            audit.missing_reward += 1
        self.story.add(row)
        response = row.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict) and rowjson.is_reward(usage.get("output_tokens")):
            audit.output_tokens += int(usage["output_tokens"])


@dataclass
class AuditSummary:
    """The whole run's verdict: publishable only when nothing is missing, doubled or invalid."""

    rows_expected: int = 0
    rows_written: int = 0
    failed: int = 0
    duplicates: int = 0
    missing: int = 0
    invalid: int = 0
    out_of_order: int = 0
    missing_reward: int = 0
    output_tokens: int = 0
    settled_tasks: int = 0
    settled_rollouts: int = 0  # never requested under --settle-after: not in rows_expected, never missing
    chunks_total: int = 0
    chunks_committed: int = 0
    sha_mismatches: int = 0
    uncommitted_chunks: list[int] = field(default_factory=list)
    changed_chunks: list[int] = field(default_factory=list)
    lost_chunks: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rewards: RewardStats | None = None
    story: RowStory = field(default_factory=RowStory)
    agents: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        flaws = self.missing or self.duplicates or self.invalid or self.out_of_order
        return not (flaws or self.missing_reward or self.sha_mismatches) and (
            self.chunks_committed == self.chunks_total
        )

    @property
    def reward_mean(self) -> float | None:
        """The mean of the rewards the statistics counted: each (task, rollout) once, duplicates not."""
        return self.rewards.mean if self.rewards is not None and self.rewards.count else None

    def add(self, audit: ChunkAudit) -> None:
        """Count one chunk; a withdrawn one (its bytes changed after commit) counts wholly as missing, so
        none of its rows or rewards reach the figures of a dataset it is no longer part of."""
        self.rows_expected += audit.expected
        self.failed += audit.failed
        self.chunks_committed += int(audit.committed and audit.sha_matches)
        self.problems.extend(f"chunk {audit.chunk}: {p}" for p in audit.problems[:5])
        if audit.data_lost:
            self.lost_chunks.append(audit.chunk)
        if not audit.sha_matches:
            self.sha_mismatches += 1
            self.changed_chunks.append(audit.chunk)
        if not (audit.committed and audit.sha_matches):
            self.uncommitted_chunks.append(audit.chunk)
            self.missing += audit.expected
            return
        self.rows_written += audit.rows
        self.duplicates += audit.duplicates
        self.missing += audit.missing
        self.invalid += audit.invalid
        self.out_of_order += audit.out_of_order
        self.missing_reward += audit.missing_reward
        self.output_tokens += audit.output_tokens
        self.settled_tasks += audit.settled_tasks
        self.settled_rollouts += audit.settled_rollouts
        for name, figures in audit.agents.items():
            _agent_add(self.agents, name, **figures)
        if audit.story:
            self.story.merge(RowStory.from_state(audit.story))
        if audit.rewards:
            stats = RewardStats.from_state(audit.rewards)
            if self.rewards is None:
                self.rewards = stats
            else:
                self.rewards.merge(stats)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rewards"] = self.rewards.as_dict() if self.rewards is not None else None
        out["story"] = self.story.as_dict()
        out["agents"] = agent_rows(self.agents)
        out["ok"] = self.ok
        out["reward_mean"] = self.reward_mean
        return out


def audit_run(
    ledger: Ledger,
    chunks: list[ChunkSpec],
    num_repeats: int,
    manifests: dict[int, ChunkManifest],
    threshold: float = 1.0,
) -> AuditSummary:
    """Audit every planned chunk; one that never committed counts wholly as missing.

    A chunk whose object no longer matches its manifest, or is gone, loses its commit here, so resuming
    collects it again instead of trusting (or forever refusing) bytes nobody vouches for.
    """
    summary = AuditSummary(chunks_total=len(chunks))
    for spec in chunks:
        manifest = manifests.get(spec.index)
        if manifest is None:
            summary.add(ChunkAudit(chunk=spec.index, expected=spec.good_rows * num_repeats, committed=False))
            continue
        audit = audit_chunk(ledger, spec, manifest, num_repeats, threshold)
        if not audit.sha_matches or audit.data_lost:
            ledger.uncommit(spec.index)
        summary.add(audit)
    return summary
