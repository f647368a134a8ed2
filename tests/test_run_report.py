"""The report tells the whole command: wall time from process start, time per stage, every rollout counted."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
from rollout_data import write_rows

from rollflow.infra.local import Service
from rollflow.tasks.publish.plot import evidence_said

STAGES = ("startup", "diagnose", "tune", "collect", "verify", "publish")
# After report.json is written: the markdown artifact, the flow run's final state, the summary table, then
# at interpreter exit Prefect stops its ephemeral API server (SIGTERM, then waits up to 5 s before a kill).
EXIT_ALLOWANCE_S = 5.0 + 1.0
SMALL_STEPS = {
    "ROLLFLOW_TUNING__DIAGNOSE_ROWS": "10",
    "ROLLFLOW_TUNING__TUNE_STEP_ROLLOUTS": "10",
    "ROLLFLOW_TUNING__MAX_PARALLELISM": "64",
}


def _timed_auto_run(run_cli, sim: Service, tmp_path: Path, rows: int) -> tuple[dict[str, Any], float]:
    inp = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    t0 = time.time()
    res = run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
        "--backend-url", sim.url, "--chunk-size", "100", "--parallelism", "auto", "--no-progress",
        env=SMALL_STEPS,
    )  # fmt: skip
    measured = time.time() - t0
    assert res.returncode == 0, res.stderr
    return orjson.loads((out / "report.json").read_bytes()), measured


def _assert_whole_run(report: dict[str, Any], measured_s: float) -> None:
    stages = report["stages"]
    assert set(stages) == set(STAGES), stages
    assert all(v >= 0 for v in stages.values()), stages
    assert report["wall_s"] >= measured_s - EXIT_ALLOWANCE_S, (report["wall_s"], measured_s)
    assert report["wall_s"] <= measured_s, (report["wall_s"], measured_s)
    assert report["wall_s"] >= sum(stages.values()) - 0.01, stages
    assert stages["diagnose"] > 0 and stages["collect"] > 0 and stages["startup"] > 0, stages
    assert report["rollouts_per_s"] > 0
    expected = report["rows_written"] / report["wall_s"]
    assert abs(report["rollouts_per_s"] - expected) <= 0.01 * expected, (report["rollouts_per_s"], expected)
    assert report["output_tokens_per_s"] > 0


def test_report_counts_the_whole_command(run_cli, fast_sim: Service, tmp_path: Path):
    report, measured = _timed_auto_run(run_cli, fast_sim, tmp_path, 2000)
    _assert_whole_run(report, measured)
    assert report["tuning"]["adopted"] > 0 and report["metrics"]["collected"] > 0
    assert report["collect_rollouts_per_s"] > 0
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert stages_in_markdown(markdown)
    tuning = report["tuning"]  # the choice states its readings at its level, and the report says them
    at = [s for s in tuning["steps"] if s["parallelism"] == tuning["chosen_parallelism"] and s["errors"] == 0]
    assert tuning["evidence"]["readings"] == len(at), tuning
    assert f"At the chosen level: {evidence_said(tuning)}." in markdown


def test_a_short_run_spends_a_bounded_share_probing(run_cli, fast_sim: Service, tmp_path: Path):
    """Tuning stops once diagnosis and tuning have spent a tenth of the run (ROLLFLOW_TUNING__PROBE_SHARE);
    the diagnosis always runs. Here it alone is a third of 60 rollouts, so no tuning step follows, and
    collection asks the backend for the rest."""
    report, measured = _timed_auto_run(run_cli, fast_sim, tmp_path, 60)
    tuning = report["tuning"]
    assert [st["phase"] for st in tuning["steps"]] == ["seed", "seed"], tuning["steps"]
    assert tuning["total_probe_rollouts"] == 20 and tuning["adopted"] == 20, tuning
    assert report["metrics"]["collected"] == 40 and report["collect_rollouts_per_s"] > 0
    _assert_whole_run(report, measured)


def stages_in_markdown(text: str) -> bool:
    return all(f"| {name} " in text for name in STAGES) and "collect_rollouts_per_s" in text
