"""Figures known only after the flow ended (its shutdown) added to its report, never to another run's.

By then the run released the output's lease, so another run may own the output. The amendment takes the
lease again and writes only if run.json and report.json are still this run's; otherwise it says why not.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollflow.tasks.publish.report import write_report
from rollflow.tasks.storage.lease import Lease, LeaseHeld
from rollflow.tasks.storage.store import Store


def _stored(store: Store, rel: str) -> dict[str, Any]:
    try:
        value = orjson.loads(store.read_bytes(rel))
    except (OSError, orjson.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def amend_report(store: Store, report: dict[str, Any], updates: dict[str, Any], ttl_s: float) -> str | None:
    """Write `report` with `updates` unless the output moved on; None if written, else a one-line note."""
    skipped = f"report.json in {store.root_url} was left as it is: another run "
    lease = Lease(store, ttl_s)
    try:
        lease.acquire()
    except LeaseHeld:
        return skipped + "holds the output now (shutdown figures not added)."
    try:
        identity, current = _stored(store, "run.json"), _stored(store, "report.json")
        ours = report.get("run_id"), report.get("generated_at")
        if (identity.get("run_id"), current.get("generated_at")) != ours or current.get("run_id") != ours[0]:
            return skipped + "wrote to the output since (shutdown figures not added)."
        write_report(store, {**report, **updates})
        return None
    finally:
        lease.release()
