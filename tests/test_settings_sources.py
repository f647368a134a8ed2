"""Settings sources in their documented order: flags, then environment, then `.env`, then defaults."""

from __future__ import annotations

from pathlib import Path

import orjson
from rollout_data import write_rows


def _run(run_cli, command: str, tmp_path: Path, url: str, out: str, *flags: str, env=None):
    inp = tmp_path / "rows.jsonl"
    res = run_cli(
        command, "--input", str(inp), "--output", str(tmp_path / out), "--backend-kind", "agent",
        "--backend-url", url, "--no-progress", *flags, env=env, cwd=str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return tmp_path / out


def _dotenv(tmp_path: Path, **values: object) -> None:
    lines = [f"ROLLFLOW_{key.upper()}={value}\n" for key, value in values.items()]
    (tmp_path / ".env").write_text("".join(lines))


def test_dotenv_collection_settings_reach_the_run(run_cli, fast_sim, tmp_path: Path):
    """`rollflow run` defaults to auto only when no source set the parallelism; .env is such a source."""
    write_rows(tmp_path / "rows.jsonl", 60)
    _dotenv(tmp_path, collection__parallelism=7, collection__chunk_size=25)
    cases = {
        "dotenv": ((), None, 7),
        "flag": (("--parallelism", "5"), None, 5),
        "env": ((), {"ROLLFLOW_COLLECTION__PARALLELISM": "9"}, 9),
    }
    for name, (flags, env, expected) in cases.items():
        out = _run(run_cli, "run", tmp_path, fast_sim.url, name, *flags, env=env)
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["parallelism"] == expected, (name, report["parallelism"])
        assert "tuning_skipped" not in report and "diagnosis" not in report, name
        assert sorted(p.name for p in (out / "chunks").glob("*.json")) == [
            "00000.json", "00001.json", "00002.json"
        ], name  # fmt: skip


def test_dotenv_tuning_settings_reach_diagnose(run_cli, fast_sim, tmp_path: Path):
    """`rollflow diagnose` takes its levels from .env unless a flag says otherwise."""
    write_rows(tmp_path / "rows.jsonl", 60)
    _dotenv(tmp_path, tuning__diagnose_rows=10, tuning__diagnose_high=6)
    for name, flags, high in (("dotenv", (), 6), ("flag", ("--diagnose-high", "4"), 4)):
        out = _run(run_cli, "diagnose", tmp_path, fast_sim.url, name, *flags)
        diagnosis = orjson.loads((out / "diagnosis.json").read_bytes())["diagnosis"]
        assert diagnosis["high"]["parallelism"] == high, (name, diagnosis["high"])
        assert diagnosis["probe_rollouts"] == 20, (name, diagnosis["probe_rollouts"])
