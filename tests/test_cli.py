"""The CLI as users call it: NeMo Gym's arguments, flag validation, secrets kept out of everything."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import orjson
from rollout_data import assert_complete, write_rows


def test_nemo_gym_arguments(run_cli, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "train.jsonl", 80)
    target = tmp_path / "results" / "rollouts.jsonl"
    res = run_cli(
        "collect", "--backend-url", fast_sim.url, "--no-progress",
        f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={target}", "+num_samples_in_parallel=8",
        "+limit=50", "+num_repeats=2", "+agent_name=math_agent", "+responses_create_params.temperature=0.5",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = target.read_bytes().splitlines()
    assert_complete(lines, 50, 2)
    first = orjson.loads(lines[0])
    assert first["responses_create_params"]["temperature"] == 0.5
    report = orjson.loads((tmp_path / "results" / "rollouts.jsonl.rollflow" / "report.json").read_bytes())
    assert report["parallelism"] == 8 and report["dataset"] == str(target)


def test_unknown_nemo_gym_argument(run_cli, tmp_path: Path):
    res = run_cli("collect", "+input_jsonl_fpath=x.jsonl", "+num_workers=3")
    assert res.returncode == 2 and "+num_workers" in res.stderr and "+num_samples_in_parallel" in res.stderr


def test_invalid_flags(run_cli, tmp_path: Path):
    res = run_cli("run", "--input", "x", "--output", str(tmp_path), "--parallelism", "0")
    assert res.returncode == 2 and "parallelism" in res.stderr
    res = run_cli("run", "--input", "x", "--output", str(tmp_path), "--overrides", "{nope")
    assert res.returncode == 2 and "--overrides must be a JSON object" in res.stderr
    res = run_cli("run", "--output", str(tmp_path))
    assert res.returncode == 2 and "No input" in res.stderr


def test_an_empty_engine_address_is_a_usage_error_and_reverify_reads_the_engine_settings(
    run_cli, tmp_path: Path
):
    """`--ray-address "$HEAD"` with HEAD unset ran the whole job on this machine, not the cluster meant."""
    inp = write_rows(tmp_path / "rows.jsonl", 4)
    run = (
        "run",
        "--input",
        str(inp),
        "--output",
        str(tmp_path / "out"),
        "--backend-url",
        "http://127.0.0.1:9",
    )
    cases = [
        (("--runner", "ray", "--ray-address", ""), {}, "--ray-address: the Ray address is empty"),
        (("--runner", "dask", "--dask-address", " "), {}, "--dask-address: the Dask address is empty"),
        (
            ("--runner", "dask", "--dask-cluster-class", ""),
            {},
            "--dask-cluster-class: the Dask cluster class is empty",
        ),
        (("--runner", "ray"), {"ROLLFLOW_PIPELINE__RAY_ADDRESS": ""}, "the Ray address is empty"),
    ]
    for flags, env, said in cases:
        res = run_cli(*run, *flags, env=env, timeout=60)
        assert res.returncode == 2 and said in res.stderr, (flags, env, res.stderr[-800:])
        assert not (tmp_path / "out").exists(), "nothing ran"
    res = run_cli("reverify", str(tmp_path), "--output", str(tmp_path / "re"), "--runner", "ray",
                  "--ray-address", "", timeout=60)  # fmt: skip
    assert res.returncode == 2 and "--ray-address: the Ray address is empty" in res.stderr, res.stderr[-800:]
    # reverify reads the engine's ROLLFLOW_PIPELINE__* settings as `run` does (it ran locally instead)
    engine = {"ROLLFLOW_PIPELINE__RUNNER": "dask", "ROLLFLOW_PIPELINE__DASK_ADDRESS": "tcp://127.0.0.1:9"}
    res = run_cli("reverify", str(tmp_path), "--output", str(tmp_path / "re"), env=engine, timeout=60)
    assert res.returncode == 2 and "tcp://127.0.0.1:9: nothing answers there" in res.stderr, res.stderr[-800:]


def test_a_reverify_source_that_does_not_exist_is_named_without_a_traceback(run_cli, tmp_path: Path):
    res = run_cli("reverify", str(tmp_path / "nosuch.jsonl"), "--output", str(tmp_path / "re"), timeout=60)
    assert res.returncode == 2, res.stderr[-800:]
    assert (
        f"Source {tmp_path / 'nosuch.jsonl'} does not exist" in res.stderr and "Traceback" not in res.stderr
    )
    assert not list((tmp_path / "re").glob("*.json*")), "nothing published"
    store = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    for source, env in (("s3://b/x.jsonl", store), ("http://127.0.0.1:9/x.jsonl", {})):
        res = run_cli("reverify", source, "--output", str(tmp_path / "re2"), env=env, timeout=120)
        assert res.returncode == 2 and f"Source {source} cannot be read" in res.stderr, res.stderr[-800:]
        assert "Traceback" not in res.stderr, res.stderr[-3000:]


def test_api_key_never_leaves_the_process(run_cli, fast_sim, prefect_server, tmp_path: Path):
    secret = "sk-rollflow-test-4f1d9c"
    inp = write_rows(tmp_path / "rows.jsonl", 30)
    out = tmp_path / "out"
    res = run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "chat",
        "--backend-url", fast_sim.url, "--verbose", "--no-progress",
        env={"ROLLFLOW_BACKEND__API_KEY": secret},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout + res.stderr
    for path in out.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    req = urllib.request.Request(
        f"{prefect_server.url}/api/flow_runs/filter",
        data=b'{"limit": 200}',
        headers={"Content-Type": "application/json"},
    )
    runs = urllib.request.urlopen(req).read()
    assert b'"collection"' in runs, "the flow runs and their RunSpec parameters must be on the server"
    assert secret.encode() not in runs


def test_a_local_run_imports_no_remote_engine_and_names_the_engine_flags_it_ignores(
    run_cli, fast_sim, tmp_path: Path
):
    """Importing Dask costs a local run about 0.1 CPU-s, Dask's distributed 0.2 more, Ray 0.2. Another
    runner's flags are said to be ignored (a user who forgot `--runner ray` learns it before the run)."""
    inp = write_rows(tmp_path / "rows.jsonl", 20)
    res = run_cli(
        "run", "--input", str(inp), "--output", str(tmp_path / "out"), "--backend-kind", "agent",
        "--backend-url", fast_sim.url, "--parallelism", "4", "--no-progress", "--ray-address", "auto",
        "--dask-adapt-max", "4",
        env={"PYTHONPROFILEIMPORTTIME": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    notes = [line for line in res.stderr.splitlines() if line.startswith("rollflow: --")]
    assert notes == [
        "rollflow: --dask-adapt-max applies to --runner dask; --runner local ignores it",
        "rollflow: --ray-address applies to --runner ray; --runner local ignores it",
    ], res.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")
    }
    assert "rollflow.flows.pipeline" in imported, "the import log is read"
    assert not imported & {"dask", "distributed", "ray", "prefect_dask", "prefect_ray"}, imported
