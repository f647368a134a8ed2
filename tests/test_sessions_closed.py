"""A command leaves no aiohttp session open on its event loop: a process that runs another loop afterwards
(a served deployment's next flow run) logs no "Unclosed client session" for the one before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rollout_data import write_rows
from test_errors import args_for

pytestmark = pytest.mark.concurrent

# The command as the console script runs it, then a second loop in the same process that makes and closes
# its own session (forgetting the sessions of loops that ended), as a long-lived
# process would do them.
THEN_ANOTHER_LOOP = """
import asyncio, gc, sys
from rollflow.flows.cli.main import main
from rollflow.tasks.backends.http import close_loop_session, session_for_loop

code = main(sys.argv[1:])

async def next_run():
    session_for_loop()
    await close_loop_session()

asyncio.run(next_run())
gc.collect()
print("exit", code, file=sys.stderr)
"""


def test_reverify_with_the_http_verifier_closes_its_session(run_cli, cli_env, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "in.jsonl", 20)
    source = tmp_path / "source"
    res = run_cli(*args_for(inp, source, fast_sim.url, "--verifier", "exact_match"))
    assert res.returncode == 0, res.stderr
    args = ["reverify", str(source), "--output", str(tmp_path / "re"), "--verifier", "http"]
    res = subprocess.run(
        [sys.executable, "-c", THEN_ANOTHER_LOOP, *args, "--verifier-url", fast_sim.url],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "exit 0" in res.stderr, res.stderr
    assert (tmp_path / "re" / "rollouts.jsonl").exists()
    assert "Unclosed" not in res.stderr, res.stderr
