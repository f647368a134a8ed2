"""The files NeMo Gym's users read beside a dataset: `<stem>_failures.jsonl` (the failures sidecar, in
NeMo Gym's row format) and `<stem>_aggregate_metrics.json` (each environment server's own
`/aggregate_metrics` over the rows it ran). rollflow's own files stay beside them.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterable
from http import HTTPStatus
from typing import IO, Any

import aiohttp
import orjson

from rollflow.settings import BackendParams
from rollflow.tasks.collect.paths import metrics_url, sidecar_url
from rollflow.tasks.collect.routing import row_agent
from rollflow.tasks.publish.concat import split_url
from rollflow.tasks.storage import owned, rowjson
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.store import Store, open_input

GATEWAY_STATUSES = (429, 502, 503, 504)  # NeMo Gym: something in front answered; the rollout did not run
HEAVY = (
    "response",
    "responses_create_params",
    "ng_agent_observations",
    "ng_model_call_capture",
    "ng_trajectory",
)
MAX_BODY_CHARS = 2000


def failure_class(error: dict[str, Any]) -> str:
    """NeMo Gym's class: the server answered (it ran and broke), or nothing did (the request failed)."""
    status = error.get("status")
    if error.get("kind") in ("connection", "timeout") or status in GATEWAY_STATUSES:
        return "agent_request_failed"
    return "agent_run_error"


# rollflow's failure kinds as the aiohttp error NeMo Gym's collector names in `_ng_failure_type`
ERROR_TYPES = {
    "timeout": "TimeoutError",
    "connection": "ClientConnectorError",
    "malformed": "JSONDecodeError",
}


def _failure_message(error: dict[str, Any]) -> Any:
    """NeMo Gym's words for an HTTP error (aiohttp's: `500, message='Internal Server Error', url=...`)."""
    status, url = error.get("status"), error.get("url")
    if isinstance(status, int) and url:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        return f"{status}, message='{phrase}', url='{url}'"
    return error.get("message")


def sidecar_row(record: dict[str, Any]) -> dict[str, Any]:
    """One rollflow failure record as NeMo Gym's sidecar row (no reward, no response: no rollout)."""
    error, row = record.get("error") or {}, record.get("row") or {}
    kind = str(error.get("kind") or "")
    out: dict[str, Any] = {
        "_ng_failure_class": failure_class(error),
        "_ng_failure_type": "ClientResponseError"
        if kind.startswith("http_")
        else ERROR_TYPES.get(kind, kind),
        "_ng_failure_message": _failure_message(error),
        "_ng_failure_http_status": error.get("status"),
        "_ng_failure_response_body": error.get("body"),
        "_ng_task_index": record.get("_ng_task_index"),
        "_ng_rollout_index": record.get("_ng_rollout_index"),
    }
    if isinstance(row, dict) and "agent_ref" in row:
        out["agent_ref"] = row["agent_ref"]
    for key in ("_ng_environment_server", "_ng_result_type"):
        if key in record:
            out[key] = record[key]
    out["_rf"] = {"attempts": error.get("attempts"), "kind": kind, "message": error.get("message")}
    return out


def write_sidecar(ledger: Ledger, indexes: Iterable[int], dataset_url: str, options: dict[str, Any]) -> str:
    """Every failed rollout the committed chunks hold, as NeMo Gym's failures sidecar; its URL."""
    url = sidecar_url(dataset_url)
    parent, name = split_url(url)
    target = Store(parent, options)
    _record(ledger.store, url, options)
    with target.open_write(name) as out:
        for index in indexes:
            path = ledger.failures_path(index)
            if not ledger.store.exists(path):
                continue
            for line in ledger.store.read_bytes(path).splitlines():
                if line.strip():
                    out.write(rowjson.dumps(sidecar_row(rowjson.read_row(line))) + b"\n")
    return url


def _record(store: Store, url: str, options: dict[str, Any]) -> None:
    """Recorded before it is written, so a --restart removes it and nothing else."""
    owned.add(store, owned.NEMO_GYM, [url], options)


def stripped(row: dict[str, Any]) -> dict[str, Any]:
    """A row as NeMo Gym sends it to /aggregate_metrics: heavy fields out, the reply's usage kept."""
    entry = {k: v for k, v in row.items() if k not in HEAVY}
    response = row.get("response") if isinstance(row.get("response"), dict) else {}
    kept = {k: response[k] for k in ("usage", "incomplete_details") if response.get(k) is not None}
    if kept:
        entry["response"] = kept
    return entry


def _spool_by_server(
    dataset_url: str, options: dict[str, Any], backend: BackendParams
) -> dict[str, tuple[str, str | None, IO[bytes], int]]:
    """server name -> (its URL, the agent it is labelled by, the stripped rows as JSON items, count)."""
    spools: dict[str, tuple[str, str | None, IO[bytes], int]] = {}
    with open_input(dataset_url, options) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = rowjson.read_row(line)
            agent = row_agent(row)
            server = backend.agents.get(agent or "")
            if server is None or server.server is None:
                continue
            name = server.server
            if name not in spools:
                spools[name] = (server.url, agent, tempfile.TemporaryFile(), 0)  # noqa: SIM115 - closed by the caller
            url, label, spool, n = spools[name]
            spool.write((b"," if n else b"") + rowjson.dumps(stripped(row)))
            spools[name] = (url, label, spool, n + 1)
    return spools


async def _body(spool: IO[bytes]) -> AsyncIterator[bytes]:
    spool.seek(0)
    yield b'{"verify_responses":['
    while block := spool.read(1 << 20):
        yield block
    yield b"]}"


async def write_aggregate_metrics(
    dataset_url: str, options: dict[str, Any], backend: BackendParams, store: Store
) -> tuple[str, list[str]]:
    """Ask each environment server for its metrics over the rows it ran; (the file's URL, problems)."""
    spools = await asyncio.to_thread(_spool_by_server, dataset_url, options, backend)
    entries, problems = [], []
    timeout = aiohttp.ClientTimeout(total=backend.timeout_s, connect=backend.connect_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for name, (url, agent, spool, _n) in spools.items():
                try:
                    entries.append(await _ask(session, name, url, agent, spool))
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    problems.append(
                        f"{name} ({url}/aggregate_metrics): {type(exc).__name__}: {exc}"[:MAX_BODY_CHARS]
                    )
    finally:
        for _url, _agent, spool, _n in spools.values():
            spool.close()
    url = metrics_url(dataset_url)
    parent, fname = split_url(url)
    await asyncio.to_thread(_record, store, url, options)
    await asyncio.to_thread(
        Store(parent, options).write_bytes, fname, orjson.dumps(entries, option=orjson.OPT_INDENT_2)
    )
    return url, problems


async def _ask(
    session: aiohttp.ClientSession, name: str, url: str, agent: str | None, spool: IO[bytes]
) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    async with session.post(
        url.rstrip("/") + "/aggregate_metrics", data=_body(spool), headers=headers
    ) as resp:
        payload = await resp.read()
        if resp.status >= 400:
            raise ValueError(f"HTTP {resp.status}: {payload[:300].decode('utf-8', 'replace')}")
    found = orjson.loads(payload)
    if not isinstance(found, dict):
        raise ValueError("the reply is not a JSON object")
    entry = {
        "agent_ref": {"name": agent},
        "_ng_environment_server": name,
        **{
            k: found.get(k)
            for k in ("agent_metrics", "key_metrics", "group_level_metrics", "repeat_level_metrics")
        },
    }
    if found.get("perf_summary") is not None:
        entry["perf_summary"] = found["perf_summary"]
    return entry
