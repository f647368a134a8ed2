"""`--backend-url a,b`: the endpoint table in report.json, report.md and the CLI; all replicas down."""

from __future__ import annotations

import urllib.request

import orjson
from rollout_data import assert_complete, write_rows

from rollflow.infra.local import free_port, spawn_simulator


def _args(inp: object, out: object, urls: str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", urls,
        "--chunk-size", "50", "--no-progress", *extra,
    ]  # fmt: skip


def _latest_artifact(server: object, key: str) -> dict:
    body = {"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC", "limit": 1}
    req = urllib.request.Request(
        f"{server.url}/api/artifacts/filter",  # type: ignore[attr-defined]
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    return orjson.loads(urllib.request.urlopen(req, timeout=30).read())[0]


def test_two_replicas_share_the_run_and_the_report_has_their_table(run_cli, prefect_server, tmp_path):
    sims = [
        spawn_simulator("--slots", "16", "--latency-ms", "5", "--metrics-format", fmt)
        for fmt in ("vllm", "none")
    ]
    try:
        inp = write_rows(tmp_path / "rows.jsonl", 200)
        out = tmp_path / "out"
        urls = ",".join(sim.url for sim in sims)
        res = run_cli(*_args(inp, out, urls, "--parallelism", "17", "--num-repeats", "2"))
    finally:
        for sim in sims:
            sim.stop()
    assert res.returncode == 0, res.stderr
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 200, 2)
    report = orjson.loads((out / "report.json").read_bytes())
    rows = report["endpoints"]
    assert [r["url"] for r in rows] == [sim.url for sim in sims]
    assert [r["limit"] for r in rows] == [9, 8]
    assert sum(r["rollouts"] for r in rows) == 400 and all(r["rollouts"] > 0 for r in rows)
    assert all(r["rollouts_per_s"] > 0 and r["errors"] == 0 for r in rows)
    # Sampled while collecting: the replica serving vLLM's /metrics has engine peaks, the other none.
    peaks = {"running_max", "waiting_max", "kv_cache_usage_max", "preemptions", "prefix_cache_hit_rate"}
    assert set(rows[0]["engine"]) == peaks, rows[0]
    assert rows[0]["engine"]["running_max"] >= 0 and rows[1]["engine"] is None
    markdown = (out / "report.md").read_text()
    assert "## Endpoints" in markdown and all(sim.url in markdown for sim in sims)
    table = res.stderr[res.stderr.index("endpoints") :]
    assert all(sim.url in table for sim in sims), res.stderr
    artifact = _latest_artifact(prefect_server, "rollflow-endpoints")
    cells = orjson.loads(artifact["data"])
    assert [c["endpoint"] for c in cells] == [sim.url for sim in sims]
    assert [c["rollouts"] for c in cells] == [f"{r['rollouts']:,}" for r in rows]


def test_all_replicas_failing_take_the_usual_failure_path(run_cli, tmp_path):
    sims = [
        spawn_simulator("--fault-rate", "1", "--fault-kinds", "500", "--latency-ms", "1") for _ in range(2)
    ]
    try:
        inp = write_rows(tmp_path / "rows.jsonl", 20)
        out = tmp_path / "out"
        urls = ",".join(sim.url for sim in sims)
        env = {"ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.01"}
        res = run_cli(
            *_args(inp, out, urls, "--parallelism", "4", "--max-retries", "2"), env=env, timeout=120
        )
    finally:
        for sim in sims:
            sim.stop()
    assert res.returncode == 1, res.stderr
    message = " ".join(res.stderr.split())
    assert "not published" in message and "20 failed after retries" in message, res.stderr
    failures = [
        orjson.loads(line) for p in (out / "failures").glob("*.jsonl") for line in p.read_bytes().splitlines()
    ]
    # 3 counted attempts each; a failure on a replica that had just left rotation, while the other
    # was still in, is retried without counting, at most 3 per endpoint.
    attempts = [f["error"]["attempts"] for f in failures]
    assert len(failures) == 20 and all(3 <= n <= 3 + 3 * 2 for n in attempts), attempts
    rows = orjson.loads((out / "report.json").read_bytes())["endpoints"]
    assert sum(r["errors"] for r in rows) == sum(attempts) and all(r["rollouts"] == 0 for r in rows)
    assert all(r["out_of_rotation_s"] > 0 for r in rows)


def test_all_replicas_unreachable_stop_before_any_request(run_cli, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    urls = f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}"
    res = run_cli(*_args(inp, tmp_path / "out", urls, "--parallelism", "4"), timeout=60)
    assert res.returncode == 2
    message = " ".join(res.stderr.split())
    assert "All 2 backend endpoints are unreachable" in message and "--backend-url" in message, res.stderr
    assert "Traceback" not in res.stderr


def test_a_bad_url_list_names_the_item(run_cli, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    res = run_cli(*_args(inp, tmp_path / "out", "http://127.0.0.1:1,,http://127.0.0.1:2"), timeout=60)
    assert res.returncode == 2
    assert "item 2" in res.stderr and "is empty" in res.stderr and "Traceback" not in res.stderr


def test_the_report_keeps_the_parallelism_set_when_a_replica_is_lost(run_cli, tmp_path):
    """A run at 8 whose second replica failed every request reported `parallelism 4`, the limit at its end;
    it reports 8, and the limit at the end beside it."""
    good = spawn_simulator("--latency-ms", "1")
    bad = spawn_simulator("--fault-rate", "1", "--fault-kinds", "500", "--latency-ms", "1")
    try:
        inp = write_rows(tmp_path / "rows.jsonl", 40)
        out = tmp_path / "out"
        env = {"ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.01"}
        res = run_cli(*_args(inp, out, f"{good.url},{bad.url}", "--parallelism", "8"), env=env, timeout=120)
    finally:
        good.stop()
        bad.stop()
    assert res.returncode == 0, res.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["parallelism"] == 8 and report["metrics"]["limit_at_end"] == 4, report["metrics"]
