"""--deadline-s covers the whole command: diagnosis and tuning stop at it, and their probes are kept."""

from __future__ import annotations

from pathlib import Path

import orjson
from rollout_data import write_rows

from rollflow.infra.local import spawn_simulator


def _part_lines(out: Path) -> int:
    """Distinct rollouts saved as parts (a part opens with a header line naming its run)."""
    keys = set()
    for part in out.glob("parts/*/*.jsonl"):
        for line in part.read_bytes().splitlines():
            row = orjson.loads(line)
            if "_rf_part" not in row:
                keys.add((row["_ng_task_index"], row["_ng_rollout_index"]))
    return len(keys)


def test_deadline_stops_diagnosis_and_the_next_run_adopts_its_probes(run_cli, tmp_path: Path):
    sim = spawn_simulator("--latency-ms", "400", "--slots", "64")  # diagnosis at 5: 100 rollouts take 8 s
    try:
        inp, out = write_rows(tmp_path / "in.jsonl", 300), tmp_path / "out"
        args = [
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
            "--backend-url", sim.url, "--num-repeats", "2", "--chunk-size", "100", "--no-progress",
        ]  # fmt: skip
        res = run_cli(*args, "--parallelism", "auto", "--deadline-s", "3")
        assert res.returncode == 1, res.stderr
        assert "stopped at its deadline" in res.stderr
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["stopped_at_deadline"] is True and "tuning_stopped" in report
        past_startup = report["wall_s"] - report["startup_s"]
        assert past_startup < 3 + 2.0, (
            f"the run went on {past_startup:.1f}s past start-up with a 3 s deadline"
        )
        saved = _part_lines(out)
        assert saved >= 10, "the diagnosis's finished rollouts were not saved"
        res = run_cli(*args, "--parallelism", "64")
        assert res.returncode == 0, res.stderr
        manifests = [orjson.loads(p.read_bytes()) for p in out.glob("chunks/*.json")]
        assert sum(m["stats"]["adopted"] for m in manifests) == saved
        assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 600
    finally:
        sim.stop()
