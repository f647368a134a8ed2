"""Replies checked against their backend kind's shape, then read into a rollout's fields.

A gateway that answers HTTP 200 with `{"error": {...}}` must not become an empty, reward-0 rollout: a
reply without the parts its kind always has raises ReplyShapeError, which the client retries and then
records as a failure.
"""

from __future__ import annotations

from typing import Any

from rollflow.settings.redact import redact
from rollflow.tasks.storage import rowjson

MAX_DETAIL = 300
UNFINISHED = ("queued", "in_progress")


class ReplyShapeError(ValueError):
    """The reply is not what the backend kind answers; the message says what was found instead."""


class UnfinishedReply(ReplyShapeError):
    """A response still queued or in progress (a background response): there is nothing to keep yet."""


def error_detail(reply: dict[str, Any]) -> str:
    error = reply.get("error")
    if isinstance(error, dict):
        error = error.get("message") or error
    detail = f"error object: {error}" if error else f"keys {sorted(reply)[:8]}"
    return redact(detail)[:MAX_DETAIL]  # masked before it is cut, which could leave part of a key


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
        found = error_detail(response) if isinstance(response, dict) else type(response).__name__
        raise ReplyShapeError(f"{what} is not a response with an 'output' list ({found})")
    status = response.get("status")
    if response.get("error") or status in ("failed", "cancelled"):
        raise ReplyShapeError(f"{what} is a {status or 'failed'} response ({error_detail(response)})")
    if status in UNFINISHED:
        raise UnfinishedReply(
            f"{what} has status {status!r}: it is not finished (a background response?) and rollflow "
            f"does not poll for it; send the request without 'background'"
        )
    return response


def agent_response(reply: dict[str, Any]) -> dict[str, Any]:
    """A NeMo Gym agent's `response`, checked; an error object in its place raises with its message."""
    if not isinstance(reply.get("response"), dict):
        raise ReplyShapeError(f"the agent's reply has no 'response' object ({error_detail(reply)})")
    return check_response(reply["response"], "the agent's response")


def agent_reward(reply: dict[str, Any]) -> float | None:
    """The agent's reward; None when it gives none (a verifier scores); a non-number raises."""
    if "reward" not in reply:
        return None
    reward = reply["reward"]
    if not rowjson.is_reward(reward):
        raise ReplyShapeError(f"the agent's reward is {reward!r}, not a finite number")
    return reward
