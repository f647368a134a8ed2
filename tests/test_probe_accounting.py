"""What tuning cost the dataset: probe rollouts requested against those their chunks adopted at commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from rollout_data import write_rows

from rollflow.infra.local import Service, spawn_simulator

# Diagnosis and tuning on small steps, so a run of a few hundred rows diagnoses, tunes, then collects.
SMALL_STEPS = {
    "ROLLFLOW_TUNING__DIAGNOSE_ROWS": "10",
    "ROLLFLOW_TUNING__TUNE_STEP_ROLLOUTS": "10",
    "ROLLFLOW_TUNING__MAX_PARALLELISM": "64",
}


def _auto_run(run_cli, sim: Service, tmp_path: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    inp = write_rows(tmp_path / "rows.jsonl", 400)
    out = tmp_path / name
    res = run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
        "--backend-url", sim.url, "--chunk-size", "100", "--no-progress",
        env={**SMALL_STEPS, **env},
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    manifests = [orjson.loads(p.read_bytes()) for p in (out / "chunks").glob("*.json")]
    report["manifest_adopted"] = sum(m["stats"]["adopted"] for m in manifests)
    return report


def test_probes_adopted_means_none_discarded(run_cli, fast_sim: Service, tmp_path: Path):
    report = _auto_run(run_cli, fast_sim, tmp_path, "clean", {})
    tuning = report["tuning"]
    assert report["published"] and tuning["total_probe_rollouts"] > 0
    assert tuning["adopted"] == report["manifest_adopted"] == tuning["total_probe_rollouts"]
    assert tuning["discarded"] == 0


def test_failed_probes_are_counted_as_discarded(run_cli, tmp_path: Path):
    """A probe that failed is not saved, so no chunk adopts it: the request was spent for nothing."""
    sim = spawn_simulator("--latency-ms", "2", "--slots", "64", "--fault-rate", "0.2", "--fault-kinds", "500")
    try:
        env = {"ROLLFLOW_BACKEND__MAX_RETRIES": "0", "ROLLFLOW_TUNING__MAX_ERROR_RATE": "0.6"}
        report = _auto_run(run_cli, sim, tmp_path, "faulty", env)
    finally:
        sim.stop()
    tuning = report["tuning"]
    failed_probes = sum(step["errors"] for step in tuning["steps"])
    assert failed_probes > 0, tuning["steps"]
    assert tuning["discarded"] == failed_probes
    assert tuning["adopted"] == report["manifest_adopted"] == tuning["total_probe_rollouts"] - failed_probes
