"""The CLI's late report figures (shutdown) reach report.json only while the output is still this run's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from rollflow.flows.cli.prefect_api import PrefectApi
from rollflow.flows.cli.runner import finish
from rollflow.settings import RunSpec
from rollflow.tasks.storage.lease import Lease
from rollflow.tasks.storage.store import Store

RUN_ID = "0123456789abcdef"


def _report(out: Path, at: datetime) -> dict[str, Any]:
    return {
        "generated_at": at.isoformat(),
        "run_id": RUN_ID,
        "input": str(out / "in.jsonl"),
        "output": str(out),
        "dataset": None,
        "published": False,
        "backend_kind": "agent",
        "wall_s": 2.0,
        "before_flow_s": 1.0,
        "chunk_task_overhead_s": 0.1,
        "shutdown_s": None,
    }


def _output(tmp_path: Path) -> tuple[Store, RunSpec, dict[str, Any]]:
    """An output whose run.json and report.json are this run's (run A), as its flow left them."""
    store = Store(str(tmp_path))
    store.write_bytes("run.json", orjson.dumps({"run_id": RUN_ID}))
    ours = _report(tmp_path, datetime.now(UTC) - timedelta(seconds=1))
    store.write_bytes("report.json", orjson.dumps(ours))
    return store, RunSpec(input=ours["input"], output=str(tmp_path)), ours


def test_report_of_a_run_holding_the_output_is_not_overwritten(tmp_path: Path) -> None:
    store, spec, ours = _output(tmp_path)
    other = Lease(store, ttl_s=60)  # run B resumed the output after A's flow released it
    other.acquire()
    try:
        theirs = orjson.dumps({**_report(tmp_path, datetime.now(UTC)), "rows_written": 7})
        store.write_bytes("report.json", theirs)
        note = finish(ours, spec, PrefectApi(None, "configured"))
        assert store.read_bytes("report.json") == theirs
        assert note is not None and "another run" in note
    finally:
        other.release()


def test_report_of_a_later_run_is_not_overwritten(tmp_path: Path) -> None:
    store, spec, ours = _output(tmp_path)
    theirs = orjson.dumps({**_report(tmp_path, datetime.now(UTC)), "rows_written": 7})
    store.write_bytes("report.json", theirs)  # run B ran and finished in between; no lease now
    note = finish(ours, spec, PrefectApi(None, "configured"))
    assert store.read_bytes("report.json") == theirs
    assert note is not None and "another run" in note
    assert not store.exists("lease.json")


def test_own_report_gets_shutdown_figures(tmp_path: Path) -> None:
    store, spec, ours = _output(tmp_path)
    assert finish(ours, spec, PrefectApi(None, "configured")) is None
    stored = orjson.loads(store.read_bytes("report.json"))
    assert stored["generated_at"] == ours["generated_at"]
    assert stored["shutdown_s"] is not None and stored["shutdown_s"] >= 1.0
    assert stored["prefect_api"] == "configured"
    assert not store.exists("lease.json")
