"""Through the CLI, at the edges of what servers answer: a key echoed at the edge of an error excerpt, every
part of a multimodal row and its tool history, and a Retry-After longer than rollflow will wait."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from zoo_servers import Said, ThreadedServer, json_reply, openai_chat

pytestmark = pytest.mark.concurrent

KEY = "sk-live-0123456789abcdefghijklmnopqrstuvwxyz"
CUT = 300  # the longest excerpt of a reply an error message quotes


def _args(inp: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "chat", "--backend-url", url,
        "--parallelism", "2", "--no-progress", "--max-retries", "0", *extra,
    ]  # fmt: skip


def _write(path: Path, params: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"responses_create_params": p}) + b"\n" for p in params))
    return path


def _failures(out: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for p in sorted((out / "failures").glob("*.jsonl"))
        for line in p.read_bytes().splitlines()
    ]


def _straddling(prefix: str, auth: str) -> str:
    """`prefix` padded so that the key in `auth` starts 10 characters before the excerpt's end."""
    start = CUT - 10 - len(auth) + len(KEY)
    return prefix + "x" * (start - len(prefix)) + auth


def _echo_key(request: web.Request) -> web.Response:
    """A gateway that quotes the Authorization header back: in a 401 body, or in a 200 error object."""
    auth = request.headers["Authorization"]
    if request.headers["X-Rollflow-Task-Index"] == "0":
        text = _straddling('{"error": "', auth)
        return web.Response(status=401, body=(text + '"}').encode(), content_type="application/json")
    message = _straddling("error object: ", auth)[len("error object: ") :]
    return json_reply({"error": {"message": message}})


def test_a_key_echoed_at_the_edge_of_an_error_excerpt_is_not_written_in_part(run_cli, tmp_path):
    """The excerpt is cut after the key is masked: a cut through the key would leave its first characters
    in failures, the report and the console, where the whole key is masked."""
    inp = _write(tmp_path / "in.jsonl", [{"input": "a"}, {"input": "b"}])
    out = tmp_path / "out"
    with ThreadedServer(_echo_key) as srv:
        res = run_cli(*_args(inp, out, srv.url), env={"ROLLFLOW_BACKEND__API_KEY": KEY})
    assert res.returncode == 1, res.stderr
    failures = _failures(out)
    assert {f["error"]["kind"] for f in failures} == {"http_401", "malformed"}, failures
    assert all("Bearer ***" in f["error"]["message"] for f in failures), failures
    written = [
        res.stdout.encode(),
        res.stderr.encode(),
        *(p.read_bytes() for p in out.rglob("*") if p.is_file()),
    ]
    for data in written:
        assert KEY[:10].encode() not in data, data


def test_every_part_of_a_multimodal_row_and_its_tool_history_reaches_the_server(run_cli, tmp_path):
    """An image's `detail` and a tool result given as content parts are sent as chat has them, not dropped
    or sent as the JSON text of the parts."""
    row = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is in it?"},
                    {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "high"},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "a cat"}],
            },
        ]
    }
    inp = _write(tmp_path / "in.jsonl", [row])
    with ThreadedServer(lambda r: json_reply(openai_chat(Said()))) as srv:
        res = run_cli(*_args(inp, tmp_path / "out", srv.url))
        bodies = [s.json() for s in srv.seen]
    assert res.returncode == 0, res.stderr
    messages = bodies[0]["messages"]
    assert messages[0]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "https://example.com/a.png", "detail": "high"},
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "a cat"}


def test_a_retry_after_longer_than_rollflow_waits_is_named_in_the_failure(run_cli, tmp_path):
    """A gateway asking for a day's wait: the retries stay bounded by backoff_max_s, and the failure says
    the server asked for longer and which setting lets rollflow wait that long."""
    inp = _write(tmp_path / "in.jsonl", [{"input": "a"}])
    out = tmp_path / "out"
    busy = {"error": {"message": "quota exceeded"}}
    with ThreadedServer(lambda r: json_reply(busy, 503, {"Retry-After": "86400"})) as srv:
        res = run_cli(
            *_args(inp, out, srv.url, "--max-retries", "1"),
            env={"ROLLFLOW_BACKEND__BACKOFF_MAX_S": "0.2"},
        )
        sent = len(srv.seen)
    assert res.returncode == 1, res.stderr
    assert sent == 2
    [failure] = _failures(out)
    message = failure["error"]["message"]
    for words in ("quota exceeded", "Retry-After: 86400", "0.2 s", "ROLLFLOW_BACKEND__BACKOFF_MAX_S"):
        assert words in message, (words, message)


def test_tuning_that_finds_no_reliable_parallelism_names_what_the_backend_answered(run_cli, tmp_path):
    """Half the prompts are longer than the model's context and get a 400: no level is reliable, and the
    error names the status and the server's message instead of only counting errors."""
    inp = _write(tmp_path / "in.jsonl", [{"input": f"q{i}"} for i in range(60)])
    too_long = {
        "object": "error",
        "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
        "type": "BadRequestError",
        "code": 400,
    }

    def context_limit(request: web.Request) -> web.Response:
        if int(request.headers["X-Rollflow-Task-Index"]) % 2:
            return json_reply(too_long, 400)
        return json_reply(openai_chat(Said()))

    with ThreadedServer(context_limit) as srv:
        args = _args(inp, tmp_path / "out", srv.url, "--parallelism", "auto", "--diagnose-rows", "10")
        res = run_cli(*args)
    assert res.returncode == 2, res.stderr
    for words in ("no parallelism", "http_400", "HTTP 400 from", "maximum context length is 4096"):
        assert words in res.stderr, (words, res.stderr)


def test_a_limit_overridden_under_its_chat_name_says_which_key_to_override(run_cli, tmp_path):
    """The row says max_output_tokens, --overrides says max_tokens: both would be sent, so the run is
    refused, and the refusal says that an override replaces only the key of the same name."""
    inp = _write(tmp_path / "in.jsonl", [{"input": "a", "max_output_tokens": 100}])
    with ThreadedServer(lambda r: json_reply(openai_chat(Said()))) as srv:
        res = run_cli(*_args(inp, tmp_path / "out", srv.url, "--overrides", '{"max_tokens": 50}'))
        sent = len(srv.seen)
    assert res.returncode == 2, res.stderr
    assert sent == 0
    for words in ("line 1", "'max_output_tokens' = 100", "max_tokens = 50", "override the key the row has"):
        assert words in res.stderr, (words, res.stderr)


def test_a_limit_given_under_its_chat_name_too_is_sent_under_that_name_alone(run_cli, tmp_path):
    """The row's max_output_tokens and the same max_completion_tokens (OpenAI's name for reasoning
    models, which refuse max_tokens): one limit is sent, as max_completion_tokens, an int."""
    inp = _write(tmp_path / "in.jsonl", [{"input": "a", "max_output_tokens": 64}])
    with ThreadedServer(lambda r: json_reply(openai_chat(Said()))) as srv:
        res = run_cli(*_args(inp, tmp_path / "out", srv.url, "--overrides", '{"max_completion_tokens": 64}'))
        [body] = [s.json() for s in srv.seen]
    assert res.returncode == 0, res.stderr
    assert "max_tokens" not in body and "max_output_tokens" not in body, body
    assert body["max_completion_tokens"] == 64 and type(body["max_completion_tokens"]) is int


def test_a_chat_reply_without_usage_is_stored_without_made_up_token_counts(run_cli, tmp_path):
    """A gateway that strips `usage`: the row's response has none (as the responses kind stores it), not
    zeros that the report would count as measured lengths; a partial usage keeps only what was said."""
    inp = _write(tmp_path / "in.jsonl", [{"input": "a"}, {"input": "b"}])
    out = tmp_path / "out"

    def stripped(request: web.Request) -> web.Response:
        reply = openai_chat(Said())
        if request.headers["X-Rollflow-Task-Index"] == "0":
            del reply["usage"]
        else:
            reply["usage"] = {"completion_tokens": 5}
        return json_reply(reply)

    with ThreadedServer(stripped) as srv:
        res = run_cli(*_args(inp, out, srv.url))
    assert res.returncode == 0, res.stderr
    rows = {
        r["_ng_task_index"]: r["response"]
        for r in map(orjson.loads, (out / "rollouts.jsonl").read_bytes().splitlines())
    }
    assert rows[0]["usage"] is None, rows[0]
    assert rows[1]["usage"] == {"output_tokens": 5}, rows[1]
