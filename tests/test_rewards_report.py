"""Reward statistics of a real run over HTTP: report.json, report.md, rewards.png, tasks.jsonl and the CLI
line agree with a brute-force computation over the published dataset."""

from __future__ import annotations

from fractions import Fraction
from math import comb
from pathlib import Path
from statistics import pstdev

import orjson
import pytest
from rollout_data import write_rows

from rollflow.infra.local import spawn_simulator

ROWS, REPEATS = 300, 4


def brute_force(dataset: Path, threshold: float) -> tuple[dict[int, list[float]], dict[str, float]]:
    by_task: dict[int, list[float]] = {}
    for line in dataset.read_bytes().splitlines():
        row = orjson.loads(line)
        by_task.setdefault(row["_ng_task_index"], []).append(row["reward"])
    passes = {}
    for k in (1, 2, 4):
        values = [
            1 - Fraction(comb(len(r) - sum(x >= threshold for x in r), k), comb(len(r), k))
            for r in by_task.values()
            if len(r) >= k
        ]
        passes[str(k)] = float(sum(values) / len(values))
    return by_task, passes


def test_reward_statistics_match_the_dataset(run_cli, tmp_path) -> None:
    sim = spawn_simulator("--latency-ms", "2", "--slots", "64", "--correct-rate", "0.5")
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    args = [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", sim.url,
        "--num-repeats", str(REPEATS), "--parallelism", "32", "--chunk-size", "70", "--no-progress",
    ]  # fmt: skip
    try:
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
        report = orjson.loads((out / "report.json").read_bytes())
        rewards = report["rewards"]
        by_task, passes = brute_force(out / "rollouts.jsonl", 1.0)
        assert rewards["rollouts"] == ROWS * REPEATS and rewards["tasks"] == ROWS
        assert rewards["pass_at_k"] == pytest.approx(passes, rel=1e-6)
        correct = {t: sum(x >= 1.0 for x in r) for t, r in by_task.items()}
        all_ok = sum(c == REPEATS for c in correct.values())
        none_ok = sum(c == 0 for c in correct.values())
        assert rewards["all_correct"]["tasks"] == all_ok and rewards["none_correct"]["tasks"] == none_ok
        assert rewards["mixed"]["tasks"] == ROWS - all_ok - none_ok > 0
        tasks = [orjson.loads(line) for line in (out / "rollouts.tasks.jsonl").read_bytes().splitlines()]
        assert [t["task_index"] for t in tasks] == list(range(ROWS))
        assert all(t["rollouts"] == REPEATS and t["correct"] == correct[t["task_index"]] for t in tasks)
        assert all(t["mean_reward"] == pytest.approx(sum(by_task[t["task_index"]]) / REPEATS) for t in tasks)
        assert all(
            t["std_reward"] == pytest.approx(pstdev(by_task[t["task_index"]]), abs=1e-9) for t in tasks
        )
        assert (out / "rewards.png").read_bytes()[:4] == b"\x89PNG"
        md = (out / "report.md").read_text()
        assert "## Rewards" in md and "rewards.png" in md
        assert f"{ROWS * REPEATS:,} rollouts" in res.stderr and "mixed" in res.stderr
        # a second run of the same command reuses the cached audits: the same statistics
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
        assert orjson.loads((out / "report.json").read_bytes())["rewards"] == rewards
        # another threshold counts again (the cache holds the threshold it counted at)
        res = run_cli(*args, "--correct-threshold", "0.5")
        assert res.returncode == 0, res.stderr
        again = orjson.loads((out / "report.json").read_bytes())["rewards"]
        assert again["correct_threshold"] == 0.5 and again["pass_at_k"] == rewards["pass_at_k"]
    finally:
        sim.stop()
