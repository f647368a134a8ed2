"""`rollflow tune` after `rollflow diagnose` on the same output and backend reuses that diagnosis rather
than spending rollouts on another one seconds later (which could give another verdict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from rollout_data import write_rows

from rollflow.infra.local import Service

SMALL_STEPS = {
    "ROLLFLOW_TUNING__DIAGNOSE_ROWS": "10",
    "ROLLFLOW_TUNING__TUNE_STEP_ROLLOUTS": "10",
    "ROLLFLOW_TUNING__MAX_PARALLELISM": "32",
}


def _stage(run_cli, command: str, inp: Path, out: Path, url: str, **env: str) -> dict[str, Any]:
    res = run_cli(
        command, "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
        "--backend-url", url, "--chunk-size", "100", env={**SMALL_STEPS, **env},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return orjson.loads((out / ("tuning.json" if command == "tune" else "diagnosis.json")).read_bytes())


def test_tune_reuses_the_diagnosis_made_just_before(run_cli, fast_sim: Service, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", 1200)
    out = tmp_path / "out"
    diagnosed = _stage(run_cli, "diagnose", inp, out, fast_sim.url)
    assert fast_sim.url not in orjson.dumps(diagnosed).decode()  # the backend by a key: a URL may hold one
    tuned = _stage(run_cli, "tune", inp, out, fast_sim.url)
    reused = tuned["diagnosis"]
    assert reused["verdict"] == diagnosed["diagnosis"]["verdict"] and "s earlier" in reused["reused"], reused
    steps = tuned["tuning"]["steps"]
    assert not [s for s in steps if s["phase"] == "seed"], steps  # no diagnosis steps measured again
    assert tuned["tuning"]["total_probe_rollouts"] == tuned["tuning"]["probe_rollouts"], tuned["tuning"]
    assert any("diagnosis not repeated" in note for note in tuned["tuning"]["notes"]), tuned["tuning"]

    again = _stage(run_cli, "tune", inp, out, fast_sim.url, ROLLFLOW_TUNING__REUSE_DIAGNOSIS_S="0")
    assert "reused" not in again["diagnosis"], again["diagnosis"]  # 0: always diagnose
    assert [s["phase"] for s in again["tuning"]["steps"][:2]] == ["seed", "seed"], again["tuning"]["steps"]
