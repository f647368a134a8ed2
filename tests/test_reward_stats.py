"""Reward statistics against a brute-force recount: one pass, merged chunks, grouping, and the outputs."""

from __future__ import annotations

import random
import statistics
from fractions import Fraction
from itertools import pairwise
from math import comb
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollflow.tasks.publish.rewards import (
    BIN_EDGES,
    RewardStats,
    TaskGrouper,
    TaskRewards,
    pass_ks,
    rewards_markdown,
    rewards_png,
    summary_line,
    unbiased_pass_at_k,
)

Table = list[list[float]]
QUICK = settings(max_examples=200, deadline=None)
BINARY = st.sampled_from([0.0, 1.0])
EDGES = st.sampled_from([-0.5, -0.0, 0.0, 0.1, 0.3, 0.7, 0.9, 1.0, 1.5])
FLOATS = st.floats(-0.5, 1.5, allow_nan=False)


@st.composite
def tables(draw: st.DrawFn) -> tuple[Table, int]:
    """A reward table (1..30 tasks of 1..repeats rollouts) and its repeats; whole-pass and whole-fail
    tasks are drawn on purpose, as floats alone would hardly ever give one."""
    repeats = draw(st.integers(1, 16))
    values = draw(st.sampled_from([BINARY, FLOATS, st.one_of(EDGES, FLOATS)]))
    sizes = st.integers(1, repeats)
    uniform = st.builds(lambda n, v: [v] * n, sizes, st.sampled_from([0.0, 1.0, -0.5, 1.5]))
    task = st.one_of(st.lists(values, min_size=1, max_size=repeats), uniform)
    return draw(st.lists(task, min_size=1, max_size=30)), repeats


def running_sum(rewards: list[float]) -> float:
    """Left to right, as the stream adds: task means binned at an edge must be the same floats."""
    total = 0.0
    for reward in rewards:
        total += reward
    return total


def brute_histogram(values: list[float]) -> dict[str, Any]:
    counts = [sum(lo <= v < hi for v in values) for lo, hi in pairwise(BIN_EDGES)]
    counts[-1] += sum(v == 1.0 for v in values)
    below, above = sum(v < 0 for v in values), sum(v > 1 for v in values)
    return {"bins": list(BIN_EDGES), "counts": counts, "below_0": below, "above_1": above}


def brute_pass_at_k(table: Table, threshold: float, max_k: int) -> dict[int, float]:
    """Exact: 1 - C(n-c, k) / C(n, k) in fractions, averaged over the tasks with all max_k rollouts."""
    out = {}
    for k in pass_ks(max_k):
        tasks = [(len(rs), sum(r >= threshold for r in rs)) for rs in table if len(rs) == max_k]
        if tasks:
            total = sum(1 - Fraction(comb(n - c, k), comb(n, k)) for n, c in tasks)
            out[k] = float(total / len(tasks))
    return out


def one_pass(table: Table, threshold: float, max_k: int, first_task: int = 0) -> RewardStats:
    """As the audit feeds it: every reward, then every task the grouper finishes."""
    stats = RewardStats(threshold=threshold, max_k=max_k)
    grouper = TaskGrouper(threshold)
    for index, rewards in enumerate(table, start=first_task):
        for reward in rewards:
            stats.add_reward(reward)
            if (done := grouper.add(index, reward)) is not None:
                stats.add_task(done)
    if (last := grouper.finish()) is not None:
        stats.add_task(last)
    return stats


def assert_close(got: Any, want: Any) -> None:
    """Equal, floats within rounding to 6 digits (a value at a rounding edge may flip by 1e-6)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_close(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1.1e-6)
    else:
        assert got == want


@QUICK
@given(tables(), st.sampled_from([1.0, 0.5]))
def test_one_pass_matches_brute_force(drawn: tuple[Table, int], threshold: float) -> None:
    table, repeats = drawn
    stats = one_pass(table, threshold, repeats)
    flat = [r for rs in table for r in rs]
    correct = [sum(r >= threshold for r in rs) for rs in table]
    assert stats.count == len(flat)
    assert stats.mean == pytest.approx(statistics.mean(flat), rel=1e-9, abs=1e-12)
    assert stats.std == pytest.approx(statistics.pstdev(flat), rel=1e-9, abs=1e-12)
    assert (stats.min_reward, stats.max_reward) == (min(flat), max(flat))
    d = stats.as_dict()
    assert d["histogram"] == brute_histogram(flat)
    assert d["task_mean_histogram"] == brute_histogram([running_sum(rs) / len(rs) for rs in table])
    assert d["tasks"] == len(table)
    assert d["all_correct"]["tasks"] == sum(c == len(rs) for c, rs in zip(correct, table, strict=True))
    assert d["none_correct"]["tasks"] == correct.count(0)
    assert d["mixed"]["tasks"] == sum(0 < c < len(rs) for c, rs in zip(correct, table, strict=True))
    assert stats.pass_at_k() == pytest.approx(brute_pass_at_k(table, threshold, repeats), rel=1e-9)


@QUICK
@given(tables(), st.randoms(use_true_random=False))
def test_merged_chunks_equal_one_pass(drawn: tuple[Table, int], rnd: random.Random) -> None:
    """Contiguous chunks (some empty), each its own stats, merged in a shuffled order."""
    table, repeats = drawn
    cuts = sorted(rnd.randint(0, len(table)) for _ in range(rnd.randint(0, 5)))
    bounds = [0, *cuts, len(table)]
    parts = [one_pass(table[a:b], 1.0, repeats, first_task=a) for a, b in pairwise(bounds)]
    rnd.shuffle(parts)
    merged = RewardStats(max_k=repeats)
    for part in parts:
        merged.merge(part)
    whole = one_pass(table, 1.0, repeats)
    assert_close(merged.as_dict(), whole.as_dict())
    assert merged.std == pytest.approx(whole.std, rel=1e-9, abs=1e-12)
    assert merged.pass_at_k() == pytest.approx(whole.pass_at_k(), rel=1e-12)


@QUICK
@given(tables(), st.integers(0, 1000), st.sampled_from([1.0, 0.5]))
def test_grouper_yields_exactly_the_tasks_fed(drawn: tuple[Table, int], first: int, threshold: float) -> None:
    table, _ = drawn
    grouper = TaskGrouper(threshold)
    got = [t for i, rs in enumerate(table, first) for r in rs if (t := grouper.add(i, r)) is not None]
    got.append(grouper.finish())
    want = [
        TaskRewards(
            i, len(rs), sum(r >= threshold for r in rs), running_sum(rs), running_sum([r * r for r in rs])
        )
        for i, rs in enumerate(table, first)
    ]
    assert got == want
    assert grouper.finish() is None


@QUICK
@given(tables())
def test_add_task_with_rewards_equals_row_by_row(drawn: tuple[Table, int]) -> None:
    table, repeats = drawn
    stats = RewardStats(max_k=repeats)
    for i, rs in enumerate(table):
        stats.add_task(TaskRewards(i, len(rs), sum(r >= 1.0 for r in rs), running_sum(rs)), rs)
    assert stats == one_pass(table, 1.0, repeats)


def test_one_task_of_four_with_one_correct() -> None:
    stats = RewardStats(max_k=4)
    stats.add_task(TaskRewards(0, 4, 1, 1.0), [0.0, 1.0, 0.0, 0.0])
    assert stats.pass_at_k() == {1: 0.25, 2: 0.5, 4: 1.0}
    assert stats.as_dict()["mixed"] == {"tasks": 1, "share": 1.0}


def test_pass_at_k_only_over_tasks_with_all_rollouts() -> None:
    stats = RewardStats(max_k=8)
    stats.add_task(TaskRewards(0, 2, 0, 0.0), [0.0, 0.0])
    stats.add_task(TaskRewards(1, 8, 8, 8.0), [1.0] * 8)
    stats.add_task(TaskRewards(2, 8, 0, 0.0), [0.0] * 8)
    assert stats.as_dict()["pass_at_k"] == {"1": 0.5, "2": 0.5, "4": 0.5, "8": 0.5}
    assert stats.as_dict()["pass_at_k_tasks"] == {"1": 2, "2": 2, "4": 2, "8": 2}
    assert unbiased_pass_at_k(16, 1, 16) == 1.0
    assert unbiased_pass_at_k(16, 0, 8) == 0.0
    with pytest.raises(ValueError):
        unbiased_pass_at_k(2, 1, 4)


def test_histogram_edges_and_empty_stats() -> None:
    stats = RewardStats()
    assert stats.as_dict()["std"] is None and stats.as_dict()["mean"] is None
    assert summary_line(stats.as_dict()) == "rewards: none recorded"
    for reward in [-0.1, 0.0, 0.1, 0.95, 1.0, 1.1]:
        stats.add_reward(reward)
    hist = stats.as_dict()["histogram"]
    assert (hist["below_0"], hist["above_1"]) == (1, 1)
    assert hist["counts"] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    with pytest.raises(ValueError):
        stats.add_reward(float("nan"))
    with pytest.raises(ValueError):
        stats.merge(RewardStats(threshold=0.5))


def test_task_line() -> None:
    line = TaskRewards(7, 4, 1, 2.0, 2.0).as_line()  # rewards 1, 1, 0, 0
    assert line.endswith(b"\n")
    assert orjson.loads(line) == {
        "task_index": 7, "rollouts": 4, "correct": 1, "mean_reward": 0.5, "std_reward": 0.5,
    }  # fmt: skip


def sample() -> dict[str, Any]:
    """Four tasks of four rollouts: one all correct, one none, two mixed."""
    table = [[1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.5]]
    return one_pass(table, 1.0, 4).as_dict()


def test_summary_line() -> None:
    line = summary_line(sample())
    assert line == (
        "rewards: mean 0.469 ± 0.48 over 16 rollouts; 4 tasks: 25% all correct, 25% none, "
        "50% mixed (learnable); pass@1 0.438, pass@4 0.75"
    )


def test_rewards_markdown_and_png() -> None:
    d = sample()
    md = rewards_markdown(d, image="rewards.png")
    assert md.startswith("## Rewards")
    for text in ["| all correct | 1 | 25% |", "| mixed | 2 | 50% |", "| 4 | 0.7500 |", "(rewards.png)"]:
        assert text in md
    assert "0.469" in md
    png = rewards_png(d)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
