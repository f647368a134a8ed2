"""`--ray-keep-workers-s` on the two-node Ray cluster of fixtures_netns: the next run finds the first's
worker processes and writes the local runner's bytes, the workers end once idle for their keep time, a
worker SIGKILLed mid-chunk has its chunk sent to a new one (every rollout once), and an idle worker of
other code, which holds a CPU, is ended at a run's start (or the run would have one worker fewer); a run
through a Ray client address, a reverify's chunks on warm workers, `rollflow ray-workers` starting them
for the first run, a run on workers of its own ending the idle warm workers that hold the CPUs it needs (at
its start and as they go idle), the newest keep time holding, a node that joins mid-run, and a worker
running two chunk calls at once."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runs import ROWS
from fixtures_netns import RayWorld, RunResult
from test_ray import (
    HOLD,
    ROLLFLOW,
    _chunk_workers,
    _ray_run,
    _reverify,
    _stats,
    _wait_for,
    client_run,
    make_reverify_source,
    node_joins_mid_run,
    two_calls_at_once,
)

from rollflow.tasks.wrappers.ray_actor import NAME_PREFIX, NAMESPACE

WORKER = "ray::ChunkWorker"  # an idle warm worker's process title
OTHER_CODE = f"{NAME_PREFIX}-0123456789ab-0"
NAMES = f"""
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
if sys.argv[2] == "plant":  # an idle worker of other code, started by a run of it, holding a CPU
    from rollflow.tasks.wrappers.ray_actor import ChunkWorker
    options = {{"name": "{OTHER_CODE}", "namespace": "{NAMESPACE}", "lifetime": "detached"}}
    worker = ChunkWorker.options(**options).remote(600)
    ray.get(worker.idle_s.remote(), timeout=60)
actors = ray.util.list_named_actors(all_namespaces=True)
names = [a["name"] for a in actors if a["namespace"] == "{NAMESPACE}"]
if sys.argv[2] == "end":
    for name in names:
        ray.kill(ray.get_actor(name, namespace="{NAMESPACE}"), no_restart=True)
print(json.dumps(sorted(names)))
"""


WARM_HOLD = (
    HOLD
    + """
from rollflow.flows.ray_pool import ChunkWorkers
with ChunkWorkers.opened(30) as pool:
    calls = [pool.submit(hold, f"hold-{i}", 2.0) for i in range(4)]
    print(json.dumps([call.result(timeout=120) for call in calls]))
"""
)


def _names(world: RayWorld, what: str = "list") -> list[str]:
    """The warm workers' names on the cluster (after planting one of other code, or ending them all)."""
    args = [sys.executable, "-c", NAMES, world.ray_address, what]
    return json.loads(world.run(args, env=world.env(), timeout=120).check().stdout.strip().splitlines()[-1])


@pytest.fixture
def warm(ray_world: RayWorld) -> Iterator[RayWorld]:
    """The world, with no warm worker left at the end: they hold the CPUs other tests' tasks need."""
    try:
        yield ray_world
    finally:
        _names(ray_world, "end")
        _wait_for(lambda: not _chunk_workers(ray_world), "warm workers still running", timeout_s=60)


@pytest.mark.alone  # a 30 s keep time spans the gap between runs
def test_ray_warm_workers_serve_the_next_run_then_end_when_idle(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    # Longer than the gap between the two runs: the second run's own start (Python, Prefect, the Ray client)
    # took more than 8 s here under load, and its workers had ended by then.
    keep_s = 30
    sim = warm.simulate(["--latency-ms", "5", "--slots", "16"])
    seen = []
    for i in range(2):
        out = tmp_path / f"out-{i}"
        result = warm.wait(
            _ray_run(warm, rows_input, str(out), sim, "--ray-keep-workers-s", str(keep_s)), 240
        )
        assert result.rc == 0, result.stderr[-3000:]
        assert (out / "rollouts.jsonl").read_bytes() == reference
        report = json.loads((out / "report.json").read_text())
        assert sum(w["rollouts"] for w in report["workers"]) == 2 * ROWS
        seen.append(sorted(warm.pids(WORKER)))
    assert len(seen[0]) == 2, seen  # one per CPU of the cluster
    assert seen[1] == seen[0], "the second run started workers of its own"
    assert len(_names(warm)) == 2
    _wait_for(
        lambda: not _chunk_workers(warm), "idle workers outlived their keep time", timeout_s=keep_s + 20
    )
    assert _names(warm) == []


def test_ray_a_warm_worker_killed_mid_chunk_has_its_chunk_sent_to_a_new_one(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    sim = warm.simulate(["--latency-ms", "20", "--slots", "16"])
    out = tmp_path / "out"
    run = _ray_run(warm, rows_input, str(out), sim, "--ray-keep-workers-s", "30")
    _wait_for(lambda: _stats(warm, sim)["completed"] >= 600, "the run made no progress", world=warm, run=run)
    victims = _chunk_workers(warm)  # each runs chunks mid-run (two at a time, its title names one or none)
    assert victims, warm.procs("ray::")
    assert warm.kill(pid=victims[0], signal=9)
    result = warm.wait(run, timeout=300)
    assert result.rc == 0, result.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference  # every rollout once, in order
    assert len(list(out.glob("chunks/*.json"))) == -(-ROWS // 40)
    assert "goes to a new worker" in result.stderr
    assert _stats(warm, sim)["max_in_flight_seen"] <= 16


@pytest.mark.alone  # two 2 s calls must overlap
def test_a_warm_worker_runs_two_chunk_calls_at_once(warm: RayWorld) -> None:
    """As a Dask worker's two threads: the second call takes the slots the first one's tail frees, where
    one call at a time left them idle from a chunk's tail to the next chunk's start."""
    args = [sys.executable, "-c", WARM_HOLD, warm.ray_address]
    out = warm.run(args, env=warm.env(), timeout=180).check().stdout.strip().splitlines()[-1]
    two_calls_at_once(json.loads(out))


@pytest.mark.alone  # both workers must start before the run ends
def test_ray_an_idle_worker_of_other_code_is_ended_at_a_runs_start(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    """It holds one of the cluster's two CPUs for 600 s: a run that left it there would have one worker
    for its chunks."""
    assert OTHER_CODE in _names(warm, "plant")
    sim = warm.simulate(["--latency-ms", "5", "--slots", "16"])
    out = tmp_path / "out"
    result = warm.wait(_ray_run(warm, rows_input, str(out), sim, "--ray-keep-workers-s", "5"), timeout=120)
    assert result.rc == 0, result.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference
    report = json.loads((out / "report.json").read_text())
    assert len([w for w in report["workers"] if w["rollouts"]]) == 2, report["workers"]
    assert OTHER_CODE not in _names(warm)


def test_ray_warm_workers_through_a_ray_client_address(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    """--ray-address ray://: the flow is a Ray client; its calls, their ends and the workers' names all go
    through Ray's client server."""
    sim = warm.simulate(["--latency-ms", "5", "--slots", "16"])
    out = tmp_path / "out"
    result = client_run(warm, rows_input, out, sim, "--ray-keep-workers-s", "60")
    assert result.rc == 0, result.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference
    assert len(_names(warm)) == 2


def test_ray_reverify_on_warm_workers_publishes_the_local_reverifys_rows(
    warm: RayWorld, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`reverify --ray-keep-workers-s`: its chunks (which share no limit) on warm workers, the same bytes as
    the local runner's reverify."""
    base = make_reverify_source(warm, tmp_path_factory)
    source = base / "out"
    args = ("--verifier", "math_fast", "--chunk-size", "25")
    local = warm.run(_reverify(source, base / "local-warm", *args), env=warm.env(), timeout=180)
    assert local.check().rc == 0
    extra = ("--runner", "ray", "--ray-address", warm.ray_address, "--ray-keep-workers-s", "60")
    ray = warm.run(_reverify(source, base / "ray-warm", *args, *extra), env=warm.env(), timeout=240)
    assert ray.rc == 0, ray.stderr[-3000:]
    published = (base / "ray-warm" / "rollouts.jsonl").read_bytes()
    assert published == (base / "local-warm" / "rollouts.jsonl").read_bytes()
    assert len(_names(warm)) == 2


def _ray_workers(world: RayWorld, *args: str) -> RunResult:
    cmd = [ROLLFLOW, "ray-workers", "--ray-address", world.ray_address, *args]
    return world.run(cmd, env=world.env(), timeout=180)


def test_ray_workers_started_with_the_cluster_serve_the_first_run(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    """`rollflow ray-workers`, as `dask worker` is started before a Dask run: the first run finds them."""
    started = _ray_workers(warm, "--keep-s", "60")
    assert started.rc == 0, started.stderr[-3000:]
    assert "2 of 2 warm Ray chunk workers up" in started.stdout
    before = _chunk_workers(warm)
    assert len(before) == 2
    sim = warm.simulate(["--latency-ms", "5", "--slots", "16"])
    out = tmp_path / "out"
    result = warm.wait(_ray_run(warm, rows_input, str(out), sim, "--ray-keep-workers-s", "60"), 240)
    assert result.rc == 0, result.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference
    assert _chunk_workers(warm) == before, "the run started workers of its own"


@pytest.mark.alone  # the run must end within 120 s
def test_a_run_on_its_own_workers_ends_the_idle_warm_workers_holding_the_cpus(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    """Warm workers hold every CPU for 600 s; a run without --ray-keep-workers-s (on workers of its own)
    would wait that long for a CPU."""
    assert _ray_workers(warm, "--keep-s", "600").rc == 0
    sim = warm.simulate(["--latency-ms", "5", "--slots", "16"])
    out = tmp_path / "out"
    result = warm.wait(_ray_run(warm, rows_input, str(out), sim), timeout=120)
    assert not result.running, "the run waited for the CPUs idle warm workers held"
    assert result.rc == 0, result.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference
    assert _names(warm) == []


def test_ray_workers_refuses_a_keep_time_of_zero_a_bad_timeout_and_a_cluster_of_its_own(run_cli) -> None:
    res = run_cli("ray-workers", "--ray-address", "auto", "--keep-s", "0")
    assert res.returncode == 2, res.stderr
    assert "--keep-s" in res.stderr
    res = run_cli("ray-workers", "--keep-s", "60")  # a local instance would end with the command
    assert res.returncode == 2 and "--ray-address" in res.stderr, res.stderr
    res = run_cli("ray-workers", "--ray-address", " ", "--keep-s", "60")  # Ray would start a local instance
    assert res.returncode == 2 and "--ray-address" in res.stderr, res.stderr
    res = run_cli("ray-workers", "--ray-address", "auto", "--keep-s", "60", "--start-timeout-s", "nan")
    assert res.returncode == 2 and "--start-timeout-s" in res.stderr, res.stderr


@pytest.mark.alone  # workers end within 20 s of a 2 s keep time
def test_the_newest_keep_time_holds_for_workers_already_up(
    warm: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    sim = warm.simulate(["--latency-ms", "5", "--slots", "16"])
    result = warm.wait(
        _ray_run(warm, rows_input, str(tmp_path / "out"), sim, "--ray-keep-workers-s", "300"), 240
    )
    assert result.rc == 0, result.stderr[-3000:]
    assert len(_chunk_workers(warm)) == 2
    assert _ray_workers(warm, "--keep-s", "2").rc == 0
    _wait_for(lambda: not _chunk_workers(warm), "the workers kept the first run's keep time", timeout_s=20)


@pytest.mark.alone  # the joining node must get chunks before the run ends
def test_a_node_that_joins_mid_run_gets_a_warm_worker(
    warm: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    node_joins_mid_run(warm, rows_input, tmp_path, "--ray-keep-workers-s", "30")


@pytest.mark.alone  # the run must end within 120 s
def test_a_run_on_its_own_workers_gets_the_cpus_warm_workers_free_mid_run(
    warm: RayWorld, rows_input: Path, reference: bytes, tmp_path: Path
) -> None:
    """A warm run holds both CPUs; a run on workers of its own starts meanwhile: once the warm run ends, its
    idle workers give the CPUs up (they would hold them for 300 s)."""
    sim = warm.simulate(["--latency-ms", "20", "--slots", "16"])
    busy = _ray_run(warm, rows_input, str(tmp_path / "warm"), sim, "--ray-keep-workers-s", "300",
                    "--parallelism", "4")  # fmt: skip
    _wait_for(
        lambda: len(_chunk_workers(warm)) == 2 and _stats(warm, sim)["completed"] > 0,
        "the warm run's two workers never started",
    )
    plain = _ray_run(warm, rows_input, str(tmp_path / "plain"), sim)
    assert warm.wait(busy, timeout=240).rc == 0
    result = warm.wait(plain, timeout=120)
    assert not result.running, "the run on workers of its own waited for the CPUs idle warm workers held"
    assert result.rc == 0, result.stderr[-3000:]
    assert (tmp_path / "plain" / "rollouts.jsonl").read_bytes() == reference
