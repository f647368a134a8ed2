"""--seed: every request carries a seed derived from (base seed, task, rollout), over HTTP end to end.

The simulator answers a seeded request from its seed alone, as a seeded engine samples, so the same seed
gives the same rollout on every run and resume, and another seed another rollout.
"""

from __future__ import annotations

import signal
from pathlib import Path

import orjson
import pytest
from cli_runs import ROWS, run_args, spawn, wait_until
from rollout_data import write_rows

from rollflow.tasks.collect.seeds import rollout_seed


def rows_of(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def extra_seed(row: dict) -> object:
    return orjson.loads(row["responses_create_params"]["metadata"]["extra_body"])["seed"]


def answers(path: Path) -> list[str]:
    return [row["response"]["output"][0]["content"][0]["text"] for row in rows_of(path)]


@pytest.fixture(scope="module")
def seeded(run_cli, slow_sim, rows_input, tmp_path_factory) -> Path:
    """An uninterrupted run with --seed 7."""
    out = tmp_path_factory.mktemp("seeded") / "out"
    res = run_cli(*run_args(rows_input, str(out), slow_sim), "--seed", "7")
    assert res.returncode == 0, res.stderr
    return out


def test_the_same_seed_gives_the_same_dataset_and_another_seed_other_answers(
    run_cli, slow_sim, rows_input, reference, seeded, tmp_path
) -> None:
    first, second, other = seeded, tmp_path / "b", tmp_path / "c"
    for out, seed in ((second, "7"), (other, "8")):
        res = run_cli(*run_args(rows_input, str(out), slow_sim), "--seed", seed)
        assert res.returncode == 0, res.stderr
    data = (first / "rollouts.jsonl").read_bytes()
    assert data == (second / "rollouts.jsonl").read_bytes()
    rows = rows_of(first / "rollouts.jsonl")
    assert len(rows) == ROWS * 2
    seeds = [row["_rf"]["seed"] for row in rows]
    assert seeds == [rollout_seed(7, r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**31 for s in seeds)
    # the agent was sent the seed where NeMo Gym's agents take one (metadata.extra_body), and echoed it
    assert all(extra_seed(row) == row["_rf"]["seed"] for row in rows)
    assert all("seed" not in row["responses_create_params"] for row in rows)
    changed = sum(
        a != b
        for a, b in zip(answers(first / "rollouts.jsonl"), answers(other / "rollouts.jsonl"), strict=True)
    )
    assert changed > 0.9 * len(rows)
    unseeded = orjson.loads(reference.splitlines()[0])
    assert "seed" not in unseeded["_rf"] and "seed" not in unseeded["responses_create_params"]


def test_a_changed_seed_is_refused_without_restart(run_cli, slow_sim, tmp_path) -> None:
    inp, out = write_rows(tmp_path / "rows.jsonl", 60), str(tmp_path / "out")
    assert run_cli(*run_args(inp, out, slow_sim), "--seed", "1").returncode == 0
    res = run_cli(*run_args(inp, out, slow_sim), "--seed", "2")
    assert res.returncode != 0 and "seed 1 -> 2" in res.stderr, res.stderr
    res = run_cli(*run_args(inp, out, slow_sim), "--seed", "2", "--restart")
    assert res.returncode == 0, res.stderr
    assert {row["_rf"]["seed"] for row in rows_of(tmp_path / "out" / "rollouts.jsonl")} == {
        rollout_seed(2, t, r) for t in range(60) for r in range(2)
    }


def test_a_seed_in_the_row_or_the_overrides_wins(run_cli, slow_sim, tmp_path) -> None:
    inp = tmp_path / "rows.jsonl"
    with inp.open("wb") as fh:
        for i in range(40):
            params: dict = {"input": [{"role": "user", "content": f"What is {i} + 1?"}]}
            if i % 2:
                params["seed"] = 1000 + i
            fh.write(orjson.dumps({"responses_create_params": params, "expected_answer": str(i + 1)}) + b"\n")
    out = tmp_path / "out"
    res = run_cli(*run_args(inp, str(out), slow_sim), "--seed", "3", "--chunk-size", "10")
    assert res.returncode == 0, res.stderr
    rows = rows_of(out / "rollouts.jsonl")
    for row in rows:
        t, r = row["_ng_task_index"], row["_ng_rollout_index"]
        assert row["_rf"]["seed"] == (1000 + t if t % 2 else rollout_seed(3, t, r))
    by_task: dict[int, set[str]] = {}
    for row, text in zip(rows, answers(out / "rollouts.jsonl"), strict=True):
        by_task.setdefault(row["_ng_task_index"], set()).add(text)
    assert all(len(by_task[t]) == 1 for t in by_task if t % 2)  # one seed, one sample for both rollouts
    out2 = tmp_path / "out2"
    res = run_cli(*run_args(inp, str(out2), slow_sim), "--seed", "3", "--overrides", '{"seed": 5}')
    assert res.returncode == 0, res.stderr
    assert {row["_rf"]["seed"] for row in rows_of(out2 / "rollouts.jsonl")} == {5}


def test_a_rollout_redone_after_kill9_carries_the_same_seed(
    run_cli, cli_env, slow_sim, rows_input, seeded, tmp_path
):
    reference = seeded
    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), slow_sim), "--seed", "7", "--chunk-size", "2000"]
    env = {**cli_env, "ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S": "0.3"}

    def parts() -> list[Path]:
        return sorted((out / "parts").glob("*/*.jsonl")) if (out / "parts").exists() else []

    proc = spawn(args, env)
    wait_until(lambda: len(parts()) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    saved = {
        (row["_ng_task_index"], row["_ng_rollout_index"]): row["_rf"]["seed"]
        for part in parts()
        for row in map(orjson.loads, part.read_bytes().splitlines()[1:])  # after the run header
    }
    assert 0 < len(saved) < ROWS * 2
    res = run_cli(*args, env={"ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S": "0.3"})
    assert res.returncode == 0, res.stderr
    final = {
        (r["_ng_task_index"], r["_ng_rollout_index"]): r["_rf"]["seed"]
        for r in rows_of(out / "rollouts.jsonl")
    }
    assert all(final[key] == seed for key, seed in saved.items())
    assert (out / "rollouts.jsonl").read_bytes() == (reference / "rollouts.jsonl").read_bytes()
