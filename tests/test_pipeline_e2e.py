"""The pipeline end to end through the CLI, against the simulator in its own process (issue 2)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from rollout_data import assert_complete, write_rows

from rollflow.infra.local import Service, spawn_simulator

ROWS, REPEATS = 2000, 2


@pytest.fixture(scope="module")
def input_2000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rows(tmp_path_factory.mktemp("input") / "rows.jsonl", ROWS)


@pytest.mark.parametrize("kind", ["agent", "responses", "chat"])
def test_local_output_all_kinds(run_cli, fast_sim: Service, input_2000: Path, tmp_path: Path, kind: str):
    out = tmp_path / "out"
    res = run_cli(
        "run", "--input", str(input_2000), "--output", str(out), "--backend-kind", kind,
        "--backend-url", fast_sim.url, "--num-repeats", str(REPEATS), "--parallelism", "64",
        "--chunk-size", "500", "--model", "sim", "--verifier", "math", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), ROWS, REPEATS)
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["rows_expected"] == report["rows_written"] == ROWS * REPEATS
    assert report["failed"] == report["duplicates"] == report["missing"] == 0
    assert report["parallelism"] == 64 and report["metrics"]["peak_in_flight"] <= 64
    assert report["rollouts_per_s"] > 0 and 0.0 <= report["reward_mean"] <= 1.0
    # published: the dataset holds the chunks' bytes, so their objects went and their manifests stay
    assert sorted(p.name for p in (out / "chunks").iterdir())[:2] == ["00000.json", "00001.json"]
    assert (out / "dropped_chunks.json").exists()


@pytest.mark.parametrize("kind", ["agent", "responses", "chat"])
def test_s3_output_all_kinds(run_cli, fast_sim: Service, moto_s3, input_2000: Path, kind: str):
    bucket = moto_s3.new_bucket()
    out = f"s3://{bucket}/runs/{kind}"
    res = run_cli(
        "run", "--input", str(input_2000), "--output", out, "--backend-kind", kind,
        "--backend-url", fast_sim.url, "--num-repeats", str(REPEATS), "--parallelism", "64",
        "--chunk-size", "700", "--verifier", "exact_match", "--no-progress",
        env=moto_s3.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    fs = moto_s3.fs()
    assert_complete(fs.cat_file(f"{out}/rollouts.jsonl").splitlines(), ROWS, REPEATS)
    report = orjson.loads(fs.cat_file(f"{out}/report.json"))
    assert report["missing"] == report["duplicates"] == report["failed"] == 0
    # published: the chunk objects went (the dataset holds their bytes), their manifests stay
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{out}/chunks")) == [f"{i:05d}.json" for i in range(3)]
    assert fs.exists(f"{out}/dropped_chunks.json")
    assert "testing" not in fs.cat_file(f"{out}/run.json").decode(), "credentials must never be written"


def test_s3_input(run_cli, fast_sim: Service, moto_s3, input_2000: Path, tmp_path: Path):
    bucket = moto_s3.new_bucket()
    moto_s3.fs().put_file(str(input_2000), f"{bucket}/in/rows.jsonl")
    out = tmp_path / "out"
    res = run_cli(
        "run", "--input", f"s3://{bucket}/in/rows.jsonl", "--output", str(out), "--limit", "300",
        "--backend-kind", "agent", "--backend-url", fast_sim.url, "--chunk-size", "128", "--no-progress",
        env=moto_s3.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 300, 1)


@pytest.mark.alone  # the knee it finds is the client's when two other test processes share the cores
def test_auto_parallelism_diagnoses_tunes_and_keeps_probes(run_cli, tmp_path: Path):
    """`rollflow run` by default: diagnose, tune, collect; every probe rollout ends up in the dataset."""
    sim = spawn_simulator("--latency-ms", "30", "--slots", "32")
    try:
        inp = write_rows(tmp_path / "rows.jsonl", 2500)
        out = tmp_path / "out"
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
            "--backend-url", sim.url, "--chunk-size", "500", "--no-progress",
        )  # fmt: skip
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr
    assert "parallelism-bound" in res.stderr and "tune-parallelism" in res.stderr
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 2500, 1)
    report = orjson.loads((out / "report.json").read_bytes())
    tuning = report["tuning"]
    assert report["diagnosis"]["verdict"] == "parallelism-bound"
    assert 28 <= tuning["chosen_parallelism"] <= 96 and report["parallelism"] == tuning["chosen_parallelism"]
    assert tuning["discarded"] == 0 and tuning["total_probe_rollouts"] > 0
    adopted = sum(orjson.loads(p.read_bytes())["stats"]["adopted"] for p in (out / "chunks").glob("*.json"))
    assert adopted == tuning["total_probe_rollouts"], "every probe rollout is adopted by its chunk"
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Tuning" in (out / "report.md").read_text()
