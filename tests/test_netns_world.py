"""The Ray harness works: a Prefect flow on RayTaskRunner spreads tasks over both nodes, all on loopback."""

from __future__ import annotations

import json
import sys

from fixtures_netns import RayWorld

# Runs inside the namespace as a driver on the head's address. The tasks sleep a little so the 4 of them
# overlap: with 1 logical CPU per node, two run at once and the scheduler must use both nodes.
TINY_FLOW = r"""
import json, os, sys, time
t0 = time.monotonic()
import ray
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter
from prefect_ray import RayTaskRunner

@task
def where(i: int) -> dict:
    time.sleep(0.5)
    return {
        "i": i,
        "pid": os.getpid(),
        "node": ray.get_runtime_context().get_node_id(),
        "api_url_env": os.environ.get("PREFECT_API_URL"),
    }

@flow(task_runner=RayTaskRunner(address=sys.argv[1]))
def tiny() -> list:
    return [f.result() for f in where.map(range(4))]

imported = time.monotonic()
state = tiny(return_state=True)
flow_s = time.monotonic() - imported
flow_run_id = state.state_details.flow_run_id
with get_client(sync_client=True) as client:
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
print(json.dumps({
    "results": state.result(),
    "state": state.type.value,
    "task_runs": [{"name": r.name, "state": r.state_type.value} for r in runs],
    "import_s": imported - t0,
    "flow_s": flow_s,
}))
"""

S3_AND_SIM = r"""
import json, sys, urllib.request
import s3fs
fs = s3fs.S3FileSystem()
fs.pipe(sys.argv[1] + "/x.txt", b"hello")
with urllib.request.urlopen(sys.argv[2] + "/health", timeout=5) as r:
    status = r.status
print(json.dumps({"s3": fs.cat(sys.argv[1] + "/x.txt").decode(), "sim": status}))
"""


def test_tiny_flow_uses_both_nodes_on_loopback_only(ray_world: RayWorld) -> None:
    result = ray_world.run([sys.executable, "-c", TINY_FLOW, ray_world.ray_address], timeout=180).check()
    out = json.loads(result.stdout.strip().splitlines()[-1])
    results = out["results"]
    assert out["state"] == "COMPLETED"
    assert sorted(r["i"] for r in results) == [0, 1, 2, 3]
    assert len({r["node"] for r in results}) == 2, results
    # The Ray nodes were started without PREFECT_API_URL; the task runs still reached the world's server.
    assert all(r["api_url_env"] is None for r in results)
    assert sorted(r["state"] for r in out["task_runs"]) == ["COMPLETED"] * 4
    print(
        f"world start {ray_world.startup_s:.1f}s {ray_world.timings}; flow {out['flow_s']:.1f}s "
        f"(driver imports {out['import_s']:.1f}s, run wall {result.elapsed_s:.1f}s); "
        f"task pids {sorted({r['pid'] for r in results})}"
    )
    sockets = ray_world.sockets()
    assert sockets["non_loopback"] == [], sockets["non_loopback"]
    assert "127.0.0.1" in sockets["addresses"]
    assert [line.split()[1] for line in sockets["ip_addr"].splitlines()] == ["lo", "lo"]


def test_world_commands(ray_world: RayWorld) -> None:
    """The other primitives a Ray test builds on: S3, the simulator, spawn/pids/kill/wait, run's timeout."""
    bucket = ray_world.bucket("rf-netns")
    sim = ray_world.simulate(["--latency-ms", "1"])
    out = ray_world.run([sys.executable, "-c", S3_AND_SIM, bucket, sim], timeout=60).check()
    assert json.loads(out.stdout) == {"s3": "hello", "sim": 200}

    spawned = ray_world.spawn(["sleep", "300"])
    (pid,) = ray_world.pids("sleep 300")
    assert ray_world.wait(spawned, timeout=0.2).running
    assert ray_world.kill(pid, 9)
    assert ray_world.wait(spawned, timeout=10).rc == -9

    slow = ray_world.run(["sleep", "30"], timeout=0.5)
    assert slow.timed_out and slow.rc == -9
    assert "PREFECT_API_URL" in ray_world.env()
