"""A zoo of fake inference servers on 127.0.0.1, each in its own thread (a child `rollflow` reaches it).

Each answers the way a real server does (vLLM with a reasoning parser, SGLang, DeepSeek's API, OpenAI's
Chat Completions and Responses, a gateway that sheds load with 503 + Retry-After or streams SSE), with
what the test says the model said: `Said` is the content of one reply, the servers give it their shape.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from local_http import ScriptedServer


@dataclass
class Said:
    """What the model said in one reply, whatever server shape carries it."""

    content: str | None = "the answer is 4"
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)
    logprobs: list[tuple[str, float]] | None = None
    finish_reason: str = "stop"
    choices: int = 1
    prompt_tokens: int = 9
    completion_tokens: int = 5
    reasoning_tokens: int = 0


def _logprobs(said: Said) -> dict[str, Any] | None:
    if said.logprobs is None:
        return None
    items = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": [{"token": t, "logprob": lp}]}
        for t, lp in said.logprobs
    ]
    return {"content": items}


def _tool_calls(said: Said) -> list[dict[str, Any]]:
    return [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in said.tool_calls
    ]


def _chat(said: Said, message: dict[str, Any], choice: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    one = {"index": 0, "message": message, "logprobs": _logprobs(said), "finish_reason": said.finish_reason}
    return {
        "id": "chatcmpl-zoo",
        "object": "chat.completion",
        "created": 1767225600,
        "model": "zoo-model",
        "choices": [{**one, **choice, "index": i} for i in range(said.choices)],
        "usage": {
            "prompt_tokens": said.prompt_tokens,
            "completion_tokens": said.completion_tokens,
            "total_tokens": said.prompt_tokens + said.completion_tokens,
        },
        **top,
    }


def vllm(said: Said, field_name: str = "reasoning_content") -> dict[str, Any]:
    """vLLM with --reasoning-parser (older versions say reasoning_content, newer ones reasoning)."""
    message = {
        "role": "assistant",
        "content": said.content,
        field_name: said.reasoning,
        "tool_calls": _tool_calls(said),
        "refusal": said.refusal,
        "function_call": None,
    }
    return _chat(said, message, {"stop_reason": None}, {"prompt_logprobs": None, "kv_transfer_params": None})


def vllm_new(said: Said) -> dict[str, Any]:
    return vllm(said, "reasoning")


def sglang(said: Said) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": said.content,
        "reasoning_content": said.reasoning,
        "tool_calls": _tool_calls(said) or None,
    }
    if said.refusal:
        message["refusal"] = said.refusal
    return _chat(said, message, {"matched_stop": 151645 if said.finish_reason == "stop" else None}, {})


def deepseek(said: Said) -> dict[str, Any]:
    message = {"role": "assistant", "content": said.content, "reasoning_content": said.reasoning}
    if said.tool_calls:
        message["tool_calls"] = _tool_calls(said)
    if said.refusal:
        message["refusal"] = said.refusal
    reply = _chat(said, message, {}, {"system_fingerprint": "fp_zoo_deepseek"})
    reply["usage"] |= {
        "prompt_cache_hit_tokens": 3,
        "prompt_cache_miss_tokens": said.prompt_tokens - 3,
        "completion_tokens_details": {"reasoning_tokens": said.reasoning_tokens},
    }
    return reply


def openai_chat(said: Said) -> dict[str, Any]:
    message = {"role": "assistant", "content": said.content, "refusal": said.refusal, "annotations": []}
    if said.tool_calls:
        message["tool_calls"] = _tool_calls(said)
    reply = _chat(said, message, {}, {"service_tier": "default", "system_fingerprint": "fp_zoo"})
    reply["usage"] |= {
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": said.reasoning_tokens, "audio_tokens": 0},
    }
    return reply


CHAT_SERVERS: dict[str, Callable[[Said], dict[str, Any]]] = {
    "vllm": vllm,
    "vllm_new": vllm_new,
    "sglang": sglang,
    "deepseek": deepseek,
    "openai_chat": openai_chat,
}


def openai_response(said: Said, status: str = "completed") -> dict[str, Any]:
    """OpenAI's Responses API; `status` queued or in_progress is its answer to background: true."""
    output: list[dict[str, Any]] = []
    if status not in ("queued", "in_progress"):
        if said.reasoning:
            output.append(
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": said.reasoning}],
                }
            )
        parts: list[dict[str, Any]] = []
        if said.content:
            parts.append({"type": "output_text", "text": said.content, "annotations": []})
        if said.refusal:
            parts.append({"type": "refusal", "refusal": said.refusal})
        if parts:
            output.append(
                {"type": "message", "id": "msg_1", "role": "assistant", "status": status, "content": parts}
            )
        output += [
            {
                "type": "function_call",
                "id": f"fc_{i}",
                "call_id": i,
                "name": n,
                "arguments": a,
                "status": status,
            }
            for i, n, a in said.tool_calls
        ]
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": "resp_zoo",
        "object": "response",
        "created_at": 1767225600,
        "status": status,
        "background": status in ("queued", "in_progress"),
        "incomplete_details": incomplete,
        "model": "zoo-model",
        "output": output,
        "usage": None
        if status in ("queued", "in_progress")
        else {
            "input_tokens": said.prompt_tokens,
            "output_tokens": said.completion_tokens,
            "total_tokens": 14,
        },
    }


def sse(reply: dict[str, Any]) -> web.Response:
    """The reply as a Server-Sent Events stream, as a gateway that streams whatever it is asked sends it."""
    body = b"data: " + orjson.dumps(reply) + b"\n\ndata: [DONE]\n\n"
    return web.Response(body=body, headers={"Content-Type": "text/event-stream"})


def json_reply(reply: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(reply),
        headers={"Content-Type": "application/json", **(headers or {})},
    )


class ThreadedServer:
    """A ScriptedServer in its own thread and loop; `handler(request)` answers each request."""

    def __init__(self, handler: Callable[[web.Request], Any]) -> None:
        self.handler = handler
        self.server = ScriptedServer()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""
        self.times: list[float] = []

    async def _reply(self, request: web.Request) -> web.StreamResponse:
        self.times.append(time.monotonic())
        reply = self.handler(request)
        if asyncio.iscoroutine(reply):
            reply = await reply
        return reply

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(self._reply), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def seen(self) -> list[Any]:
        return list(self.server.seen)
