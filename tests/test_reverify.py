"""`rollflow reverify`: a published output scored again with another verifier, with no backend at all.

A seeded collection scored with exact_match, reverified with math_fast while the backend is stopped, equals
a fresh seeded collection scored with math_fast, reward for reward; a kill -9 mid-reverify resumes exactly
once; --failed-only rescores only the rollouts whose check failed.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import orjson
import pytest
from cli_runs import spawn, wait_until
from rollout_data import assert_complete, flaky_verifier, write_sum_rows

from rollflow.infra.local import free_port_block, spawn_simulator

pytestmark = pytest.mark.concurrent

TASKS, REPEATS = 40, 3

FLAKY = flaky_verifier("3")

SLOW = """
import asyncio

async def verify(row, text):
    await asyncio.sleep(0.01)
    return 1.0 if text.rstrip().endswith("\\\\boxed{" + row["expected_answer"] + "}") else 0.0
"""


def collect_args(inp: Path, out: Path, url: str, verifier: str) -> list[str]:
    return [
        "collect", "--input", str(inp), "--output", str(out), "--backend-kind", "chat", "--backend-url", url,
        "--num-repeats", str(REPEATS), "--parallelism", "16", "--chunk-size", "10", "--seed", "11",
        "--verifier", verifier, "--verify-processes", "0", "--no-progress",
    ]  # fmt: skip


def rows(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def rewards(path: Path) -> list[tuple[int, int, float]]:
    return [(r["_ng_task_index"], r["_ng_rollout_index"], r["reward"]) for r in rows(path)]


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def collections(run_cli, tmp_path_factory) -> dict[str, Path]:
    """The same seeded collection scored with exact_match, with math_fast, and with a verifier that fails
    on some rows (published with its gaps); the backend is stopped before any test reverifies."""
    base = tmp_path_factory.mktemp("reverify")
    (base / "flaky_verifier.py").write_text(FLAKY)
    (base / "slow_verifier_rv.py").write_text(SLOW)
    inp = write_sum_rows(base / "rows.jsonl", TASKS)
    # A port below the ephemeral range: one from free_port() can be taken by any outgoing connection
    # before the simulator binds it, and under load the fixture then errors with the server exited.
    sim = spawn_simulator("--latency-ms", "1", "--slots", "64", port=free_port_block(1))
    outs = {name: base / name for name in ("exact", "math_fast", "flaky", "parquet")}
    try:
        for name, verifier, extra in (
            ("exact", "exact_match", []),
            ("math_fast", "math_fast", []),
            ("parquet", "exact_match", ["--format", "parquet"]),
        ):
            res = run_cli(*collect_args(inp, outs[name], sim.url, verifier), *extra)
            assert res.returncode == 0, res.stderr
        res = run_cli(
            *collect_args(inp, outs["flaky"], sim.url, "flaky_verifier:verify"),
            "--allow-incomplete",
            env={"PYTHONPATH": str(base)},
        )
        assert res.returncode == 0, res.stderr  # published, with the failed checks left out
    finally:
        sim.stop()
    outs["base"] = base
    return outs


def test_reverify_with_the_backend_stopped_equals_a_fresh_collection(run_cli, collections, tmp_path) -> None:
    source, fresh = collections["exact"], collections["math_fast"]
    before = tree_digest(source)
    out = tmp_path / "rescored"
    res = run_cli(
        "reverify", str(source), "--output", str(out), "--verifier", "math_fast", "--chunk-size", "25"
    )
    assert res.returncode == 0, res.stderr
    assert rewards(out / "rollouts.jsonl") == rewards(fresh / "rollouts.jsonl")
    old, new = rows(source / "rollouts.jsonl"), rows(out / "rollouts.jsonl")
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), TASKS, REPEATS)
    assert [r["response"] for r in new] == [r["response"] for r in old]
    assert [r["_rf"]["previous_reward"] for r in new] == [r["reward"] for r in old]
    assert tree_digest(source) == before  # the source is never written
    report = orjson.loads((out / "report.json").read_bytes())
    changed = sum(a["reward"] != b["reward"] for a, b in zip(old, new, strict=True))
    assert 0 < changed == report["changed"]
    assert report["rows_written"] == TASKS * REPEATS and report["failed"] == 0
    table = report["agreement"]
    assert table["incorrect"]["correct"] == changed  # 7.0 against 7: only math_fast takes it
    assert sum(sum(row.values()) for row in table.values()) == TASKS * REPEATS
    fresh_report = orjson.loads((fresh / "report.json").read_bytes())
    assert report["after"]["pass_at_k"] == fresh_report["rewards"]["pass_at_k"]
    assert (out / "failures.jsonl").read_bytes() == b""
    assert "| incorrect |" in (out / "report.md").read_text()


def test_kill9_mid_reverify_resumes_exactly_once(run_cli, cli_env, collections, tmp_path) -> None:
    source, out = collections["exact"], tmp_path / "rescored"
    args = [
        "reverify", str(source), "--output", str(out), "--verifier", "slow_verifier_rv:verify",
        "--chunk-size", "6", "--parallelism", "1", "--chunks-in-flight", "1",
    ]  # fmt: skip
    env = {**cli_env, "PYTHONPATH": str(collections["base"])}
    chunks = out / "chunks"
    proc = spawn(args, env)
    try:
        wait_until(lambda: chunks.exists() and len(list(chunks.glob("*.json"))) >= 3, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    committed = {p.name: p.read_bytes() for p in chunks.glob("*.json")}
    assert 3 <= len(committed) < TASKS * REPEATS // 6
    res = run_cli(*args, env={"PYTHONPATH": str(collections["base"])})
    assert res.returncode == 0, res.stderr
    for name, manifest in committed.items():
        assert (chunks / name).read_bytes() == manifest  # committed chunks were not redone
    data = (out / "rollouts.jsonl").read_bytes()
    assert_complete(data.splitlines(), TASKS, REPEATS)
    expected = [(t, r, reward) for t, r, reward in rewards(source / "rollouts.jsonl")]
    assert rewards(out / "rollouts.jsonl") == expected  # the slow verifier scores as exact_match does


def test_failed_only_rescores_only_the_failed_checks(run_cli, collections, tmp_path) -> None:
    source = collections["flaky"]
    failed = [
        orjson.loads(line)
        for p in sorted((source / "failures").glob("*.jsonl"))
        for line in p.read_bytes().splitlines()
    ]
    assert failed and all(f["error"]["kind"] == "verifier" and "response" in f["output"] for f in failed)
    failed_keys = {(f["_ng_task_index"], f["_ng_rollout_index"]) for f in failed}
    published = {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in rows(source / "rollouts.jsonl")}
    assert len(published) + len(failed_keys) == TASKS * REPEATS
    out = tmp_path / "completed"
    res = run_cli("reverify", str(source), "--output", str(out), "--verifier", "exact_match", "--failed-only")
    assert res.returncode == 0, res.stderr
    data = (out / "rollouts.jsonl").read_bytes()
    assert_complete(data.splitlines(), TASKS, REPEATS)
    exact = {(t, r): w for t, r, w in rewards(collections["exact"] / "rollouts.jsonl")}
    collected = {
        (r["_ng_task_index"], r["_ng_rollout_index"]): r
        for r in rows(collections["exact"] / "rollouts.jsonl")
    }
    for row in rows(out / "rollouts.jsonl"):
        key = (row["_ng_task_index"], row["_ng_rollout_index"])
        if key in failed_keys:
            assert row["_rf"]["reverified_with"] == "exact_match" and row["_rf"]["previous_reward"] is None
            assert row["reward"] == exact[key]
            # it carries the _rf a collected row carries (attempts; the seed when seeded), as collected
            own = {k: v for k, v in row["_rf"].items() if k not in ("reverified_with", "previous_reward")}
            assert own == collected[key]["_rf"], (own, collected[key]["_rf"])
        else:
            assert row == published[key]  # untouched, not scored again
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["rescored"] == len(failed_keys) and report["changed"] == 0
    assert report["agreement"]["failed"]["correct"] + report["agreement"]["failed"]["incorrect"] == len(
        failed_keys
    )


def test_rollflow_serve_serves_the_reverify_flow() -> None:
    from rollflow.flows.serve import default_parameters, deployments
    from rollflow.settings import RollflowSettings

    served = deployments("test", default_parameters(RollflowSettings()), {})
    assert "rollflow-reverify" in {d.flow_name for d in served}
    schema = next(d for d in served if d.flow_name == "rollflow-reverify")._parameter_openapi_schema
    assert "ReverifySpec" in str(schema)


def test_parquet_holds_the_same_rollouts_and_rewards_as_jsonl(run_cli, collections, tmp_path) -> None:
    import pyarrow.dataset as pads

    source, fresh = collections["exact"], collections["math_fast"]
    out = tmp_path / "pq"
    res = run_cli(
        "reverify", str(source), "--output", str(out), "--verifier", "math_fast", "--format", "parquet"
    )
    assert res.returncode == 0, res.stderr
    assert not (out / "rollouts.jsonl").exists() and (out / "rollouts.tasks.jsonl").exists()
    table = pads.dataset(str(out / "data"), format="parquet").to_table()
    json_columns = set(orjson.loads(table.schema.metadata[b"rollflow.json_columns"]))
    assert {"response", "responses_create_params", "_rf"} <= json_columns
    back = [{k: orjson.loads(v) if k in json_columns else v for k, v in r.items()} for r in table.to_pylist()]
    assert [(r["_ng_task_index"], r["_ng_rollout_index"], r["reward"]) for r in back] == rewards(
        fresh / "rollouts.jsonl"
    )
    assert [r["response"] for r in back] == [r["response"] for r in rows(fresh / "rollouts.jsonl")]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["dataset"] == str(out / "data") and report["format"] == "parquet"
    meta = front_matter(out / "README.md")  # the card: its YAML parses, its figures are report.json's
    assert [f["name"] for f in meta["dataset_info"]["features"]] == table.schema.names
    assert meta["configs"][0]["data_files"][0]["path"] == "data/*.parquet"
    assert meta["rollflow"]["reward_mean"] == report["after"]["mean"]
    assert meta["rollflow"]["rollouts"] == report["rows_written"]
    assert meta["rollflow"]["tokens_out_mean"] == report["returned"]["tokens_out"]["mean"]


def test_reverify_of_a_parquet_output_equals_that_of_its_jsonl_twin(run_cli, collections, tmp_path) -> None:
    """The same seeded run published as Parquet and as JSONL: plain reverify of the Parquet output read
    its shards' rows (through the committed chunks they were written from) and publishes the same bytes."""
    source, twin = collections["parquet"], collections["exact"]
    before = tree_digest(source)
    outs = {name: tmp_path / name for name in ("from_parquet", "from_jsonl")}
    for name, src in (("from_parquet", source), ("from_jsonl", twin)):
        res = run_cli("reverify", str(src), "--output", str(outs[name]), "--verifier", "math_fast")
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = outs["from_parquet"], outs["from_jsonl"]
    for name in ("rollouts.jsonl", "rollouts.tasks.jsonl", "failures.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert_complete((a / "rollouts.jsonl").read_bytes().splitlines(), TASKS, REPEATS)
    assert rewards(a / "rollouts.jsonl") == rewards(collections["math_fast"] / "rollouts.jsonl")
    assert tree_digest(source) == before  # the source is never written
    mine, theirs = (orjson.loads((o / "report.json").read_bytes()) for o in (a, b))
    # the fingerprint of the shards' rows is the sha256 of the JSONL dataset the same run publishes
    assert mine["source"]["sha256"] == theirs["source"]["sha256"]
    assert mine["source"]["sha256"] == hashlib.sha256((twin / "rollouts.jsonl").read_bytes()).hexdigest()
    assert mine["source"]["mode"] == "shards" and mine["source"]["rows"] == TASKS * REPEATS
    for key in ("changed", "rows_written", "failed", "agreement", "after", "before"):
        assert mine[key] == theirs[key], key
    # run again: every chunk is committed, nothing is scored twice, the same bytes stay published
    published = (a / "rollouts.jsonl").read_bytes()
    res = run_cli("reverify", str(source), "--output", str(a), "--verifier", "math_fast")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (a / "rollouts.jsonl").read_bytes() == published
    assert orjson.loads((a / "report.json").read_bytes())["metrics"]["chunks_run"] == 0


def front_matter(card: Path) -> dict:
    import yaml

    text = card.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_the_collections_card_and_story_equal_report_json(collections) -> None:
    out = collections["exact"]
    report = orjson.loads((out / "report.json").read_bytes())
    meta = front_matter(out / "README.md")
    figures, story = meta["rollflow"], report["story"]
    assert meta["configs"][0]["data_files"][0]["path"] == "rollouts.jsonl"
    assert meta["dataset_info"]["splits"][0]["num_examples"] == report["rows_written"] == TASKS * REPEATS
    assert meta["size_categories"] == ["n<1K"]
    assert figures["reward_mean"] == report["rewards"]["mean"] and figures["tasks"] == TASKS
    assert figures["pass_at_k"] == report["rewards"]["pass_at_k"]
    assert figures["truncation_rate"] == story["returned"]["truncation_rate"]
    assert figures["tokens_out_mean"] == story["returned"]["tokens_out"]["mean"]
    data = rows(out / "rollouts.jsonl")
    tokens = sorted(r["response"]["usage"]["output_tokens"] for r in data)
    assert story["returned"]["tokens_out"]["total"] == sum(tokens)
    assert story["returned"]["tokens_out"]["max"] == tokens[-1]
    assert story["returned"]["tokens_out"]["p50"] == tokens[(len(tokens) + 1) // 2 - 1]
    assert sum(story["returned"]["finish_reasons"].values()) == len(data)
    assert story["sent"]["seed"] == 11 and story["scored_by"]["name"] == "exact_match"
    inp = collections["base"] / "rows.jsonl"
    assert story["origin"]["input_sha256"] == hashlib.sha256(inp.read_bytes()).hexdigest()
    assert story["origin"]["input_rows"] == TASKS
    tasks = [orjson.loads(line) for line in (out / "rollouts.tasks.jsonl").read_bytes().splitlines()]
    assert all("std_reward" in t for t in tasks)
    flaky = orjson.loads((collections["flaky"] / "report.json").read_bytes())
    assert flaky["story"]["returned"]["failures_by_kind"] == {"verifier": flaky["failed"]}
    assert "## The run's story" in (out / "report.md").read_text()


def test_a_parquet_collection_holds_the_jsonl_runs_rollouts(collections, tmp_path, monkeypatch) -> None:
    """The same seeded run published as Parquet: read with pyarrow and with `datasets`, row for row."""
    import pyarrow.dataset as pads

    datasets = pytest.importorskip("datasets")
    jsonl, out = rows(collections["exact"] / "rollouts.jsonl"), collections["parquet"]
    assert not (out / "rollouts.jsonl").exists()
    table = pads.dataset(str(out / "data"), format="parquet").to_table()
    json_columns = set(orjson.loads(table.schema.metadata[b"rollflow.json_columns"]))
    back = [
        {k: orjson.loads(v) if k in json_columns else v for k, v in r.items() if v is not None}
        for r in table.to_pylist()
    ]
    assert back == jsonl
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    loaded = datasets.load_dataset(
        "parquet", data_dir=str(out / "data"), split="train", cache_dir=str(tmp_path / "cache")
    )
    assert loaded["reward"] == [r["reward"] for r in jsonl]
    assert [orjson.loads(r) for r in loaded["response"]] == [r["response"] for r in jsonl]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["dataset"] == str(out / "data") and report["format"] == "parquet"
    assert front_matter(out / "README.md")["configs"][0]["data_files"][0]["path"] == "data/*.parquet"


def test_reverify_on_a_dask_cluster_equals_the_local_one(
    run_cli, collections, dask_cluster, tmp_path
) -> None:
    """Chunks scored and committed by Dask worker processes (a scheduler and two workers on loopback)."""
    source, fresh, out = collections["exact"], collections["math_fast"], tmp_path / "dask"
    res = run_cli(
        "reverify", str(source), "--output", str(out), "--verifier", "math_fast", "--chunk-size", "20",
        "--runner", "dask", "--dask-address", dask_cluster.address,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), TASKS, REPEATS)
    assert rewards(out / "rollouts.jsonl") == rewards(fresh / "rollouts.jsonl")
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["metrics"]["chunks_run"] == len(list((out / "chunks").glob("*.json"))) > 1


def test_reverify_of_a_rangeless_http_source(run_cli, collections, tmp_path) -> None:
    """A dataset on `python -m http.server` (no Range requests) read chunk by chunk from byte offsets. A
    user:password in such a URL is refused (test_redaction): it reached Prefect's flow run parameters."""
    import subprocess
    import sys

    from rollflow.infra.local import wait_http

    port = free_port_block(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
         str(collections["exact"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/", 30, server)
        url, out = f"http://127.0.0.1:{port}/rollouts.jsonl", tmp_path / "from_http"
        res = run_cli("reverify", url, "--output", str(out), "--verifier", "math_fast", "--chunk-size", "25")
    finally:
        server.kill()
        server.wait()
    assert res.returncode == 0, res.stderr
    assert rewards(out / "rollouts.jsonl") == rewards(collections["math_fast"] / "rollouts.jsonl")
    for name in ("report.json", "report.md", "run.json", "README.md"):
        assert url in (out / name).read_text(), name


def test_an_output_inside_the_source_is_refused_before_anything_is_written(
    run_cli, collections, tmp_path
) -> None:
    """--output in the source folder, a subfolder of it, or reached through a symlink to it: refused, and the
    source folder gains not even a lock file."""
    source = collections["exact"]
    link = tmp_path / "link"
    link.symlink_to(source, target_is_directory=True)
    before = tree_digest(source)
    for given, output in ((source, source), (source, source / "sub"), (link, source / "sub2")):
        res = run_cli("reverify", str(given), "--output", str(output), "--verifier", "math_fast")
        assert res.returncode != 0 and "overlap" in res.stderr, res.stderr
        assert tree_digest(source) == before and not (source / "sub").exists()


def test_failed_only_on_a_reverified_source_counts_only_what_it_scored(
    run_cli, collections, tmp_path
) -> None:
    """A source that was itself reverified keeps `_rf` in its rows: --failed-only on it copies them, and its
    report counts none of them as rescored or changed by this run."""
    first, second = tmp_path / "completed", tmp_path / "again"
    res = run_cli("reverify", str(collections["flaky"]), "--output", str(first), "--verifier", "math_fast",
                  "--failed-only")  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = run_cli("reverify", str(first), "--output", str(second), "--verifier", "math_fast", "--failed-only")
    assert res.returncode == 0, res.stderr
    assert (second / "rollouts.jsonl").read_bytes() == (first / "rollouts.jsonl").read_bytes()
    report = orjson.loads((second / "report.json").read_bytes())
    assert report["rescored"] == 0 and report["changed"] == 0, report
    assert report["before"]["mean"] == report["after"]["mean"]
