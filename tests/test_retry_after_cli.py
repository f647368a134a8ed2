"""Through the CLI: a gateway's Retry-After is honoured on a 503 as on a 429 (it measures waits, so it
runs alone)."""

from __future__ import annotations

from itertools import pairwise

from rollout_data import write_rows
from zoo_servers import Said, ThreadedServer, json_reply, openai_response


def test_retry_after_on_a_503_is_waited_for(run_cli, tmp_path):
    """A gateway shedding load answers 503 with Retry-After: 1; the retries wait that long, not the
    (much shorter) exponential backoff, and the rollout then succeeds."""
    inp = write_rows(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out"
    answers = iter(
        [json_reply({"error": {"message": "overloaded"}}, 503, {"Retry-After": "1"}) for _ in range(2)]
    )

    def gateway(request):
        return next(answers, None) or json_reply(openai_response(Said(content="2")))

    with ThreadedServer(gateway) as srv:
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "responses",
            "--backend-url", srv.url, "--parallelism", "1", "--max-retries", "3", "--no-progress",
            env={"ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.01"},
        )  # fmt: skip
        times = list(srv.times)
    assert res.returncode == 0, res.stderr
    assert len(times) == 3
    gaps = [b - a for a, b in pairwise(times)]
    assert all(gap >= 0.95 for gap in gaps), gaps
