"""The CLI's tables at 80 columns: every header and value whole, long URLs wrapped rather than cut."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from rollflow.flows.cli.runner import endpoints_table, summary_table
from rollflow.flows.cli.tuning_cmd import print_tuning

S3_OUT = (
    "s3://research-datasets-eu-west-1/rollouts/qwen3-8b-math/2026-11-23T12-00-00Z/run-0042-with-a-long-name"
)
STAGES = {"startup": 4.2, "diagnose": 12.5, "tune": 41.0, "collect": 3605.8, "verify": 20.1, "publish": 9.9}


def _console() -> Console:
    return Console(width=80, record=True, file=io.StringIO(), color_system=None)


def _step(phase: str, p: int, rate: float, note: str = "") -> dict[str, Any]:
    return {
        "phase": phase,
        "parallelism": p,
        "rollouts_per_s": rate,
        "latency_p50_s": 1.2345,
        "latency_p95_s": 12.3456,
        "errors": 1234,
        "rollouts": 12_288,
        "note": note,
    }


def _found() -> dict[str, Any]:
    steps = [
        _step("seed", 5, 12.3),
        _step("seed", 20, 48.1),
        _step("search", 2048, 12_345.6, "latency-knee"),
        _step("extend", 2048, 12_001.2, "confirming latency-knee"),
        _step("refine", 1536, 11_987.4),
        _step("stability", 1536, 11_950.0, "confirming the gain"),
    ]
    return {
        "output": S3_OUT,
        "diagnosis": {
            "verdict": "partly-parallelism-bound",
            "reason": "48.1 rollouts/s at 20 in flight, 12.3 at 5 (x3.91); per rollout: backend 410 ms",
            "next_step": "Raise parallelism: tuning will find the knee of the throughput curve.",
        },
        "tuning": {
            "steps": steps,
            "knee": 1536,
            "chosen_parallelism": 1536,
            "total_probe_rollouts": 61_440,
            "adopted": 61_000,
            "discarded": 440,
        },
    }


def _report() -> dict[str, Any]:
    return {
        "dataset": f"{S3_OUT}/rollouts.jsonl",
        "output": S3_OUT,
        "rows_expected": 12_000_000,
        "rows_written": 11_999_560,
        "failed": 440,
        "duplicates": 0,
        "missing": 440,
        "reward_mean": 0.61234,
        "rollouts_per_s": 3_257.123,
        "output_tokens_per_s": 1_987_654.3,
        "collect_rollouts_per_s": 3_310.5,
        "parallelism": 1536,
        "wall_s": 3693.4,
        "stages": STAGES,
    }


def _value_cells(text: str) -> str:
    """The value column of a two-column table, its wrapped pieces joined back together."""
    return "".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3)


def test_summary_table_fits_80_columns():
    console = _console()
    console.print(summary_table(_report()))
    text = console.export_text()
    assert "…" not in text
    assert max(map(len, text.splitlines())) <= 80
    labels = ("dataset", "rollouts/s", "output tokens/s", "collect rollouts/s", "wall time", "report")
    assert all(label in text for label in labels), text
    assert all(stage in text for stage in STAGES), text
    values = _value_cells(text)
    assert f"{S3_OUT}/rollouts.jsonl" in values and f"{S3_OUT}/report.json" in values, text
    assert "3,257.1" in values and "3,310.5" in values and "3,693.4 s" in values, text


def test_tuning_table_fits_80_columns():
    console = _console()
    print_tuning(console, _found(), S3_OUT)
    text = console.export_text()
    assert "…" not in text
    assert max(map(len, text.splitlines())) <= 80
    headers = next(line for line in text.splitlines() if "phase" in line)
    for header in ("phase", "in flight", "rollouts/s", "p50 ms", "p95 ms", "errors", "rollouts", "note"):
        assert header in headers, headers
    for value in ("12,346", "48.1", "12,288", "1,234", "stability", "confirming", "latency-knee", "2,048"):
        assert value in text, text
    assert f"{S3_OUT}/throughput.png" in text.replace("\n", ""), text


def test_endpoints_table_fits_80_columns():
    rows = [
        {
            "url": f"http://vllm-replica-{i}.inference.svc.cluster.local:8000",
            "rollouts": 12_345_678,
            "rollouts_per_s": 3_257.123,
            "errors": 1234,
            "limit": 2048,
            "out_of_rotation_s": 123.4,
            "engine": {"running_max": 256, "waiting_max": 37, "kv_cache_usage_max": 0.98},
        }
        for i in range(3)
    ]
    rows[1]["engine"] = None
    console = _console()
    console.print(endpoints_table({"endpoints": rows}))
    text = console.export_text()
    assert "…" not in text
    assert max(map(len, text.splitlines())) <= 80
    headers = next(line for line in text.splitlines() if "endpoint" in line and "rollouts" in line)
    for header in ("endpoint", "rollouts", "per s", "errors", "limit", "out s", "engine"):
        assert header in headers, headers
    for value in ("12,345,678", "3,257.1", "1,234", "2,048", "123.4", "256/37/98%"):
        assert value in text, text
    urls = "".join(line.split("│")[0].strip() for line in text.splitlines() if "│" in line)
    assert urls == "".join(row["url"] for row in rows), text
    assert endpoints_table({}) is None
