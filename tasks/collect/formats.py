"""Request and reply shapes: Responses-API params as Chat Completions, and chat replies as Responses."""

from __future__ import annotations

from typing import Any

CHAT_PASSTHROUGH = ("temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


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


def chat_request(params: dict[str, Any], model: str | None) -> dict[str, Any]:
    """Responses-API create params as a Chat Completions request (vLLM, SGLang, OpenAI)."""
    messages: list[dict[str, Any]] = []
    if params.get("instructions"):
        messages.append({"role": "system", "content": params["instructions"]})
    inp = params.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    else:
        for msg in inp or ():
            role = msg.get("role", "user")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content_text(msg.get("content")),
                }
            )
    body: dict[str, Any] = {"model": params.get("model") or model, "messages": messages}
    if params.get("max_output_tokens") is not None:
        body["max_tokens"] = params["max_output_tokens"]
    for key in CHAT_PASSTHROUGH:
        if key in params:
            body[key] = params[key]
    tools = params.get("tools")
    if tools and all(isinstance(t, dict) and "function" in t for t in tools):
        body["tools"] = tools
    return body


def chat_to_response(reply: dict[str, Any]) -> tuple[dict[str, Any], str, int]:
    """A chat.completion as a Responses-shaped object, so every backend kind yields one row shape."""
    choice = (reply.get("choices") or [{}])[0]
    text = _content_text((choice.get("message") or {}).get("content"))
    usage = reply.get("usage") or {}
    out_tokens = int(usage.get("completion_tokens") or 0)
    in_tokens = int(usage.get("prompt_tokens") or 0)
    response = {
        "id": reply.get("id"),
        "object": "response",
        "model": reply.get("model"),
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": in_tokens,
            "output_tokens": out_tokens,
            "total_tokens": in_tokens + out_tokens,
        },
        "finish_reason": choice.get("finish_reason"),
    }
    return response, text, out_tokens
