"""--settle-after and --until-learnable: the rule on committed rewards, the audit that expects no rollout a
settled task never got, honest statistics, byte-identical seeded runs, a kill mid-settling resumed to the
same bytes, the stop at a learnable target, and the rule named in the report and the card."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from cli_runs import spawn, wait_until
from rollout_data import write_rows

from rollflow.infra.local import Service, spawn_simulator
from rollflow.tasks.collect.forecast import Measured, forecast, forecast_text
from rollflow.tasks.collect.settle import OPEN, PENDING, SETTLED, decide
from rollflow.tasks.publish.rewards import RewardStats, TaskRewards

TASKS, K, M = 240, 8, 3


def _line(task: int, r: int, reward: float) -> bytes:
    return orjson.dumps({"_ng_task_index": task, "_ng_rollout_index": r, "reward": reward})


def test_a_task_settles_only_when_its_first_rollouts_share_one_outcome() -> None:
    results = {(0, r): _line(0, r, 1.0) for r in range(3)}  # all correct
    results |= {(1, r): _line(1, r, 0.0) for r in range(3)}  # all wrong
    results |= {(2, 0): _line(2, 0, 1.0), (2, 1): _line(2, 1, 0.0), (2, 2): _line(2, 2, 1.0)}
    results |= {(3, 0): _line(3, 0, 1.0), (3, 2): _line(3, 2, 1.0)}  # rollout 1 failed: undecided
    results |= {(4, r): _line(4, r, 0.5) for r in range(3)}  # below the threshold: all wrong
    decisions = decide(range(5), results, 3, threshold=1.0)
    assert decisions == {0: SETTLED, 1: SETTLED, 2: OPEN, 3: PENDING, 4: SETTLED}
    assert decide([4], results, 3, threshold=0.5) == {4: SETTLED}


def test_statistics_count_a_settled_task_at_its_one_outcome_for_every_k() -> None:
    stats = RewardStats(threshold=1.0, max_k=8)
    stats.add_task(TaskRewards(0, 3, 3, 3.0), settled=True)  # settled all correct after 3
    stats.add_task(TaskRewards(1, 3, 0, 0.0), settled=True)  # settled none correct after 3
    stats.add_task(TaskRewards(2, 8, 4, 4.0))  # mixed, all 8
    stats.add_task(TaskRewards(3, 5, 2, 2.0))  # 3 failed rollouts: left out of pass@k, as before
    d = stats.as_dict()
    assert (d["all_correct"]["tasks"], d["none_correct"]["tasks"], d["mixed"]["tasks"]) == (1, 1, 2)
    assert d["settled"] == {"tasks": 2, "share": 0.5} and "settled_rule" in d
    assert d["pass_at_k_tasks"] == {"1": 3, "2": 3, "4": 3, "8": 3}
    assert d["pass_at_k"]["1"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert d["pass_at_k"]["8"] == pytest.approx((1 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="settled with mixed"):
        stats.add_task(TaskRewards(4, 3, 1, 1.0), settled=True)


def test_the_forecast_counts_the_settled_share_the_probes_measured() -> None:
    f = forecast(Measured(1000, 16, 8, None, 100.0, 0.5, probe_tasks=200, probe_settled=120))
    assert f["rollouts"] == round(1000 * (8 + 0.4 * 8)) and f["rollouts_full"] == 16000
    assert f["wall_s"] == pytest.approx(f["rollouts"] / 100.0, abs=0.1)
    unknown = forecast(Measured(1000, 16, 8))
    assert unknown["rollouts"] is None and unknown["rollouts_range"] == [8000, 16000]
    assert unknown["wall_s"] is None
    until = forecast(Measured(1000, 16, 8, 100, probe_tasks=100, probe_settled=60))
    assert until["tasks"] == 250  # 100 learnable at a 40% learnable share
    blind = forecast(Measured(1000, 16, 8, 100))  # no probes: the share, so where it stops, is not known
    assert blind["rollouts_range"] == [1600, 16000] and blind["tasks_at_most"]
    assert "rollouts for up to 1,000 tasks" in forecast_text(blind)
    beyond = forecast(Measured(40, 8, 4, 100))  # a target past the input: it may all settle at 4 each
    assert beyond["rollouts_range"] == [160, 320]


@pytest.fixture(scope="module")
def spread_sim() -> Service:
    """Per-task difficulty: 60% of tasks always or never solved, the rest in [0.2, 0.8]."""
    sim = spawn_simulator("--latency-ms", "1", "--slots", "128", "--difficulty", "spread")
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rows(tmp_path_factory.mktemp("settle") / "rows.jsonl", TASKS)


def settle_args(rows: Path, out: Path | str, sim: Service, *extra: str) -> list[str]:
    return [
        "run", "--input", str(rows), "--output", str(out), "--backend-kind", "agent", "--backend-url",
        sim.url, "--num-repeats", str(K), "--settle-after", str(M), "--seed", "7", "--parallelism", "32",
        "--chunk-size", "20", "--no-progress", *extra,
    ]  # fmt: skip


def check_settled_dataset(data: bytes, tasks: int = TASKS) -> dict[int, list[float]]:
    """Every task has exactly M rollouts when they share one outcome, else all K, in order, once."""
    by_task: dict[int, list[float]] = {}
    marks: dict[int, set[int | None]] = {}
    keys = []
    for line in data.splitlines():
        row = orjson.loads(line)
        keys.append((row["_ng_task_index"], row["_ng_rollout_index"]))
        by_task.setdefault(row["_ng_task_index"], []).append(row["reward"])
        marks.setdefault(row["_ng_task_index"], set()).add(row["_rf"].get("settled_after"))
    assert sorted(by_task) == list(range(tasks))
    expected = []
    for task, rewards in by_task.items():
        first = {r >= 1.0 for r in rewards[:M]}
        n = M if len(first) == 1 else K
        assert len(rewards) == n, (task, rewards)
        assert marks[task] == ({M} if n == M else {None}), (task, marks[task])  # the rows say it settled
        expected += [(task, r) for r in range(n)]
    assert keys == expected
    return by_task


@pytest.fixture(scope="module")
def settled_reference(run_cli, spread_sim: Service, rows: Path, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("settle-ref") / "out"
    res = run_cli(*settle_args(rows, out, spread_sim))
    assert res.returncode == 0, res.stderr
    return (out / "rollouts.jsonl").read_bytes()


def test_settling_on_the_local_runner_is_exactly_once_seeded_and_stated(
    run_cli, spread_sim: Service, rows: Path, settled_reference: bytes, tmp_path: Path
) -> None:
    by_task = check_settled_dataset(settled_reference)
    settled = [t for t, rewards in by_task.items() if len(rewards) == M]
    assert 0.4 * TASKS < len(settled) < 0.9 * TASKS, len(settled)
    out = tmp_path / "out"
    res = run_cli(*settle_args(rows, out, spread_sim))
    assert res.returncode == 0, res.stderr
    assert (out / "rollouts.jsonl").read_bytes() == settled_reference  # byte-identical with --seed
    report = orjson.loads((out / "report.json").read_bytes())
    unasked = len(settled) * (K - M)
    assert report["missing"] == 0 and report["audit_ok"] and report["published"]
    assert report["rows_expected"] == report["rows_written"] == TASKS * K - unasked
    s = report["settling"]
    assert (s["settled_tasks"], s["rollouts_not_requested"]) == (len(settled), unasked)
    assert "all correct or all wrong" in s["rule"]
    assert report["rewards"]["settled"]["tasks"] == len(settled)
    assert report["rewards"]["pass_at_k_tasks"]["8"] == TASKS  # settled tasks count in pass@k too
    tasks_file = [orjson.loads(x) for x in (out / "rollouts.tasks.jsonl").read_bytes().splitlines()]
    assert [t["task_index"] for t in tasks_file if t.get("settled_after") == M] == settled
    card = (out / "README.md").read_text()
    assert f"Settling (--settle-after {M})" in card and "all correct or all wrong" in card
    md = (out / "report.md").read_text()
    assert "## Settling" in md and "never as missing" in md and "## Forecast" in md
    said = res.stdout + res.stderr
    assert "settled tasks" in said and "forecast: " in said
    manifests = [orjson.loads(p.read_bytes()) for p in sorted((out / "chunks").glob("*.json"))]
    assert sorted(int(t) for m in manifests for t in m["settled"]) == settled


def test_a_kill_in_the_middle_of_settling_resumes_to_the_same_bytes(
    run_cli, cli_env, rows: Path, settled_reference: bytes, tmp_path: Path
) -> None:
    sim = spawn_simulator("--latency-ms", "30", "--slots", "16", "--difficulty", "spread")
    try:
        out = tmp_path / "out"
        args = settle_args(rows, out, sim, "--flush-interval-s", "0.2")
        args[args.index("--parallelism") + 1] = "8"
        for target in (2, 6):
            proc = spawn(args, cli_env)
            wait_until(lambda t=target: len(list((out / "chunks").glob("*.json"))) >= t, proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        committed = len(list((out / "chunks").glob("*.json")))
        assert committed < TASKS // 20, "the run ended before it was killed"
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
        assert (out / "rollouts.jsonl").read_bytes() == settled_reference
    finally:
        sim.stop()


def test_until_learnable_stops_at_its_target_and_publishes_what_it_collected(
    run_cli, spread_sim: Service, rows: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    target = 20
    res = run_cli(
        *settle_args(rows, out, spread_sim, "--until-learnable", str(target), "--chunks-in-flight", "1")
    )
    assert res.returncode == 0, res.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    until = report["until_learnable"]
    assert report["published"] and report["audit_ok"] and report["missing"] == 0
    assert until["learnable_tasks"] >= target and until["chunks_not_needed"] > 0
    data = (out / "rollouts.jsonl").read_bytes()
    by_task = check_settled_dataset(data, tasks=report["rewards"]["tasks"])
    mixed = sum(1 for rewards in by_task.values() if 0 < sum(r >= 1.0 for r in rewards) < len(rewards))
    assert mixed == until["learnable_tasks"] == report["rewards"]["mixed"]["tasks"]
    manifests = [orjson.loads(p.read_bytes()) for p in sorted((out / "chunks").glob("*.json"))]
    per_chunk = [m["stats"]["mixed_tasks"] for m in manifests]
    assert sum(per_chunk[:-1]) < target <= sum(per_chunk)  # one chunk at a time: stopped at the first enough
    assert len(manifests) + until["chunks_not_needed"] == TASKS // 20
    assert "not missing" in until["reason"] and "until learnable" in res.stdout + res.stderr
    res = run_cli(
        *settle_args(rows, out, spread_sim, "--until-learnable", str(target), "--chunks-in-flight", "1")
    )
    assert res.returncode == 0, res.stderr  # a resumed run already has its target: it starts no chunk
    assert "forecast: nothing left to collect" in res.stdout + res.stderr, res.stderr
    assert (out / "rollouts.jsonl").read_bytes() == data


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--settle-after", str(K), "must be below num_repeats"),
        ("--settle-after", "1", "settles every task: one rollout always agrees with itself"),
        ("--settle-after", "0", "settle tasks on no rollout at all; give 2 or more"),
        ("--num-repeats", "1", "needs num_repeats 2 or more"),
    ],
)
def test_a_rule_that_cannot_work_is_refused(
    run_cli, spread_sim: Service, rows: Path, tmp_path: Path, flag: str, value: str, said: str
) -> None:
    """settle_after at K or above, or 1 (every task would settle), and --until-learnable with one rollout
    per task (none is ever learnable): refused before anything runs."""
    out = tmp_path / "out"
    args = settle_args(rows, out, spread_sim, "--until-learnable", "5")
    if flag == "--num-repeats":
        i = args.index("--settle-after")
        del args[i : i + 2]
    args[args.index(flag) + 1] = value
    res = run_cli(*args)
    assert res.returncode == 2 and said in res.stderr, res.stderr
    assert not (out / "rollouts.jsonl").exists()


def test_until_learnable_says_when_the_input_ran_out_before_its_target(
    run_cli, spread_sim: Service, rows: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    res = run_cli(*settle_args(rows, out, spread_sim, "--until-learnable", "100000"))
    assert res.returncode == 0, res.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    until = report["until_learnable"]
    assert until["reached"] is False and until["learnable_tasks"] == report["rewards"]["mixed"]["tasks"]
    assert until["reason"].startswith(
        f"target not reached: the input ran out at {until['learnable_tasks']:,}"
    )
    assert (
        "not reached" in res.stdout + res.stderr and "target not reached" in (out / "README.md").read_text()
    )


def test_until_learnable_on_dask_stops_starting_chunks(
    run_cli, spread_sim: Service, rows: Path, tmp_path: Path
) -> None:
    """On Dask (many chunks submitted ahead otherwise) the target still leaves chunks unstarted."""
    out = tmp_path / "out"
    extra = ("--until-learnable", "10", "--runner", "dask", "--dask-workers", "1")
    res = run_cli(*settle_args(rows, out, spread_sim, *extra), timeout=400)
    assert res.returncode == 0, res.stderr
    until = orjson.loads((out / "report.json").read_bytes())["until_learnable"]
    assert until["reached"] and until["chunks_not_needed"] > 0, until


def test_settling_on_a_local_dask_cluster_gives_the_local_bytes(
    run_cli, spread_sim: Service, rows: Path, settled_reference: bytes, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    res = run_cli(*settle_args(rows, out, spread_sim, "--runner", "dask", "--dask-workers", "2"), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == settled_reference
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["settling"]["settled_tasks"] > 0 and report["missing"] == 0


@pytest.mark.alone  # a Ray cluster in its own namespace: beside loaded test files its API calls timed out
def test_settling_on_ray_gives_the_local_bytes(ray_world, rows: Path, settled_reference: bytes) -> None:
    import sys

    sim = ray_world.simulate(["--latency-ms", "1", "--slots", "128", "--difficulty", "spread"])
    out = Path(ray_world.root) / "settle-out"
    exe = str(Path(sys.executable).with_name("rollflow"))
    args = [exe, *settle_args(rows, out, SimpleNamespace(url=sim), "--runner", "ray",
            "--ray-address", ray_world.ray_address)]  # fmt: skip
    result = ray_world.run(args, env=ray_world.env(), timeout=400)
    assert result.rc == 0, result.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == settled_reference
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["settling"]["settled_tasks"] > 0 and report["missing"] == 0


def test_reverify_keeps_the_settled_set_and_says_which_tasks_settled(
    run_cli, spread_sim: Service, rows: Path, settled_reference: bytes, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert run_cli(*settle_args(rows, out, spread_sim)).returncode == 0
    res = run_cli(
        "reverify", str(out), "--output", str(tmp_path / "rv"), "--verifier", "math_fast", "--no-progress"
    )
    assert res.returncode == 0, res.stderr
    again = (tmp_path / "rv" / "rollouts.jsonl").read_bytes()
    key = lambda line: (orjson.loads(line)["_ng_task_index"], orjson.loads(line)["_ng_rollout_index"])  # noqa: E731
    assert list(map(key, again.splitlines())) == list(map(key, settled_reference.splitlines()))
    settled = {t for t, r in check_settled_dataset(settled_reference).items() if len(r) == M}
    lines = [orjson.loads(x) for x in (tmp_path / "rv" / "rollouts.tasks.jsonl").read_bytes().splitlines()]
    assert {t["task_index"] for t in lines if t.get("settled_after") == M} == settled
    report = orjson.loads((tmp_path / "rv" / "report.json").read_bytes())
    assert report["after"]["settled"]["tasks"] == len(settled)  # the same rewards: every one still settled
    assert report["settling"]["settled_tasks"] == len(settled) and report["settling"]["settle_after"] == M
    assert f"--settle-after {M}" in (tmp_path / "rv" / "README.md").read_text()  # the card names the rule


def test_reverify_by_a_verifier_that_splits_settled_tasks_says_so_and_counts_them(
    run_cli, spread_sim: Service, rows: Path, tmp_path: Path
) -> None:
    """Another verifier splits tasks the collection settled: they stay settled (M rollouts, marked), count
    as mixed, and pass@k says it is over fewer tasks and why, on both sides of the comparison."""
    out, rv = tmp_path / "out", tmp_path / "rv"
    assert run_cli(*settle_args(rows, out, spread_sim)).returncode == 0
    here = {"PYTHONPATH": str(Path(__file__).parent)}
    res = run_cli("reverify", str(out), "--output", str(rv), "--verifier", "parity_verifier:by_parity",
                  "--verify-processes", "0", "--no-progress", env=here)  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = orjson.loads((rv / "report.json").read_bytes())
    rows_by_task: dict[int, list[float]] = {}
    for line in (rv / "rollouts.jsonl").read_bytes().splitlines():
        row = orjson.loads(line)
        rows_by_task.setdefault(row["_ng_task_index"], []).append(row["reward"])
    settled = {t for t, r in rows_by_task.items() if len(r) == M}
    split = {t for t in settled if len(set(rows_by_task[t])) > 1}
    after = report["after"]
    assert split and after["settled"]["tasks"] == report["settling"]["settled_tasks"] == len(settled)
    assert after["settled_split"]["tasks"] == report["settling"]["settled_split"] == len(split)
    assert max(after["pass_at_k_tasks"].values()) == len(rows_by_task) - len(split)
    md = (rv / "report.md").read_text()
    assert f"over {len(rows_by_task) - len(split):,} of {len(rows_by_task):,} tasks" in md, md
    assert f"{len(split):,} settled tasks now split" in md
    card = (rv / "README.md").read_text()
    assert f"{len(split):,} settled tasks have split rewards" in card and "| pass@k over |" in card


def test_the_forecast_from_tuning_is_said_before_collecting_and_set_against_the_run(
    run_cli, spread_sim: Service, rows: Path, tmp_path: Path
) -> None:
    args = settle_args(rows, tmp_path / "out", spread_sim)
    args[args.index("--parallelism") + 1] = "auto"  # 240 x 8 rollouts: diagnosis and tuning run first
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    f = orjson.loads((tmp_path / "out" / "report.json").read_bytes())["forecast"]
    m = f["measured"]
    assert m["rollouts_per_s"] > 0 and m["backend_s_per_rollout"] > 0 and m["probe_tasks"] > 0
    assert f["rollouts"] is not None and f["wall_s"] is not None and f["backend_s"] is not None
    assert f["actual"]["rollouts"] > 0 and 0.5 < f["actual_over_forecast"]["rollouts"] < 1.5
    assert "\nforecast: " in "\n" + res.stderr  # its own line, before the progress


def test_a_failed_first_rollout_leaves_its_task_undecided_until_a_later_run_answers_it(
    run_cli, spread_sim: Service, rows: Path, settled_reference: bytes, tmp_path: Path
) -> None:
    """Failures among a task's first M: it is neither settled nor given the rest, its later rollouts count
    as missing (the run is not published), and the next run of the command decides it as the rule says."""
    faulty = spawn_simulator(
        "--latency-ms", "1", "--slots", "128", "--difficulty", "spread", "--fault-rate", "0.05",
        "--fault-kinds", "500",
    )  # fmt: skip
    try:
        out = tmp_path / "out"
        no_retry = {"ROLLFLOW_COLLECTION__CHUNK_RETRIES": "0"}
        res = run_cli(*settle_args(rows, out, faulty, "--max-retries", "0"), env=no_retry)
        assert res.returncode != 0
        report = orjson.loads((out / "report.json").read_bytes())
        assert not report["published"] and report["failed"] > 0
        assert report["missing"] > report["failed"]  # the undecided tasks' rest is missing, not settled
    finally:
        faulty.stop()
    res = run_cli(*settle_args(rows, out, spread_sim))
    assert res.returncode == 0, res.stderr
    assert (out / "rollouts.jsonl").read_bytes() == settled_reference


def test_progress_takes_a_committed_chunks_settled_rollouts_out_of_the_plan() -> None:
    from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount

    count = RolloutCount()
    count.add(ProgressEvent("plan", total=160))
    count.add(ProgressEvent("attempt", chunk=0, done=0))
    count.add(ProgressEvent("rollouts", chunk=0, done=100))
    assert count.add(ProgressEvent("chunk", chunk=0, done=100, total=60))
    assert (count.done, count.total) == (100, 100)


def test_reverify_of_a_source_short_of_rollouts_says_so_and_publishes_only_when_allowed(
    run_cli, rows: Path, tmp_path: Path
) -> None:
    """A settled collection published incomplete (backend failures; tasks left undecided never got their
    later rollouts): reverify cannot make those rollouts, so it refuses to call its output complete, says
    how many the source lacks and what to do, and with --allow-incomplete states them in report and card."""
    sim = spawn_simulator("--latency-ms", "1", "--slots", "128", "--difficulty", "spread",
                          "--fault-rate", "0.1", "--fault-kinds", "500", "--seed", "5")  # fmt: skip
    try:
        out = tmp_path / "out"
        args = settle_args(rows, out, sim, "--max-retries", "0", "--allow-incomplete", "--limit", "60")
        res = run_cli(*args)
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    source = orjson.loads((out / "report.json").read_bytes())
    assert source["missing"] > 0
    rv = tmp_path / "rv"
    res = run_cli("reverify", str(out), "--output", str(rv), "--verifier", "math_fast", "--no-progress")
    assert res.returncode != 0 and "the source lacks" in res.stderr, res.stderr[-3000:]
    assert "run the collection's command" in res.stderr and not (rv / "rollouts.jsonl").exists()
    res = run_cli("reverify", str(out), "--output", str(rv), "--verifier", "math_fast", "--no-progress",
                  "--allow-incomplete")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((rv / "report.json").read_bytes())
    by_task: dict[int, int] = {}
    settled: dict[int, int] = {}
    for line in (rv / "rollouts.jsonl").read_bytes().splitlines():
        row = orjson.loads(line)
        by_task[row["_ng_task_index"]] = by_task.get(row["_ng_task_index"], 0) + 1
        if row["_rf"].get("settled_after"):
            settled[row["_ng_task_index"]] = row["_rf"]["settled_after"]
    short = sum(settled.get(t, K) - n for t, n in by_task.items())  # the tasks it has, short of theirs
    assert report["missing"] == short > 0 and report["missing"] <= source["missing"]
    assert f"| missing | {short:,} |" in (rv / "README.md").read_text()
