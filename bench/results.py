"""Where a benchmark leaves its figures: bench/results/<name>.json, with the machine and the date.

The docs' Benchmarks page is rendered from these files (docs/gen_reference.py), so a figure is never typed
into prose and never goes stale without saying when and where it was measured.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the figures depend on: the cores, the load while measuring, the platform and the Python."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
    }


def _plain(value: Any) -> Any:
    """Dataclass rows (the benches' `Row`s) as dicts, so a script saves what it printed without reshaping."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def save(
    name: str, rows: list[Any], *, title: str, params: dict[str, Any] | None = None, goal: str = ""
) -> Path:
    """Write one benchmark's figures: `rows` are the lines of the table it printed (dicts or dataclasses),
    `params` what it was run with, `goal` the target it prints. Returns the file written."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "title": title,
        "command": "python " + " ".join(["bench/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "params": _plain(params or {}),
        "goal": goal,
        "rows": _plain(rows),
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"  figures saved to {path}")
    return path
