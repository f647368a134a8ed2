"""More than one collector process on the local runner: asked for, or chosen when tuning finds the client
at a core with cores idle; one limit across them, every rollout exactly once, the choice in report.json."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from rollout_data import assert_complete, write_rows

from rollflow.flows import collectors as flow_collectors
from rollflow.flows.collectors import MIN_SECONDS_LEFT, choose_collectors, chosen_step, collect_spec
from rollflow.infra.local import spawn_simulator
from rollflow.settings import RunSpec
from rollflow.tasks.tuning import collectors
from rollflow.tasks.tuning.collectors import CLIENT_BOUND, Collectors, auto_collectors, machine_busy_s


def _step(client: float, busy: float, rate: float = 5000.0, parallelism: int = 80) -> dict[str, float]:
    return {"parallelism": parallelism, "rollouts_per_s": rate, "client_cores": client, "busy_cores": busy}


def test_auto_adds_a_collector_per_idle_core_only_when_the_client_is_at_a_core() -> None:
    one = auto_collectors(_step(1.0, 1.56), 2)  # this machine: the simulator took the other core
    assert one.count == 1 and "0.44 of 2 cores idle" in one.why, one.why
    assert auto_collectors(_step(0.97, 1.1), 4).count == 4  # 2.9 idle: 3 cores at least 0.75 idle
    assert auto_collectors(_step(0.86, 2.28), 4).count == 2  # 1.72 idle: one whole core, not 1.72/0.86
    assert auto_collectors(_step(0.97, 1.0), 128).count == 64  # never more than MAX_COLLECTORS
    calm = auto_collectors(_step(CLIENT_BOUND - 0.05, 1.0), 8)
    assert calm.count == 1 and "not the limit" in calm.why
    assert auto_collectors(None, 8).count == 1
    assert auto_collectors({"parallelism": 8, "rollouts_per_s": 1.0, "client_cores": 1.0}, 8).count == 1


def _spec(tmp_path: Path, collectors: int | str = "auto", **collection: object) -> RunSpec:
    return RunSpec.model_validate(
        {"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out"), "collectors": collectors,
         "backend": {"url": "http://127.0.0.1:1", "kind": "agent"}, "collection": collection}
    )  # fmt: skip


def test_the_level_the_tuner_chose_is_judged_not_the_fastest_reading() -> None:
    """One fast re-reading at 160 (6,105/s, the client at 0.89) says nothing of collecting at 70: the
    readings at 64, the nearest level read below the choice, are judged, as their mean."""
    steps = [_step(0.5, 1.0, 3000.0, 32), _step(0.6, 1.2, 4000.0, 64), _step(0.7, 1.4, 4400.0, 64),
             _step(0.89, 1.5, 6105.0, 160), {**_step(1.0, 1.9, 9000.0, 320), "errors": 3}]  # fmt: skip
    at = chosen_step({"steps": steps, "chosen_parallelism": 70})
    want = {"parallelism": 64, "rollouts_per_s": 4200.0, "client_cores": 0.65, "busy_cores": 1.3}
    assert at == pytest.approx(want), at
    assert auto_collectors(at, 8).count == 1  # the client at 0.65 of a core: not the limit there
    assert chosen_step({"steps": steps[3:], "chosen_parallelism": 70}) is None  # nothing read at or below


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_cpu_quota_counts_as_the_cores_and_its_cgroup_as_the_busy_time(
    version: str, tmp_path: Path, monkeypatch
) -> None:
    """In a container limited to 2 CPUs on a 64-core host, auto never counts the host's idle cores."""
    if version == "v2":
        (tmp_path / "cpu.max").write_text("200000 100000\n")
        (tmp_path / "cpu.stat").write_text("usage_usec 7500000\nuser_usec 5000000\nsystem_usec 2500000\n")
    else:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpuacct").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        (tmp_path / "cpuacct" / "cpuacct.usage").write_text("7500000000\n")
    monkeypatch.setattr(collectors, "CGROUP", str(tmp_path))
    monkeypatch.setattr(collectors, "_affinity", lambda: set(range(64)))
    assert collectors.cpu_quota() == 2.0 and collectors.usable_cores() == 2
    assert machine_busy_s() == 7.5
    quota = tmp_path / ("cpu.max" if version == "v2" else "cpu/cpu.cfs_quota_us")
    quota.write_text("150000 100000\n" if version == "v2" else "150000\n")
    assert collectors.usable_cores() == 1  # 1.5 CPUs: one whole core
    quota.write_text("max 100000\n" if version == "v2" else "-1\n")
    assert collectors.cpu_quota() is None and collectors.usable_cores() == 64
    assert machine_busy_s() != 7.5  # no quota: /proc/stat
    quota.write_text("garbage\n")
    assert collectors.cpu_quota() is None  # not the kernel's form: says nothing


def test_several_endpoints_are_judged_together_at_their_chosen_levels() -> None:
    """Tuned at once in this process: their levels and rates add up; the client's and the machine's
    cores are one process's and one machine's, so the busiest reading is kept, never a sum."""
    one = {"chosen_parallelism": 40, "steps": [_step(0.5, 1.0, 2000.0, 40)]}
    two = {"chosen_parallelism": 64, "steps": [_step(0.9, 1.3, 3000.0, 64), _step(0.95, 1.4, 3500.0, 128)]}
    at = chosen_step({"chosen_parallelism": 104, "endpoints": [one, two]})
    assert at == {"parallelism": 104, "rollouts_per_s": 5000.0, "client_cores": 0.9, "busy_cores": 1.3}
    assert chosen_step({"endpoints": [one, {"chosen_parallelism": 8, "steps": two["steps"]}]}) is None


def test_collectors_run_on_a_cluster_of_this_machine_never_on_one_set_for_the_dask_runner(
    tmp_path: Path,
) -> None:
    spec = RunSpec.model_validate(
        {"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out"),
         "dask_cluster_class": "dask_jobqueue.SLURMCluster", "dask_cluster_kwargs": {"cores": 8},
         "dask_adapt_max": 16}
    )  # fmt: skip
    ran = collect_spec(spec, Collectors(3, "--collectors 3"))
    assert (ran.runner, ran.dask_workers, ran.dask_address, ran.dask_cluster_class) == ("dask", 3, None, None)
    assert ran.dask_cluster_kwargs == {} and ran.dask_adapt_max is None
    assert collect_spec(spec, Collectors(1, "one")) is spec
    addressed = collect_spec(spec.model_copy(update={"dask_address": "tcp://h:8786"}), Collectors(2, "two"))
    assert addressed.dask_address is None and addressed.dask_workers == 2


def test_a_short_rest_or_a_limit_steered_here_keeps_one_collector(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(flow_collectors, "usable_cores", lambda: 8)
    steps = [_step(0.2, 1.0, 900.0, 5), _step(0.99, 1.2, 5000.0, 80)]
    tuning = {"tuning": {"steps": steps, "chosen_parallelism": 80}}
    spec = _spec(tmp_path, parallelism="auto")
    long = choose_collectors(spec, tuning, False, int(5000 * MIN_SECONDS_LEFT * 2), 100)
    assert long.count == 8 and long.client_cores == 0.99, long  # 6.8 idle: 7 more
    few = choose_collectors(spec, tuning, False, int(5000 * MIN_SECONDS_LEFT * 2), 3)
    assert few.count == 3 and few.why.endswith("; 3 chunks pending"), few.why  # a chunk is one process's
    assert choose_collectors(_spec(tmp_path, collectors=4), {}, False, 0, 0).count == 1  # nothing pending
    short = choose_collectors(spec, tuning, False, 20_000, 100)
    assert short.count == 1 and "too short" in short.why, short.why
    assert choose_collectors(spec, tuning, True, 10**7, 100).count == 1  # the engine's gauges steer it here
    fixed = _spec(tmp_path, parallelism=64)
    assert choose_collectors(fixed, {}, False, 10**7, 100).count == 1  # not measured


def test_the_machine_busy_counter_moves_with_work() -> None:
    before = machine_busy_s()
    assert before is not None  # Linux: /proc/stat
    sum(i * i for i in range(3_000_000))
    after = machine_busy_s()
    assert after is not None and after > before


def test_collectors_need_a_limit_that_is_not_steered_in_one_process(run_cli, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    res = run_cli("run", "--input", str(inp), "--output", str(tmp_path / "o"), "--backend-url",
                  "http://127.0.0.1:1", "--collectors", "2", "--parallelism", "adaptive")  # fmt: skip
    assert res.returncode == 2 and "--parallelism adaptive is not supported with --collectors 2" in res.stderr
    res = run_cli("run", "--input", str(inp), "--output", str(tmp_path / "o"), "--backend-url",
                  "http://127.0.0.1:1", "--collectors", "0")  # fmt: skip
    assert res.returncode == 2 and "from 1 to 64 or auto, not '0'" in res.stderr, res.stderr


def test_two_collectors_share_one_limit_and_write_every_rollout_once(run_cli, tmp_path: Path) -> None:
    sim = spawn_simulator("--latency-ms", "2", "--slots", "4096")
    inp, out = write_rows(tmp_path / "rows.jsonl", 3000), tmp_path / "out"
    try:
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url",
            sim.url, "--num-repeats", "2", "--parallelism", "48", "--chunk-size", "250", "--collectors", "2",
            "--no-progress",
        )  # fmt: skip
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["collectors"] == {"count": 2, "why": "--collectors 2"}
    assert report["runner"] == "dask" and report["peak_in_flight_allowed"] <= 48
    workers = report["workers"]
    assert len({w["worker"] for w in workers}) == 2, workers
    assert sum(w["rollouts"] for w in workers) == 6000 and all(w["peak_in_flight"] <= 48 for w in workers)
    md = (out / "report.md").read_text()
    assert "Collector processes: 2 (--collectors 2), as a local Dask cluster; 2 of them collected" in md, md
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 3000, 2)


@pytest.mark.alone  # reads the machine's CPU while tuning
def test_auto_judges_the_client_from_the_tuners_steps(run_cli, tmp_path: Path) -> None:
    """A backend without gauges is tuned; each step records the client's and the machine's busy cores,
    and the choice follows from the chosen level's figures as the rule says, whatever this machine has."""
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096", "--metrics-format", "none")
    inp, out = write_rows(tmp_path / "rows.jsonl", 3000), tmp_path / "out"
    try:
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url",
            sim.url, "--num-repeats", "4", "--parallelism", "auto", "--no-progress",
        )  # fmt: skip
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    steps = report["tuning"]["steps"]
    assert all(0 < s["client_cores"] <= 1.2 and s["busy_cores"] >= 0 for s in steps), steps
    chosen, at = report["collectors"], chosen_step(report["tuning"])
    assert at is not None and chosen["client_cores"] == round(at["client_cores"], 2), (chosen, at)
    assert chosen["why"].startswith(f"auto: at parallelism {at['parallelism']}: "), chosen
    assert (chosen["count"] > 1) == (report.get("runner") == "dask"), report.get("runner")
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 3000, 4)
