"""A chat.completion read into a Responses object, losing nothing the reply said.

The answer, the chain of thought (`reasoning_content` / `reasoning`, as vLLM, SGLang and DeepSeek send
it), a refusal, tool calls, logprobs, usage details and any field this module does not know are all
kept; a reply cut at the token limit or withheld by a filter is `status: incomplete` with
`incomplete_details.reason`, as the Responses API has it. A reply that cannot be kept whole raises
ReplyShapeError, so the rollout is a failure with its reason, never a row that says less.
"""

from __future__ import annotations

from typing import Any

from rollflow.tasks.backends.replies import ReplyShapeError, error_detail

# finish_reason -> incomplete_details.reason (Mistral says model_length for the token limit)
INCOMPLETE = {
    "length": "max_output_tokens",
    "model_length": "max_output_tokens",
    "content_filter": "content_filter",
}
# The server gave up on the request: its partial text is no answer.
ABORTED = ("abort", "error")
REASONING_KEYS = ("reasoning_content", "reasoning")
KNOWN_MESSAGE = frozenset({"role", "content", "tool_calls", "refusal", *REASONING_KEYS})
KNOWN_CHOICE = frozenset({"index", "message", "finish_reason", "logprobs"})
KNOWN_REPLY = frozenset({"id", "object", "model", "created", "choices", "usage"})


def _said(value: Any) -> bool:
    """Whether a field carries anything (servers send null, "" and [] for what they did not produce)."""
    return value not in (None, "", [], {})


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise ReplyShapeError(f"the chat reply's content has a part that is not text: {part!r:.200}")
        return "".join(p["text"] for p in content)
    raise ReplyShapeError(f"the chat reply's content is a {type(content).__name__}, not text")


def _tool_call_items(calls: Any) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ReplyShapeError(f"the chat reply's tool_calls is not a list: {calls!r:.200}")
    items = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ReplyShapeError(f"a tool call in the chat reply has no 'function' object: {call!r:.200}")
        extra = {k: v for k, v in call.items() if k not in ("id", "type", "function") and _said(v)}
        extra |= {k: v for k, v in fn.items() if k not in ("name", "arguments") and _said(v)}
        items.append(
            {
                "type": "function_call",
                "call_id": call.get("id"),
                "name": fn.get("name"),
                "arguments": fn.get("arguments"),
                "status": "completed",
                **extra,
            }
        )
    return items


def _reasoning_item(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """The chain of thought as a Responses reasoning item (its text in `content`, as vLLM's Responses
    API puts it); both spellings are kept when a server sends two different texts."""
    texts: list[str] = []
    for key in REASONING_KEYS:
        value = message.get(key)
        if not _said(value):
            continue
        if not isinstance(value, str):
            raise ReplyShapeError(f"the chat reply's {key} is a {type(value).__name__}, not text")
        if value not in texts:
            texts.append(value)
    if not texts:
        return []
    content = [{"type": "reasoning_text", "text": t} for t in texts]
    return [{"type": "reasoning", "summary": [], "content": content, "status": status}]


def _message_item(
    message: dict[str, Any], text: str, logprobs: dict[str, Any], status: str, has_calls: bool
) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    extra = {k: v for k, v in message.items() if k not in KNOWN_MESSAGE and _said(v)}
    refusal = message.get("refusal")
    if _said(refusal) and not isinstance(refusal, str):
        raise ReplyShapeError(f"the chat reply's refusal is a {type(refusal).__name__}, not text")
    # an empty answer is kept as one, except beside a refusal or tool calls, where it says nothing
    if text or extra or "content" in logprobs or not (has_calls or _said(refusal)):
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if "content" in logprobs:
            part["logprobs"] = logprobs.pop("content")
        content.append(part)
    if _said(refusal):
        part = {"type": "refusal", "refusal": refusal}
        if "refusal" in logprobs:
            part["logprobs"] = logprobs.pop("refusal")
        content.append(part)
    if not content:
        return []
    return [{"type": "message", "role": "assistant", "status": status, "content": content, **extra}]


def _logprobs(choice: dict[str, Any]) -> dict[str, Any]:
    """choice.logprobs as {"content": [...], "refusal": [...], ...}; any other shape is kept whole."""
    value = choice.get("logprobs")
    if not _said(value):
        return {}
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if _said(v)}
    return {"other": value}


def _usage(usage: Any) -> dict[str, Any] | None:
    """usage under the Responses names, with the values the server gave; None when it gave none (a
    made-up 0 would count as a measured length in the report)."""
    if not isinstance(usage, dict):
        return None
    renamed = {
        "prompt_tokens": "input_tokens",
        "completion_tokens": "output_tokens",
        "prompt_tokens_details": "input_tokens_details",
        "completion_tokens_details": "output_tokens_details",
    }
    out = {renamed.get(key, key): value for key, value in usage.items() if _said(value)}
    counts = (out.get("input_tokens"), out.get("output_tokens"))
    if "total_tokens" not in out and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        out["total_tokens"] = counts[0] + counts[1]  # the Responses shape always has it
    return out


def _output_tokens(usage: dict[str, Any] | None) -> int:
    value = (usage or {}).get("output_tokens")
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _status(finish: Any) -> tuple[str, dict[str, Any] | None]:
    if finish in ABORTED:
        raise ReplyShapeError(f"the server ended the reply with finish_reason {finish!r}")
    reason = INCOMPLETE.get(finish) if isinstance(finish, str) else None
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def chat_to_response(reply: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
    """(Responses-shaped object, the answer's text, output tokens) of a chat.completion; raises
    ReplyShapeError for a reply that is not one, or has several choices (one request is one rollout)."""
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ReplyShapeError(f"reply has no choices[0].message ({error_detail(reply)})")
    if len(choices) > 1:
        raise ReplyShapeError(f"reply has {len(choices)} choices where one was asked for; none is kept")
    status, incomplete = _status(choice.get("finish_reason"))
    text = _text_of(message.get("content"))
    calls = _tool_call_items(message.get("tool_calls"))
    logprobs = _logprobs(choice)
    output = [
        *_reasoning_item(message, status),
        *_message_item(message, text, logprobs, status, bool(calls)),
        *calls,
    ]
    usage = _usage(reply.get("usage"))
    response: dict[str, Any] = {
        "id": reply.get("id"),
        "object": "response",
        "model": reply.get("model"),
        "status": status,
        "incomplete_details": incomplete,
        "output": output,
        "usage": usage,
        "finish_reason": choice.get("finish_reason"),
    }
    if "created" in reply:
        response["created_at"] = reply["created"]
    if logprobs:
        response["logprobs"] = logprobs
    for source, known in ((reply, KNOWN_REPLY), (choice, KNOWN_CHOICE)):
        for key, value in source.items():
            if key not in known and key not in response and _said(value):
                response[key] = value
    return response, text, _output_tokens(usage)
