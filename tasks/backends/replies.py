"""Replies checked against their backend kind's shape, then read into a rollout's fields.

A gateway that answers HTTP 200 with `{"error": {...}}` must not become an empty, reward-0 rollout: a
reply without the parts its kind always has raises ReplyShapeError, which the client retries and then
records as a failure.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DETAIL = 300


class ReplyShapeError(ValueError):
    """The reply is not what the backend kind answers; the message says what was found instead."""


def _error_detail(reply: dict[str, Any]) -> str:
    error = reply.get("error")
    if isinstance(error, dict):
        error = error.get("message") or error
    detail = f"error object: {error}" if error else f"keys {sorted(reply)[:8]}"
    return detail[:MAX_DETAIL]


def responses_text(response: Any) -> str:
    """The assistant's final text: the output_text parts of the response's message items."""
    if not isinstance(response, dict):
        return ""
    parts = []
    for item in response.get("output") or ():
        if isinstance(item, dict) and item.get("type") == "message":
            parts.extend(
                c.get("text", "")
                for c in item.get("content") or ()
                if isinstance(c, dict) and c.get("type") == "output_text"
            )
    return "".join(parts)


def check_response(response: Any, what: str = "reply") -> dict[str, Any]:
    """A Responses object: an `output` list and no error; anything else raises."""
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        found = _error_detail(response) if isinstance(response, dict) else type(response).__name__
        raise ReplyShapeError(f"{what} is not a response with an 'output' list ({found})")
    if response.get("error") or response.get("status") == "failed":
        raise ReplyShapeError(f"{what} is a failed response ({_error_detail(response)})")
    return response


def agent_response(reply: dict[str, Any]) -> dict[str, Any]:
    """A NeMo Gym agent's `response`, checked; an error object in its place raises with its message."""
    if not isinstance(reply.get("response"), dict):
        raise ReplyShapeError(f"the agent's reply has no 'response' object ({_error_detail(reply)})")
    return check_response(reply["response"], "the agent's response")


def agent_reward(reply: dict[str, Any]) -> float | None:
    """The agent's reward; None when it gives none (a verifier scores); a non-number raises."""
    if "reward" not in reply:
        return None
    reward = reply["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ReplyShapeError(f"the agent's reward is {reward!r}, not a finite number")
    return reward


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _tool_call_items(calls: Any) -> list[dict[str, Any]]:
    items = []
    for call in calls or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ReplyShapeError(f"a tool call in the chat reply has no 'function' object: {call!r:.200}")
        items.append(
            {
                "type": "function_call",
                "call_id": call.get("id"),
                "name": fn.get("name"),
                "arguments": fn.get("arguments"),
                "status": "completed",
            }
        )
    return items


def chat_to_response(reply: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
    """A chat.completion as a Responses-shaped object, so every backend kind yields one row shape."""
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ReplyShapeError(f"reply has no choices[0].message ({_error_detail(reply)})")
    text = _text_of(message.get("content"))
    calls = _tool_call_items(message.get("tool_calls"))
    usage = reply.get("usage") or {}
    out_tokens = int(usage.get("completion_tokens") or 0)
    in_tokens = int(usage.get("prompt_tokens") or 0)
    output: list[dict[str, Any]] = []
    if text or not calls:
        output.append(
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    response = {
        "id": reply.get("id"),
        "object": "response",
        "model": reply.get("model"),
        "output": output + calls,
        "usage": {
            "input_tokens": in_tokens,
            "output_tokens": out_tokens,
            "total_tokens": in_tokens + out_tokens,
        },
        "finish_reason": choice.get("finish_reason"),
    }
    return response, text, out_tokens
