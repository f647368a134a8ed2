"""`--runner ray` on a two-node Ray cluster inside a network namespace with only loopback (fixtures_netns):
the local runner's bytes on S3, every rollout once after a worker process is SIGKILLed, the backend never
above --parallelism (below the worker count, with a node joining mid-run), a hung replica found once for
every worker, a replica out of rotation leaving the whole limit on the others and the run's share channel
removed from the cluster at its end, `rollflow reverify --runner ray` equal to the local reverify and
exactly once after a worker process is SIGKILLed, and nothing off 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runs import ROWS, run_args
from fixtures_netns import UNSHARE, RayWorld, RunResult, unshare_permitted
from rollout_data import write_sum_rows
from test_reverify import REPEATS, TASKS, collect_args, rows, tree_digest

from rollflow.infra.local import free_port
from rollflow.tasks.backends.endpoints import BACKOFF_MAX_S, FOLLOWED_TRIAL_S
from rollflow.tasks.scaleout.channels import PREFIX, RAY_NAMESPACE

ROLLFLOW = str(Path(sys.executable).with_name("rollflow"))
RAY_CLIENT_PORT = 10001  # `ray start --head` starts Ray's client server there
STATS = (
    "import json, sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + '/stats').read().decode())"
)
S3_SHA = (
    "import hashlib, sys, s3fs; print(hashlib.sha256(s3fs.S3FileSystem().cat_file(sys.argv[1])).hexdigest())"
)
S3_COUNT = "import sys, s3fs; print(len(s3fs.S3FileSystem().glob(sys.argv[1] + '/chunks/*.json')))"


KV = """
import json, pickle, sys, time, ray
from ray.experimental import internal_kv as kv
ray.init(address=sys.argv[1], log_to_driver=False)
prefix, ns = sys.argv[2], sys.argv[3]
if sys.argv[4] == "plant":  # a killed flow's board, a report left without a board, a live run's board
    kv._internal_kv_put(f"{prefix}/0badc0ffee00/board", pickle.dumps({"grants": {}}), namespace=ns)
    kv._internal_kv_put(f"{prefix}/0badc0ffee01/reports/w", pickle.dumps({}), namespace=ns)
    fresh = pickle.dumps({"grants": {}, "written_at": time.time()})
    kv._internal_kv_put(f"{prefix}/0badc0ffee02/board", fresh, namespace=ns)
print(json.dumps(sorted(key.decode() for key in kv._internal_kv_list(prefix, namespace=ns))))
"""
LIVE_BOARD = f"{PREFIX}/0badc0ffee02/board"


def _share_keys(world: RayWorld, plant: bool = False) -> list[str]:
    """The share channel keys in the cluster's key-value store (after planting others' leftovers)."""
    what = "plant" if plant else "list"
    args = [sys.executable, "-c", KV, world.ray_address, PREFIX, RAY_NAMESPACE.decode(), what]
    return json.loads(world.run(args, env=world.env(), timeout=120).check().stdout.strip().splitlines()[-1])


HOLD = """
import json, os, sys, time, psutil, ray
ray.init(address=sys.argv[1], log_to_driver=False)
def hold(seconds):
    start = time.time()
    time.sleep(seconds)
    return os.getpid(), start, time.time()
"""
RUN_OWN = (
    HOLD
    + """
from rollflow.flows.engines import _ray_calls
from rollflow.settings.models import EngineSettings
def workers():
    titles = ("ray::ChunkWorker", "ray::hold")
    procs = psutil.process_iter(["cmdline"])  # a zombie's cmdline is None here, not an error
    return [p.pid for p in procs if " ".join(p.info["cmdline"] or []).startswith(titles)]
with _ray_calls(EngineSettings(runner="ray", ray_address=sys.argv[1])) as (submit, result, *_):
    calls = [submit(hold, f"hold-{i}", 2.0) for i in range(4)]
    spans = [result(call) for call in calls]
deadline = time.monotonic() + 30
while workers() and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"spans": spans, "left": workers()}))
"""
)


def two_calls_at_once(spans: list[list[float]]) -> None:
    """Each of the two workers ran two of the four (pid, start, end) calls, and ran them at once."""
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for pid, start, end in spans:
        by_pid.setdefault(int(pid), []).append((start, end))
    assert len(by_pid) == 2, by_pid  # one worker per CPU
    for calls in by_pid.values():
        assert len(calls) == 2, by_pid
        (a0, a1), (b0, b1) = calls
        assert max(a0, b0) < min(a1, b1), f"one worker ran its two calls one after the other: {by_pid}"


@pytest.mark.alone  # two 2 s calls must overlap
def test_a_runs_own_ray_workers_run_two_chunk_calls_at_once_and_end_with_it(ray_world: RayWorld) -> None:
    """Ray's tasks ran one chunk at a time per worker process: its slots idled from each chunk's tail to
    the next chunk's start. A run's own workers run two, as a Dask worker's two threads, and end with it."""
    args = [sys.executable, "-c", RUN_OWN, ray_world.ray_address]
    out = json.loads(ray_world.run(args, env=ray_world.env(), timeout=180).check().stdout.splitlines()[-1])
    two_calls_at_once(out["spans"])
    assert out["left"] == [], "the run's own workers outlived it"


def _chunk_workers(world: RayWorld) -> list[int]:
    """A run's chunk worker processes: a worker's title names one of its chunks, or none (it runs two at a
    time, and Ray titles a process by its newest call, or by its class again when a call ends)."""
    return sorted(set(world.pids("ray::ChunkWorker") + world.pids("ray::collect-chunk")))


def _stats(world: RayWorld, url: str) -> dict:
    return json.loads(world.run([sys.executable, "-c", STATS, url], timeout=30).check().stdout)


def _wait_for(
    predicate, what: str, timeout_s: float = 120, world: RayWorld | None = None, run: int = 0
) -> None:
    """Until `predicate`; with `world` and `run`, a run that ends first, or the timeout, shows its output."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if world is not None and not (state := world.wait(run, timeout=0.01)).running:
            raise AssertionError(f"{what}: the run ended, rc={state.rc}\n{state.stderr[-3000:]}")
        time.sleep(0.2)
    tail = "" if world is None else world.wait(run, timeout=0.01).stderr[-3000:]
    raise TimeoutError(f"{what}\n{tail}")


def _ray_run(world: RayWorld, rows: Path, out: str, sim: str, *extra: str) -> int:
    args = [ROLLFLOW, *run_args(rows, out, SimpleNamespace(url=sim)), "--runner", "ray",
            "--ray-address", world.ray_address, *extra]  # fmt: skip
    return world.spawn(args, env=world.env())


def test_ray_publishes_the_local_bytes_on_s3_when_a_worker_process_is_killed(
    ray_world: RayWorld, rows_input: Path, reference: bytes
) -> None:
    sim = ray_world.simulate(["--latency-ms", "20", "--slots", "16"])
    url = f"{ray_world.bucket(f'rf-{secrets.token_hex(4)}')}/out"
    run = _ray_run(ray_world, rows_input, url, sim)
    _wait_for(lambda: _stats(ray_world, sim)["completed"] >= 600, "the run made no progress")
    victim = _chunk_workers(ray_world)[0]
    assert ray_world.kill(pid=victim, signal=9)
    result = ray_world.wait(run, timeout=300)
    assert result.rc == 0, result.stderr[-3000:]
    data = ray_world.run([sys.executable, "-c", S3_SHA, f"{url}/rollouts.jsonl"], timeout=60).check()
    assert data.stdout.strip() == hashlib.sha256(reference).hexdigest()
    count = ray_world.run([sys.executable, "-c", S3_COUNT, url], timeout=60).check()
    assert int(count.stdout) == -(-ROWS // 40)
    assert _stats(ray_world, sim)["max_in_flight_seen"] <= 16
    sockets = ray_world.sockets()
    assert sockets["non_loopback"] == [], sockets["non_loopback"]


@pytest.mark.alone  # the joining node must get chunks before the run ends
def test_ray_limit_below_the_workers_holds_when_a_node_joins_mid_run(
    ray_world: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    """--parallelism 1 over two nodes, then a third node joins: it gets chunks, the backend never sees a
    second request at once, and the report counts every worker's rollouts."""
    node_joins_mid_run(ray_world, rows_input, tmp_path)


def node_joins_mid_run(world: RayWorld, rows_input: Path, tmp_path: Path, *extra: str) -> None:
    sim = world.simulate(["--latency-ms", "10", "--slots", "4"])
    out = tmp_path / "out"
    run = _ray_run(world, rows_input, str(out), sim, "--parallelism", "1", "--limit", "600",
                   "--chunk-size", "20", *extra)  # fmt: skip
    _wait_for(lambda: len(list(out.glob("chunks/*.json"))) >= 1, "no chunk committed")
    node = [str(Path(sys.executable).with_name("ray")), "start", f"--address={world.ray_address}",
            "--num-cpus=1", "--object-store-memory=134217728", "--node-ip-address=127.0.0.1",
            "--disable-usage-stats", "--block"]  # fmt: skip
    joined = world.spawn(node, env=world.env())
    try:
        result = world.wait(run, timeout=300)
    finally:
        # SIGTERM: `ray start --block` then stops its node's raylet and agents, which leave the cluster.
        # SIGKILL left them behind, a node that took tasks it could not start for the next run.
        world.kill(id=joined, signal=15)
        if world.wait(joined, timeout=30).running:
            world.kill(id=joined, signal=9)
    assert result.rc == 0, result.stderr[-3000:]
    assert _stats(world, sim)["max_in_flight_seen"] == 1
    report = json.loads((out / "report.json").read_text())
    assert sum(w["rollouts"] for w in report["workers"]) == 1200
    assert len([w for w in report["workers"] if w["rollouts"]]) == 3, report["workers"]
    assert report["metrics"]["peak_in_flight"] == 1


HANG = (
    "import json, sys, urllib.request; urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "
    "'/admin/config', data=json.dumps({'fault_rate': 1.0, 'fault_kinds': ['hang']}).encode(), "
    "method='POST'), timeout=10).read()"
)


@pytest.mark.alone  # counts requests in a time window
def test_ray_a_hung_replica_is_found_once_for_every_worker(
    ray_world: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    """One replica starts hanging mid-run: once a worker takes it out, no worker's chunk sends it work
    again; it gets only the trials that check whether it is back (as on Dask, through the Ray actor)."""
    good = ray_world.simulate(["--latency-ms", "20", "--slots", "8"])
    hung = ray_world.simulate(["--latency-ms", "20", "--hang-s", "30"])
    out = tmp_path / "out"
    run = _ray_run(ray_world, rows_input, str(out), good, "--backend-url", f"{good},{hung}", "--timeout-s",
                   "1", "--parallelism", "16", "--chunk-size", "20", "--limit", "600")  # fmt: skip
    _wait_for(
        lambda: len(list(out.glob("chunks/*.json"))) >= 2, "no chunk committed", world=ray_world, run=run
    )
    ray_world.run([sys.executable, "-c", HANG, hung], timeout=30).check()
    time.sleep(2 * 1.0 + 1.0)  # a request timeout to find it, one more for requests already sent
    seen, t_seen = _stats(ray_world, hung)["requests"], time.monotonic()
    result = ray_world.wait(run, timeout=300)
    rest_s = time.monotonic() - t_seen
    assert result.rc == 0, result.stderr[-3000:]
    later = _stats(ray_world, hung)["requests"] - seen
    report = json.loads((out / "report.json").read_text())
    workers = len(report["workers"])
    # Trials only: the worker that took it out tries it every BACKOFF_MAX_S, the others every
    # FOLLOWED_TRIAL_S. Finding it anew in each chunk would cost STREAK_OUT requests per chunk.
    trials = workers * (1 + rest_s / BACKOFF_MAX_S + rest_s / FOLLOWED_TRIAL_S)
    chunks = len(list(out.glob("chunks/*.json")))
    assert later <= trials, f"{later} requests to the hung replica in {rest_s:.1f} s ({chunks} chunks)"
    rows = {row["url"]: row for row in report["endpoints"]}
    assert rows[hung]["out_of_rotation_s"] > 0 and report["audit_ok"]


@pytest.mark.parametrize("address", [None, "ray://127.0.0.1:1"])
def test_ray_without_the_extra_says_how_to_install_it(
    run_cli, fast_sim, rows_input, tmp_path, address
) -> None:
    """Where prefect-ray and Ray's gRPC are not installed (packages that fail to import stand in for them
    here); with an address too, whose check speaks gRPC (it ended in ModuleNotFoundError's traceback)."""
    for name in ("prefect_ray", "grpc"):
        shadow = tmp_path / "shadow" / name
        shadow.mkdir(parents=True)
        (shadow / "__init__.py").write_text(f"raise ImportError(\"No module named '{name}'\")\n")
    args = [*run_args(rows_input, str(tmp_path / "out"), fast_sim), "--runner", "ray"]
    args += ["--ray-address", address] if address else []
    res = run_cli(*args, env={"PYTHONPATH": str(tmp_path / "shadow")})
    assert res.returncode == 2, res.stderr
    assert "pip install 'rollflow[ray]'" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_ray_at_an_address_where_nothing_answers_is_a_usage_error(
    run_cli, fast_sim, rows_input, tmp_path, scheme
) -> None:
    """Ray retries a dead address for ever (a run hung past SIGTERM): the address is tried first."""
    address = f"{scheme}127.0.0.1:{free_port()}"
    args = [
        *run_args(rows_input, str(tmp_path / "out"), fast_sim),
        "--runner",
        "ray",
        "--ray-address",
        address,
    ]
    started = time.monotonic()
    res = run_cli(*args, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"--ray-address {address}: nothing answers there" in res.stderr, res.stderr[-3000:]
    assert time.monotonic() - started < 60 and not (tmp_path / "out").exists()
    res = run_cli("ray-workers", "--ray-address", address, "--keep-s", "60", timeout=120)
    assert res.returncode == 2 and "nothing answers there" in res.stderr, res.stderr[-3000:]


def test_ray_at_a_port_that_is_not_rays_or_an_address_of_another_scheme_is_a_usage_error(
    run_cli, fast_sim, rows_input, tmp_path
) -> None:
    """A web server's port passed the TCP check and Ray retried it for 13 minutes, past SIGTERM; http://
    and tcp:// reached Ray, which raised mid-run."""
    web = fast_sim.url.removeprefix("http://").rstrip("/")
    out = tmp_path / "out"
    for address, said in (
        (web, f"--ray-address {web}: nothing answers there (no Ray server"),
        (f"ray://{web}", f"--ray-address ray://{web}: nothing answers there (no Ray server"),
        ("http://127.0.0.1:6379", "not a Ray cluster's address"),
        ("tcp://127.0.0.1:6379", "not a Ray cluster's address"),
    ):
        started = time.monotonic()
        res = run_cli(*run_args(rows_input, str(out), fast_sim), "--runner", "ray", "--ray-address", address)
        assert res.returncode == 2 and said in res.stderr, res.stderr[-3000:]
        assert time.monotonic() - started < 60 and not out.exists()
    res = run_cli("ray-workers", "--ray-address", "http://127.0.0.1:6379", "--keep-s", "60")
    assert res.returncode == 2 and "not a Ray cluster's address" in res.stderr, res.stderr[-3000:]


def test_a_flow_run_not_started_by_the_cli_fails_at_once_where_nothing_answers() -> None:
    """A deployment's run (`rollflow serve`, the UI) never passes the CLI's check: the engine checks too,
    before Ray's connect, which would wait for ever."""
    from rollflow.flows.engines import EngineUnavailable, open_engine
    from rollflow.settings.models import EngineSettings

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    engine = open_engine(EngineSettings(runner="ray", ray_address=address), "k", 1)
    with pytest.raises(EngineUnavailable, match=f"--ray-address {address}: nothing answers there"), engine:
        pass
    assert time.monotonic() - started < 30


def test_ray_address_auto_with_no_cluster_to_join_is_a_usage_error(
    cli_env: dict[str, str], rows_input: Path, tmp_path: Path
) -> None:
    """`auto` joins a running cluster (RAY_ADDRESS, else the last `ray start` on this machine): with none,
    prefect-ray started a throwaway local instance (`ray-workers` said "2 of 2 up" for workers that ended
    with it); with a stale address left by a cluster that is gone, Ray waited for ever. Both exit 2 first.
    In a namespace of its own, so no other test's Ray processes are found."""
    if reason := unshare_permitted():
        pytest.skip(reason)
    ray_tmp = tmp_path / "ray-tmp"
    env = {k: v for k, v in cli_env.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}
    dead = SimpleNamespace(url="http://127.0.0.1:9")
    run = [ROLLFLOW, *run_args(rows_input, str(tmp_path / "out"), dead), "--runner", "ray"]
    workers = [ROLLFLOW, "ray-workers", "--keep-s", "60"]

    def in_namespace(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        script = 'ip link set lo up && exec "$@"'
        cmd = [*UNSHARE, "sh", "-c", script, "sh", *args]
        return subprocess.run(cmd, env=env | extra, capture_output=True, text=True, timeout=120)

    for args in ([*run, "--ray-address", " AUTO"], [*workers, "--ray-address", "auto"]):
        res = in_namespace(*args)
        assert res.returncode == 2, res.stdout + res.stderr[-3000:]
        assert "--ray-address auto: no running Ray cluster to join" in res.stderr, res.stderr[-3000:]
        assert "warm Ray chunk workers up" not in res.stdout
    dead = f"127.0.0.1:{free_port()}"
    for args, address, said in (
        (run, " Auto ", "RAY_ADDRESS auto: no running Ray cluster to join"),
        ([*run, "--ray-address", "auto"], "auto", "--ray-address auto: no running Ray cluster to join"),
        (run, f"ray://{dead}", f"RAY_ADDRESS ray://{dead}: nothing answers there"),  # ray.init reads it
        ([*run, "--ray-address", "auto"], f"ray://{dead}", f"auto (found at ray://{dead}): nothing answers"),
        ([*run, "--ray-address", "head-without-port"], "", "not a Ray cluster's address"),
    ):
        res = in_namespace(*args, RAY_ADDRESS=address)
        assert res.returncode == 2 and said in res.stderr, res.stdout + res.stderr[-3000:]
    (ray_tmp / "ray").mkdir(parents=True)
    stale = f"127.0.0.1:{free_port()}"
    (ray_tmp / "ray" / "ray_current_cluster").write_text(stale)
    started = time.monotonic()
    for args in ([*run, "--ray-address", "auto"], [*workers, "--ray-address", "auto"]):
        res = in_namespace(*args)
        assert res.returncode == 2, res.stdout + res.stderr[-3000:]
        assert f"--ray-address auto (found at {stale}): nothing answers there" in res.stderr, res.stderr
    assert time.monotonic() - started < 90 and not (tmp_path / "out").exists()


RESET = "import sys, urllib.request; urllib.request.urlopen(urllib.request.Request(sys.argv[1] + '/stats/reset', method='POST'), timeout=10).read()"  # noqa: E501


@pytest.mark.alone  # needs more than 4 requests at once
def test_ray_a_replica_out_of_rotation_leaves_the_whole_limit_on_the_others(
    ray_world: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    """--parallelism 16 over a dead replica and a live one (8 + 8): with the dead one out, the live one
    gets the run's 8, not 4 (each worker's share used to be spread over both and capped at the live part)."""
    sim = ray_world.simulate(["--latency-ms", "20", "--slots", "32"])
    out = tmp_path / "out"
    assert LIVE_BOARD in _share_keys(ray_world, plant=True)
    run = _ray_run(ray_world, rows_input, str(out), sim, "--backend-url", f"http://127.0.0.1:9,{sim}",
                   "--limit", "600")  # fmt: skip
    _wait_for(
        lambda: len(list(out.glob("chunks/*.json"))) >= 1, "no chunk committed", world=ray_world, run=run
    )
    ray_world.run([sys.executable, "-c", RESET, sim], timeout=30).check()
    result = ray_world.wait(run, timeout=300)
    assert result.rc == 0, result.stderr[-3000:]
    seen = _stats(ray_world, sim)["max_in_flight_seen"]
    assert 4 < seen <= 8, f"{seen} requests at once on the live replica"
    # its own channel deleted at its end, what killed flows left deleted at its start, a live run's kept
    assert _share_keys(ray_world) == [LIVE_BOARD]


def client_run(world: RayWorld, rows: Path, out: Path, sim: str, *extra: str) -> RunResult:
    """A run with --ray-address ray:// (its head runs without gRPC's fork handlers: see World._ray_env)."""
    args = [ROLLFLOW, *run_args(rows, str(out), SimpleNamespace(url=sim)), "--runner", "ray",
            "--ray-address", f"ray://127.0.0.1:{RAY_CLIENT_PORT}", *extra]  # fmt: skip
    return world.wait(world.spawn(args, env=world.env()), timeout=240)


def test_ray_client_address_runs_within_the_limit(
    ray_world: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    """--ray-address ray://: the flow is a Ray client, with no GCS client of its own; the share book still
    reaches the workers (it used to hang with no request sent) and holds the limit."""
    sim = ray_world.simulate(["--latency-ms", "10", "--slots", "32"])
    out = tmp_path / "out"
    result = client_run(ray_world, rows_input, out, sim, "--parallelism", "8")
    assert result.rc == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["rows_written"] == 2 * ROWS  # --num-repeats 2
    assert 1 <= _stats(ray_world, sim)["max_in_flight_seen"] <= 8
    assert set(_share_keys(ray_world)) <= {LIVE_BOARD}, "the run's share channel was left on the cluster"


HOLD_CPUS = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
@ray.remote(num_cpus=1)
class Holder:
    def up(self):
        return True
holders = [Holder.remote() for _ in range(int(ray.cluster_resources()["CPU"]))]
ray.get([h.up.remote() for h in holders])
print("held", flush=True)
time.sleep(300)
"""


@pytest.mark.alone  # a warning after 20 s with no CPU free
def test_a_run_with_no_cpu_free_for_its_workers_says_so_and_starts_once_one_is(
    ray_world: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    """Every CPU held by other Ray work: the run waited without a word; it says why, then runs."""
    holder = ray_world.spawn([sys.executable, "-c", HOLD_CPUS, ray_world.ray_address], env=ray_world.env())
    try:
        _wait_for(lambda: "held" in ray_world.wait(holder, timeout=0.01).stdout, "the CPUs were not held")
        sim = ray_world.simulate(["--latency-ms", "5", "--slots", "16"])
        out = tmp_path / "out"
        run = _ray_run(ray_world, rows_input, str(out), sim, "--limit", "200")
        said = "no Ray chunk worker has started in 20 s: the cluster has 2 CPUs, 0 of them free"
        _wait_for(
            lambda: said in ray_world.wait(run, timeout=0.01).stderr,
            "no word of the wait",
            90,
            ray_world,
            run,
        )
        assert not list(out.glob("chunks/*.json")), "a chunk ran with no CPU free"
    finally:
        ray_world.kill(id=holder, signal=9)
    result = ray_world.wait(run, timeout=300)
    assert result.rc == 0, result.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["rows_written"] == 2 * 200


@pytest.mark.alone  # each refusal within 30 s
def test_rays_client_port_as_a_gcs_address_or_its_gcs_port_as_ray_client_is_a_usage_error(
    ray_world: RayWorld, rows_input: Path, tmp_path: Path
) -> None:
    """Both ports answer gRPC, so both passed the check and failed after 22-32 s with Ray's own error
    (exit 1); they are named for what they are, before anything runs."""
    gcs = ray_world.ray_address
    host = gcs.rpartition(":")[0]
    for address, said in (
        (f"{host}:{RAY_CLIENT_PORT}", "a gRPC server, but not Ray's GCS (Ray's client port?"),
        (f"ray://{gcs}", "the head's GCS port, not Ray's client server"),
    ):
        args = [
            ROLLFLOW,
            *run_args(rows_input, str(tmp_path / "out"), SimpleNamespace(url="http://127.0.0.1:9")),
        ]
        started = time.monotonic()
        result = ray_world.run(
            [*args, "--runner", "ray", "--ray-address", address], env=ray_world.env(), timeout=120
        )
        assert result.rc == 2 and f"--ray-address {address}: {said}" in result.stderr, result.stderr[-3000:]
        assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()
    workers = [ROLLFLOW, "ray-workers", "--ray-address", "local", "--keep-s", "60"]
    result = ray_world.run(workers, env=ray_world.env(), timeout=120)
    assert result.rc == 2 and "warm workers would end with the local instance" in result.stderr, result.stderr


SLOW_VERIFIER = """
import asyncio, os, pathlib

VICTIM = pathlib.Path(__file__).with_name("victim.pid")

# exact_match, slowly; the first check of task 0 (answer 1.0) writes its process id and waits to be killed
# (60 s at most), so the kill lands in the middle of that chunk.
async def verify(row, text):
    if row["expected_answer"] == "1.0" and not VICTIM.exists():
        VICTIM.write_text(str(os.getpid()))
        await asyncio.sleep(60)
    await asyncio.sleep(0.05)
    return 1.0 if text.rstrip().endswith("\\\\boxed{" + row["expected_answer"] + "}") else 0.0
"""


@pytest.fixture(scope="module")
def reverify_source(ray_world: RayWorld, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reverify_source(ray_world, tmp_path_factory)


def make_reverify_source(ray_world: RayWorld, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded collection scored with exact_match, made inside the world (its simulator stopped after),
    with a slow verifier module beside it; the folder holds rows.jsonl, the module and out/."""
    base = tmp_path_factory.mktemp("ray-reverify")
    (base / "slow_verifier_ray.py").write_text(SLOW_VERIFIER)
    rows_file = write_sum_rows(base / "rows.jsonl", TASKS)
    sim = ray_world.simulate_full(["--latency-ms", "1", "--slots", "64"])
    try:
        args = collect_args(rows_file, base / "out", sim["url"], "exact_match")
        ray_world.run([ROLLFLOW, *args], env=ray_world.env(), timeout=180).check()
    finally:
        ray_world.kill(id=sim["id"], signal=9)
    return base


def _reverify(source: Path, out: Path, *extra: str) -> list[str]:
    return [ROLLFLOW, "reverify", str(source), "--output", str(out), *extra]


def test_ray_reverify_publishes_the_local_reverifys_rows(ray_world: RayWorld, reverify_source: Path) -> None:
    """`reverify --runner ray` with another verifier: the same bytes as the local runner's reverify (new
    rewards, responses unchanged, old rewards under _rf), and the source unchanged."""
    source, base = reverify_source / "out", reverify_source
    before = tree_digest(source)
    args = ("--verifier", "math_fast", "--chunk-size", "25")
    local = ray_world.run(_reverify(source, base / "local", *args), env=ray_world.env(), timeout=180)
    assert local.check().rc == 0
    ray = ray_world.run(
        _reverify(source, base / "ray", *args, "--runner", "ray", "--ray-address", ray_world.ray_address),
        env=ray_world.env(),
        timeout=240,
    )
    assert ray.rc == 0, ray.stderr[-3000:]
    published = (base / "ray" / "rollouts.jsonl").read_bytes()
    assert published == (base / "local" / "rollouts.jsonl").read_bytes()
    old, new = rows(source / "rollouts.jsonl"), rows(base / "ray" / "rollouts.jsonl")
    assert len(new) == TASKS * REPEATS
    assert [r["response"] for r in new] == [r["response"] for r in old]
    assert [r["_rf"]["previous_reward"] for r in new] == [r["reward"] for r in old]
    assert any(a["reward"] != b["reward"] for a, b in zip(old, new, strict=True))  # 7.0 is 7 to math_fast
    assert tree_digest(source) == before
    report = json.loads((base / "ray" / "report.json").read_text())
    assert report["metrics"]["chunks_run"] == len(list((base / "ray" / "chunks").glob("*.json"))) > 1
    assert ray_world.sockets()["non_loopback"] == []


def test_ray_reverify_ends_exactly_once_when_a_worker_process_is_killed(
    ray_world: RayWorld, reverify_source: Path
) -> None:
    """The Ray worker process scoring chunk 0 SIGKILLed in the middle of it: the chunk runs again, every
    rollout is published once and scored as the slow verifier scores (exact_match's rewards)."""
    source, out = reverify_source / "out", reverify_source / "killed"
    ray = ("--runner", "ray", "--ray-address", ray_world.ray_address)
    args = _reverify(source, out, "--verifier", "slow_verifier_ray:verify", "--chunk-size", "20",
                     "--parallelism", "1", *ray)  # fmt: skip
    # The command imports the module from PYTHONPATH; Ray's workers from the command's directory.
    env = {**ray_world.env(), "PYTHONPATH": str(reverify_source)}
    run = ray_world.spawn(args, env=env, cwd=str(reverify_source))
    victim = reverify_source / "victim.pid"
    _wait_for(victim.exists, "chunk 0 never started", world=ray_world, run=run)
    pid = int(victim.read_text())
    assert pid in ray_world.pids("ray::reverify-chunk")  # a Ray worker process, in chunk 0's task
    assert ray_world.kill(pid=pid, signal=9)
    result = ray_world.wait(run, timeout=240)
    assert result.rc == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"]["chunks_run"] == len(list((out / "chunks").glob("*.json"))) > 1
    expected = [
        (r["_ng_task_index"], r["_ng_rollout_index"], r["reward"]) for r in rows(source / "rollouts.jsonl")
    ]
    published = rows(out / "rollouts.jsonl")
    assert [(r["_ng_task_index"], r["_ng_rollout_index"], r["reward"]) for r in published] == expected
    assert report["rows_written"] == TASKS * REPEATS and report["failed"] == 0


def _unclosed_sessions(world: RayWorld) -> int:
    """aiohttp's "Unclosed client session" warnings in the Ray workers' logs so far."""
    logs = (p for p in (world.root / "ray").rglob("worker-*") if p.is_file())
    return sum(p.read_bytes().count(b"Unclosed client session") for p in logs)


def test_ray_reverify_with_the_http_verifier_closes_each_chunks_session(
    ray_world: RayWorld, reverify_source: Path
) -> None:
    """`--verifier http` on Ray workers: the rows of the local runner's reverify, and each chunk task's
    aiohttp session closed on the task's own loop (a session left open warns in the worker's log)."""
    sim = ray_world.simulate_full(["--latency-ms", "1", "--slots", "64"])
    source, base = reverify_source / "out", reverify_source
    args = ("--verifier", "http", "--verifier-url", sim["url"], "--chunk-size", "25")
    ray = ("--runner", "ray", "--ray-address", ray_world.ray_address)
    try:
        ray_world.run(_reverify(source, base / "http-local", *args), env=ray_world.env(), timeout=180).check()
        before = _unclosed_sessions(ray_world)
        result = ray_world.run(
            _reverify(source, base / "http-ray", *args, *ray), env=ray_world.env(), timeout=240
        )
    finally:
        ray_world.kill(id=sim["id"], signal=9)
    assert result.rc == 0, result.stderr[-3000:]
    published = (base / "http-ray" / "rollouts.jsonl").read_bytes()
    assert published == (base / "http-local" / "rollouts.jsonl").read_bytes()
    assert {r["_rf"]["reverified_with"] for r in rows(base / "http-ray" / "rollouts.jsonl")} == {"http"}
    assert _unclosed_sessions(ray_world) == before
