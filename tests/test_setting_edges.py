"""Every setting is checked at the edge: exit 2 and one paragraph naming it, before a flow run exists."""

from __future__ import annotations

import pytest
from rollout_data import write_rows
from test_errors import args_for, one_paragraph

CASES = {
    "limit beyond 2**53": ((f"--limit={2**63 + 1}",), {}, None, "limit"),
    "timeout inf": (("--timeout-s", "inf"), {}, None, "--timeout-s: Input should be a finite number"),
    "connect timeout inf (env)": (
        (),
        {"ROLLFLOW_BACKEND__CONNECT_TIMEOUT_S": "inf"},
        None,
        "CONNECT_TIMEOUT_S",
    ),
    "deadline nan": (("--deadline-s", "nan"), {}, None, "--deadline-s: Input should be a finite number"),
    "port out of range": ((), {}, "http://127.0.0.1:99999", "invalid port"),
    "overrides not JSON (env)": (
        (),
        {"ROLLFLOW_COLLECTION__OVERRIDES": "{bad"},
        None,
        "ROLLFLOW_COLLECTION__OVERRIDES",
    ),
    "overrides not JSON (.env)": ((), {}, None, "ROLLFLOW_COLLECTION__OVERRIDES in the .env"),
    # A union (a number or a word) is one problem under the variable's own name, not one per member.
    "chunk size a word (env)": (
        (),
        {"ROLLFLOW_COLLECTION__CHUNK_SIZE": "abc"},
        None,
        "ROLLFLOW_COLLECTION__CHUNK_SIZE: Input should be a valid integer, unable to parse string as an "
        "integer, or input should be 'auto'.",
    ),
    "parallelism 0 (env)": (
        (),
        {"ROLLFLOW_COLLECTION__PARALLELISM": "0"},
        None,
        "ROLLFLOW_COLLECTION__PARALLELISM: Input should be greater than or equal to 1, or input should be "
        "'auto' or 'adaptive'.",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_setting_is_one_paragraph_and_exit_2(run_cli, fast_sim, tmp_path, case):
    flags, env, url, needle = CASES[case]
    inp = write_rows(tmp_path / "in.jsonl", 5)
    if case.endswith("(.env)"):
        (tmp_path / ".env").write_text("ROLLFLOW_COLLECTION__OVERRIDES={bad\n")
    out = tmp_path / "out"
    res = run_cli(*args_for(inp, out, url or fast_sim.url), *flags, env=env, cwd=str(tmp_path), timeout=60)
    assert res.returncode == 2, res.stderr
    message = one_paragraph(res.stderr)
    assert needle in message, message
    assert "Traceback" not in res.stderr and not out.exists()
