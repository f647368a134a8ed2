"""`rollflow tune` after `rollflow diagnose` on the same output and backend reuses that diagnosis rather
than spending rollouts on another one seconds later (which could give another verdict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from rollout_data import write_rows

from rollflow.infra.local import Service
from rollflow.tasks.tuning.diagnose import diagnosis_record, earlier_diagnosis

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

    # 0 turns reuse off: on an output of its own, diagnosed just before (the tune above may have probed
    # every row left in `out`: it has no probing share, and a loaded machine's noise takes more steps)
    again_out = tmp_path / "again"
    _stage(run_cli, "diagnose", inp, again_out, fast_sim.url)
    again = _stage(run_cli, "tune", inp, again_out, fast_sim.url, ROLLFLOW_TUNING__REUSE_DIAGNOSIS_S="0")
    assert "reused" not in again["diagnosis"], again["diagnosis"]  # 0: always diagnose
    assert [s["phase"] for s in again["tuning"]["steps"][:2]] == ["seed", "seed"], again["tuning"]["steps"]


def test_a_diagnosis_of_anything_else_or_malformed_is_not_reused() -> None:
    """Another key (endpoints, kind, model, verifier or its processes), an age past the bound, or fields
    of the wrong type: nothing is reused, and nothing raises."""
    found = {"verdict": "verifier-bound", "advised_parallelism": 5, "advised_is_ceiling": False}
    record = diagnosis_record({"diagnosis": found}, "k1", 20)
    assert earlier_diagnosis(orjson.dumps(record), "k1", 60)["verdict"] == "verifier-bound"
    assert earlier_diagnosis(orjson.dumps(record), "k2", 60) is None  # e.g. --verify-processes 2 now
    assert (
        earlier_diagnosis(orjson.dumps({**record, "diagnosed_at": record["diagnosed_at"] - 120}), "k1", 60)
        is None
    )
    for bad in ({"diagnosed_at": "soon"}, {"diagnosed_at": None}, {"diagnosis": {**found, "verdict": None}},
                {"diagnosis": {**found, "advised_parallelism": "5"}}, {"diagnosis": [1]}):  # fmt: skip
        assert earlier_diagnosis(orjson.dumps({**record, **bad}), "k1", 60) is None, bad
    assert earlier_diagnosis(b"{not json", "k1", 60) is None
    capped = diagnosis_record({"diagnosis": {**found, "advised_is_ceiling": True}}, "k1", 20)
    assert capped["chosen_parallelism"] == 5  # the value to run at honours the verdict's ceiling
