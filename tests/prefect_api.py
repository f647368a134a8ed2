"""The Prefect server's REST API as tests read it: a POST, and the flow runs that wrote one output."""

from __future__ import annotations

import urllib.request
from typing import Any

import orjson


def post(api_url: str, path: str, body: dict[str, Any]) -> Any:
    """`api_url` ends in /api."""
    req = urllib.request.Request(
        f"{api_url}{path}", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    return orjson.loads(urllib.request.urlopen(req, timeout=30).read())


def flow_runs_of(api_url: str, output: str) -> list[dict[str, Any]]:
    """The newest 200 flow runs' whose `output` parameter is `output`."""
    runs = post(api_url, "/flow_runs/filter", {"limit": 200, "sort": "START_TIME_DESC"})
    return [r for r in runs if r["parameters"].get("output") == output]
