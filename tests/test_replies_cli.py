"""Through the CLI: the dataset is what the backend said (chat parameters, reasoning, refusals, truncation),
what cannot be sent is refused before any request, and a backend that answers nothing usable says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from rollout_data import write_rows
from zoo_servers import Said, ThreadedServer, json_reply, openai_chat, openai_response, vllm

pytestmark = pytest.mark.concurrent


def _args(inp: Path, out: Path, url: str, kind: str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", kind, "--backend-url", url,
        "--parallelism", "4", "--chunk-size", "10", "--no-progress", "--max-retries", "1", *extra,
    ]  # fmt: skip


def _rows(out: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()]


def _failures(out: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for p in sorted((out / "failures").glob("*.jsonl"))
        for line in p.read_bytes().splitlines()
    ]


def _write(path: Path, params: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"responses_create_params": p}) + b"\n" for p in params))
    return path


# What the model says for each task: a chain of thought with logprobs, a refusal, a cut, a withheld reply.
SAID = [
    Said(content="4", reasoning="2 and 2 make 4", logprobs=[("4", -0.01)]),
    Said(content=None, refusal="I can't help with that."),
    Said(content="The answer is", reasoning="long thoughts", finish_reason="length"),
    Said(content="", finish_reason="content_filter"),
]


def _by_task(request: web.Request) -> web.Response:
    return json_reply(vllm(SAID[int(request.headers["X-Rollflow-Task-Index"])]))


def test_chat_rows_keep_every_parameter_reasoning_refusals_logprobs_and_truncation(run_cli, tmp_path):
    """Every sampling parameter reaches the server; the row keeps reasoning, refusal and logprobs, and a
    cut or withheld reply is `incomplete` with its reason, as the responses kind stores it."""
    row = {"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}, "repetition_penalty": 1.05}
    inp = _write(tmp_path / "in.jsonl", [{"input": f"q{i}", **row} for i in range(4)])
    overrides = {"min_p": 0.05, "max_tokens": 77, "logprobs": True, "top_logprobs": 2, "seed": 3}
    out = tmp_path / "out"
    with ThreadedServer(_by_task) as srv:
        res = run_cli(*_args(inp, out, srv.url, "chat", "--overrides", orjson.dumps(overrides).decode()))
        bodies = [s.json() for s in srv.seen]
    assert res.returncode == 0, res.stderr
    assert len(bodies) == 4
    for body in bodies:
        assert {k: body.get(k) for k in (*row, *overrides)} == {**row, **overrides}, body
    rows = {r["_ng_task_index"]: r["response"] for r in _rows(out)}
    thought = rows[0]["output"][0]
    assert thought["type"] == "reasoning" and thought["content"][0]["text"] == "2 and 2 make 4"
    answer = rows[0]["output"][1]["content"][0]
    assert answer["text"] == "4" and answer["logprobs"][0]["token"] == "4"
    assert rows[0]["status"] == "completed" and rows[0]["incomplete_details"] is None
    assert rows[1]["output"][0]["content"] == [{"type": "refusal", "refusal": "I can't help with that."}]
    assert rows[2]["status"] == "incomplete" and rows[2]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert rows[2]["output"][0]["content"][0]["text"] == "long thoughts"
    assert rows[3]["status"] == "incomplete" and rows[3]["incomplete_details"] == {"reason": "content_filter"}


@pytest.mark.parametrize(
    ("kind", "params", "extra", "named"),
    [
        ("chat", [{"input": "a"}], ("--overrides", '{"n": 4}'), ["--overrides", "'n'", "--num-repeats"]),
        (
            "chat",
            [{"input": "a"}, {"input": "b", "previous_response_id": "r1"}],
            (),
            ["line 2", "previous_response_id"],
        ),
        ("chat", [{"input": "a", "stream": True}], (), ["line 1", "'stream'"]),
        ("responses", [{"input": "a", "stream": True}], (), ["line 1", "'stream'"]),
        (
            "responses",
            [{"input": "a"}],
            ("--overrides", '{"background": true}'),
            ["--overrides", "'background'"],
        ),
    ],
)
def test_parameters_a_backend_cannot_send_are_refused_before_any_request(
    run_cli, tmp_path, kind, params, extra, named
):
    inp = _write(tmp_path / "in.jsonl", params)
    with ThreadedServer(
        lambda r: json_reply(openai_chat(Said()) if kind == "chat" else openai_response(Said()))
    ) as srv:
        res = run_cli(*_args(inp, tmp_path / "out", srv.url, kind, *extra))
        sent = len(srv.seen)
    assert res.returncode == 2, res.stderr
    assert sent == 0
    for word in named:
        assert word in res.stderr, res.stderr


def test_an_unfinished_background_response_is_a_failure_with_its_reason(run_cli, tmp_path):
    """OpenAI answers `status: queued` with an empty output: no reward-0 row, a failure saying why."""
    inp = write_rows(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out"
    with ThreadedServer(lambda r: json_reply(openai_response(Said(), "queued"))) as srv:
        res = run_cli(*_args(inp, out, srv.url, "responses"))
        sent = len(srv.seen)
    assert res.returncode == 1, res.stderr
    assert not (out / "rollouts.jsonl").exists()
    failures = _failures(out)
    assert len(failures) == 3 and sent == 3  # not retried: asking again queues another one
    assert {f["error"]["kind"] for f in failures} == {"unfinished"}
    assert all("'queued'" in f["error"]["message"] for f in failures)


def test_a_replica_answering_garbled_bodies_leaves_rotation(run_cli, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out"
    garbled = web.Response(body=b'{"choices": [{"mess', content_type="application/json")

    def broken(request: web.Request) -> web.Response:
        return web.Response(body=garbled.body, content_type="application/json")

    with ThreadedServer(lambda r: json_reply(openai_chat(Said()))) as good, ThreadedServer(broken) as bad:
        res = run_cli(*_args(inp, out, f"{good.url},{bad.url}", "chat", "--max-retries", "5"))
        to_bad, to_good = len(bad.seen), len(good.seen)
    assert res.returncode == 0, res.stderr
    assert len(_rows(out)) == 60 and to_good == 60
    # five in a row take it out; then a trial now and then (its backoff grows to 2 s)
    assert to_bad <= 15, to_bad


def test_tuning_against_a_404_stops_early_and_says_why(run_cli, tmp_path):
    """A base URL missing the server's path prefix (its API is under /openai) makes every request a 404:
    tuning stops after a few probes, names the 404 and the URL, and writes report.json and the failures.
    (A base given with its /v1 is taken without it: tests/test_cli_text.py.)"""
    inp = write_rows(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out"

    def prefixed_routes(request: web.Request) -> web.Response:
        if request.path != "/openai/v1/chat/completions":
            return json_reply({"detail": "Not Found"}, 404)
        return json_reply(openai_chat(Said()))

    with ThreadedServer(prefixed_routes) as srv:
        args = _args(inp, out, srv.url, "chat", "--parallelism", "auto", "--diagnose-rows", "10")
        res = run_cli(*args)
        sent = len(srv.seen)
    assert res.returncode == 2, res.stderr
    for words in ("HTTP 404", f"{srv.url}/v1/chat/completions", '"detail"'):
        assert words in res.stderr, (words, res.stderr)
    assert sent <= 20, sent
    assert str(out / "tuning_failures.jsonl") in res.stderr and "ERROR" not in res.stderr, res.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    assert (
        report["tuning_failed"]["failed_rollouts"] >= 10 and "HTTP 404" in report["tuning_failed"]["message"]
    )
    failures = [orjson.loads(line) for line in (out / "tuning_failures.jsonl").read_bytes().splitlines()]
    assert len(failures) >= 10 and {f["error"]["kind"] for f in failures} == {"http_404"}
