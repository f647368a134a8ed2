"""The three backend kinds against a real server on 127.0.0.1: request path, body, headers, result shape."""

from __future__ import annotations

import asyncio
import pickle

import aiohttp
import orjson
import pytest
from aiohttp import web
from local_http import AGENT, RESPONSE, ScriptedServer
from pydantic import SecretStr

from rollflow.settings import BackendSettings
from rollflow.tasks.backends.backends import BackendClient, BackendError
from rollflow.tasks.backends.http import close_loop_session, session_for_loop

ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "6 x 7?"}], "temperature": 0.5},
    "agent_ref": {"type": "responses_api_agents", "name": "math"},
    "expected_answer": "42",
}


def client(url: str, kind: str, **kw: object) -> BackendClient:
    settings = BackendSettings(kind=kind, url=url + "/", backoff_base_s=0.01, **kw)
    return BackendClient(settings, session_for_loop())


async def test_agent_posts_whole_row_and_returns_reply(server: ScriptedServer) -> None:
    url = await server.start("ok")
    result = await client(url, "agent").rollout(ROW, 3, 2)
    seen = server.seen[0]
    assert seen.path == "/run" and seen.json() == ROW
    assert seen.headers["X-Rollflow-Task-Index"] == "3" and seen.headers["X-Rollflow-Rollout-Index"] == "2"
    assert seen.headers["Content-Type"] == "application/json" and "Authorization" not in seen.headers
    assert result.fields == AGENT and result.reward == 1.0
    assert result.text == "x = 42" and result.output_tokens == 7 and result.attempts == 1
    assert result.latency_s > 0


@pytest.mark.parametrize("reward", [b'"yes"', b"null", b"true", b"NaN", b"1e999"])
async def test_agent_reward_that_is_not_a_number_is_retried_then_malformed(
    server: ScriptedServer, reward: bytes
) -> None:
    body = orjson.dumps({"response": RESPONSE})[:-1] + b',"reward":' + reward + b"}"
    url = await server.start(web.Response(body=body, content_type="application/json"))
    with pytest.raises(BackendError) as info:
        await client(url, "agent", max_retries=1).rollout(ROW, 0, 0)
    assert info.value.kind == "malformed" and info.value.attempts == 2 and len(server.seen) == 2


async def test_agent_without_reward_leaves_it_to_the_verifier(server: ScriptedServer) -> None:
    url = await server.start({"response": RESPONSE})
    result = await client(url, "agent").rollout(ROW, 0, 0)
    assert result.reward is None and result.text == "x = 42"


ERROR_200 = {"error": {"message": "upstream model overloaded", "type": "server_error", "code": 503}}


@pytest.mark.parametrize("kind", ["agent", "responses", "chat"])
async def test_error_object_in_a_200_is_malformed_never_a_rollout(server: ScriptedServer, kind: str) -> None:
    url = await server.start(ERROR_200)
    with pytest.raises(BackendError) as info:
        await client(url, kind, max_retries=2).rollout(ROW, 0, 0)
    assert info.value.kind == "malformed" and info.value.attempts == 3
    assert "upstream model overloaded" in str(info.value)


async def test_failed_responses_object_is_malformed(server: ScriptedServer) -> None:
    url = await server.start({**RESPONSE, "status": "failed", "error": {"message": "boom"}})
    with pytest.raises(BackendError) as info:
        await client(url, "responses", max_retries=0).rollout(ROW, 0, 0)
    assert info.value.kind == "malformed" and "boom" in str(info.value)


async def test_big_integers_reach_the_agent_exactly(server: ScriptedServer) -> None:
    url = await server.start("ok")
    row = {**ROW, "expected_answer": 2**100, "id": -(2**70)}
    await client(url, "agent").rollout(row, 0, 0)
    assert b'"expected_answer":1267650600228229401496703205376' in server.seen[0].body
    assert b'"id":-1180591620717411303424' in server.seen[0].body


async def test_responses_posts_create_params_with_model(server: ScriptedServer) -> None:
    url = await server.start("ok")
    result = await client(url, "responses", model="m1").rollout(ROW, 0, 0)
    assert server.seen[0].path == "/v1/responses"
    assert server.seen[0].json() == {**ROW["responses_create_params"], "model": "m1"}
    assert "model" not in ROW["responses_create_params"]  # the input row is not modified
    assert result.fields == {"response": RESPONSE} and result.reward is None
    assert result.text == "x = 42" and result.output_tokens == 7


async def test_responses_keeps_the_rows_model(server: ScriptedServer) -> None:
    url = await server.start("ok")
    row = {"responses_create_params": {"input": "hi", "model": "own"}}
    await client(url, "responses", model="m1").rollout(row, 0, 0)
    assert server.seen[0].json() == {"input": "hi", "model": "own"}


async def test_chat_converts_request_and_reply(server: ScriptedServer) -> None:
    url = await server.start("ok")
    row = {
        "responses_create_params": {
            "instructions": "answer briefly",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "6 x "}, {"type": "input_text", "text": "7?"}],
                },
                {"role": "assistant", "content": "hm"},
                {"role": "user", "content": "go"},
            ],
            "max_output_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 5,
            "stop": ["\n\n"],
            "reasoning": {"effort": "low"},
        }
    }
    result = await client(url, "chat", model="m").rollout(row, 1, 0)
    assert server.seen[0].path == "/v1/chat/completions"
    assert server.seen[0].json() == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": "6 x 7?"},
            {"role": "assistant", "content": "hm"},
            {"role": "user", "content": "go"},
        ],
        "max_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 5,
        "stop": ["\n\n"],
        "reasoning_effort": "low",
    }
    response = result.fields["response"]
    assert response["object"] == "response" and response["id"] == "chatcmpl_1" and response["model"] == "m"
    assert response["output"][0]["type"] == "message" and response["output"][0]["role"] == "assistant"
    assert response["output"][0]["content"][0] == {
        "type": "output_text",
        "text": r"so \boxed{42}",
        "annotations": [],
    }
    assert response["usage"] == {"input_tokens": 11, "output_tokens": 4, "total_tokens": 15}
    assert result.text == r"so \boxed{42}" and result.output_tokens == 4 and result.reward is None


async def test_chat_string_input_and_chat_tools(server: ScriptedServer) -> None:
    url = await server.start("ok")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    await client(url, "chat", model="m").rollout(
        {"responses_create_params": {"input": "hi", "tools": tools}}, 0, 0
    )
    assert server.seen[0].json() == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
    }


async def test_reply_of_wrong_shape_is_malformed(server: ScriptedServer) -> None:
    url = await server.start({"choices": {"not": "a list"}})
    with pytest.raises(BackendError) as info:
        await client(url, "chat", max_retries=1).rollout(ROW, 0, 0)
    assert info.value.kind == "malformed" and info.value.attempts == 2


async def test_shape_error_that_echoes_the_key_is_scrubbed(server: ScriptedServer) -> None:
    async def echo_200(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": f"bad auth {request.headers['Authorization']}"}})

    url = await server.start(echo_200)
    c = client(url, "chat", max_retries=0, api_key=SecretStr("sk-hidden-456"))
    with pytest.raises(BackendError) as info:
        await c.rollout(ROW, 0, 0)
    assert (
        info.value.kind == "malformed" and "sk-hidden-456" not in str(info.value) and "***" in str(info.value)
    )


async def test_api_key_sent_and_scrubbed_from_errors(server: ScriptedServer) -> None:
    async def echo_401(request: web.Request) -> web.Response:
        return web.Response(status=401, text=f"bad token {request.headers['Authorization']}")

    url = await server.start(echo_401)
    c = client(url, "responses", api_key=SecretStr("sk-hidden-123"))
    with pytest.raises(BackendError) as info:
        await c.rollout(ROW, 0, 0)
    assert server.seen[0].headers["Authorization"] == "Bearer sk-hidden-123"
    err = info.value
    assert err.kind == "http_401" and err.status == 401 and not err.retryable and err.attempts == 1
    assert "sk-hidden-123" not in str(err) and "sk-hidden-123" not in repr(err) and "***" in str(err)
    assert "sk-hidden-123" not in repr(session_for_loop()._default_headers)  # the shared session holds no key


async def test_error_body_is_cut_to_300_chars(server: ScriptedServer) -> None:
    url = await server.start(web.Response(status=422, text="e" * 5000))
    with pytest.raises(BackendError) as info:
        await client(url, "responses").rollout(ROW, 0, 0)
    assert str(info.value).count("e" * 300) == 1 and "e" * 301 not in str(info.value)


@pytest.mark.alone  # asserts the timeout fires within 0.45-1.5 s
async def test_body_that_stalls_times_out(server: ScriptedServer) -> None:
    url = await server.start("stall_body")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(BackendError) as info:
        await client(url, "responses", timeout_s=0.5, max_retries=0).rollout(ROW, 0, 0)
    assert info.value.kind == "timeout" and 0.45 < loop.time() - t0 < 1.5


def test_backend_error_pickles() -> None:
    err = BackendError("HTTP 429", kind="http_429", status=429, retryable=True, attempts=4, retry_after=1.0)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.kind, back.status, back.retryable, back.attempts, back.retry_after) == (
        "HTTP 429",
        "http_429",
        429,
        True,
        4,
        1.0,
    )


async def test_one_session_per_loop() -> None:
    first = session_for_loop()
    assert session_for_loop() is first and isinstance(first, aiohttp.ClientSession)

    async def other_loop() -> aiohttp.ClientSession:
        session = session_for_loop()
        await close_loop_session()
        return session

    other = await asyncio.to_thread(asyncio.run, other_loop())
    assert other is not first and other.closed
    await close_loop_session()
    assert first.closed and session_for_loop() is not first
    await close_loop_session()


async def test_chat_sends_function_tools_and_calls_over_http(server: ScriptedServer) -> None:
    url = await server.start("ok")
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    row = {
        "responses_create_params": {
            "input": [
                {"role": "user", "content": "call f"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "done"},
            ],
            "tools": [tool],
            "tool_choice": "required",
        }
    }
    await client(url, "chat", model="m").rollout(row, 0, 0)
    sent = server.seen[0].json()
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert sent["tool_choice"] == "required"
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool"]
    assert sent["messages"][1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
