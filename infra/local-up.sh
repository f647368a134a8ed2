#!/usr/bin/env bash
# Local infrastructure on loopback: a Prefect server (SQLite), an S3-compatible store (moto_server) and
# the simulated backend. Prints the URLs and the variables to export; Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" -m rollflow.infra.local up
