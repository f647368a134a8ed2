"""Whatever a server in the zoo answers, the row's `response` holds everything the reply said, or the
rollout is a failure with its reason (property test over real HTTP, one real client per example)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reply_leaves import leaves
from zoo_servers import CHAT_SERVERS, Said, ThreadedServer, json_reply, openai_response, sse

from rollflow.settings import BackendSettings
from rollflow.tasks.backends.backends import BackendClient, BackendError
from rollflow.tasks.backends.http import close_loop_session, session_for_loop

pytestmark = pytest.mark.concurrent

ROW = {"responses_create_params": {"input": "2 + 2?"}}


class Zoo:
    """One server for the module; each example sets what it answers next (`script`, in order)."""

    def __init__(self) -> None:
        self.script: list[Any] = []
        self.server = ThreadedServer(self._answer)

    def _answer(self, request: Any) -> web.Response:
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return web.Response(status=step.status, body=step.body, headers=step.headers.copy())  # sent once


@pytest.fixture(scope="module")
def zoo():
    z = Zoo()
    with z.server:
        yield z


def _rollout(url: str, kind: str) -> Any:
    settings_ = BackendSettings(
        kind=kind, url=url, model="m", max_retries=2, backoff_base_s=0.01, backoff_max_s=1.0, timeout_s=5
    )

    async def go() -> Any:
        client = BackendClient(settings_, session_for_loop())
        try:
            return await client.rollout(ROW, 0, 0)
        except BackendError as exc:
            return exc
        finally:
            await close_loop_session()

    return asyncio.run(go())


text = st.text(min_size=1, max_size=40)
saids = st.builds(
    Said,
    content=st.none() | text,
    reasoning=st.none() | text,
    refusal=st.none() | text,
    tool_calls=st.lists(st.tuples(text, text, text), max_size=2),
    logprobs=st.none() | st.lists(st.tuples(text, st.floats(-20, 0)), min_size=1, max_size=3),
    finish_reason=st.sampled_from(["stop", "length", "content_filter", "tool_calls", "abort"]),
    choices=st.sampled_from([1, 1, 1, 2]),
    prompt_tokens=st.integers(3, 500),
    completion_tokens=st.integers(0, 500),
    reasoning_tokens=st.integers(0, 100),
)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _check_chat(result: Any, reply: dict[str, Any], said: Said, thinks: bool) -> None:
    if said.choices > 1 or said.finish_reason == "abort":
        assert isinstance(result, BackendError) and result.kind == "malformed", result
        assert ("choices" in str(result)) or ("abort" in str(result)), str(result)
        return
    assert not isinstance(result, BackendError), str(result)
    response = result.fields["response"]
    missing = leaves(reply) - leaves(response)
    assert not missing, f"lost {missing} of {reply} in {response}"
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(said.finish_reason)
    assert response["status"] == ("incomplete" if incomplete else "completed")
    assert response["incomplete_details"] == ({"reason": incomplete} if incomplete else None)
    types = [item["type"] for item in response["output"]]
    assert types.count("reasoning") == (1 if said.reasoning and thinks else 0)
    assert types.count("function_call") == len(said.tool_calls)
    parts = [p for item in response["output"] if item["type"] == "message" for p in item["content"]]
    if said.refusal:
        assert {"type": "refusal", "refusal": said.refusal} in [
            {k: p[k] for k in ("type", "refusal")} for p in parts if p["type"] == "refusal"
        ]
    assert result.text == (said.content or "")


@FAST
@given(
    said=saids, server=st.sampled_from(sorted(CHAT_SERVERS)), wrap=st.sampled_from(["plain", "503", "sse"])
)
def test_a_chat_reply_is_kept_whole_or_is_a_failure_with_its_reason(zoo, said, server, wrap) -> None:
    reply = CHAT_SERVERS[server](said)
    if wrap == "sse":
        zoo.script = [sse(reply)]
    elif wrap == "503":
        zoo.script = [json_reply({"error": "overloaded"}, 503, {"Retry-After": "0.01"}), json_reply(reply)]
    else:
        zoo.script = [json_reply(reply)]
    result = _rollout(zoo.server.url, "chat")
    if wrap == "sse":
        assert isinstance(result, BackendError) and "event stream" in str(result), result
        return
    if wrap == "503" and not isinstance(result, BackendError):
        assert result.attempts == 2
    _check_chat(result, reply, said, thinks=server != "openai_chat")  # OpenAI's chat shows no reasoning


@FAST
@given(said=saids, status=st.sampled_from(["completed", "incomplete", "queued", "in_progress"]))
def test_a_responses_reply_is_kept_as_it_is_or_is_a_failure_with_its_reason(zoo, said, status) -> None:
    reply = openai_response(said, status)
    zoo.script = [json_reply(reply)]
    result = _rollout(zoo.server.url, "responses")
    if status in ("queued", "in_progress"):
        assert isinstance(result, BackendError) and result.kind == "unfinished", result
        assert status in str(result) and result.attempts == 1
        return
    assert not isinstance(result, BackendError), str(result)
    assert result.fields["response"] == reply
