"""Responses-API create params as a Chat Completions request (vLLM, SGLang, OpenAI), tools included.

Anything the conversion cannot express raises ConversionError; the plan runs the same conversion on every
row of a chat run, so such a row is a bad row named by its line, never an empty or partial message.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollflow.tasks.backends.chat_params import ConversionError, chat_params, responses_param_problem

__all__ = ["ConversionError", "chat_problem", "chat_request", "overrides_problem", "request_problem"]
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_CHOICE_WORDS = ("auto", "none", "required")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Message content: text parts joined into one string; with images, a list of chat content parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversionError(f"{where}: content is {type(content).__name__}, expected a string or parts")
    parts: list[dict[str, Any]] = []
    for n, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise ConversionError(f"{where}, content part {n}: {_describe(part)} has no chat equivalent")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _describe(item: Any) -> str:
    if isinstance(item, dict):
        return f"an item of type {item.get('type', 'message')!r}"
    return f"a {type(item).__name__}"


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ConversionError(f"{where}: a function_call needs a string 'name' and 'arguments'")
    call_id = item.get("call_id") or item.get("id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _messages(params: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if params.get("instructions"):
        messages.append({"role": "system", "content": params["instructions"]})
    inp = params.get("input")
    if isinstance(inp, str):
        return [*messages, {"role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise ConversionError(f"input is {type(inp).__name__}, expected a string or a list of items")
    for n, item in enumerate(inp):
        where = f"input item {n}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = _tool_call(item, where)
            last = messages[-1] if messages else None
            if (
                last is not None
                and last["role"] == "assistant"
                and isinstance(last.get("content"), str | None)
            ):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # content parts, as a message's content
                text: Any = _content(output, f"{where}, output")
            else:
                text = output if isinstance(output, str) else orjson.dumps(output).decode()
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":
            raise ConversionError(f"{where}: {_describe(item)} has no chat equivalent")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise ConversionError(f"tools is {type(tools).__name__}, expected a list")
    out = []
    for n, tool in enumerate(tools):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            out.append(tool)
        elif isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str):
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            out.append({"type": "function", "function": fn})
        else:
            raise ConversionError(f"tool {n}: {_describe(tool)} has no chat equivalent (function tools only)")
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in TOOL_CHOICE_WORDS:
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ConversionError(f"tool_choice {choice!r} has no chat equivalent")


def chat_request(params: dict[str, Any], model: str | None) -> dict[str, Any]:
    """Responses-API create params as a Chat Completions request; raises ConversionError."""
    body: dict[str, Any] = {
        "model": params.get("model") or model,
        "messages": _messages(params),
        **chat_params(params),
    }
    if params.get("tools"):
        body["tools"] = _tools(params["tools"])
    if params.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(params["tool_choice"])
    return body


def chat_problem(params: dict[str, Any]) -> str | None:
    """Why a row's params cannot be sent as a chat request, or None when they can."""
    try:
        chat_request(params, None)
    except ConversionError as exc:
        return f"--backend-kind chat cannot send this row: {exc}"
    return None


def request_problem(params: dict[str, Any], kind: str) -> str | None:
    """Why backend `kind` cannot send a row with `params`, or None (the agent kind sends rows as they are)."""
    if kind == "chat":
        return chat_problem(params)
    if kind == "responses":
        return responses_param_problem(params)
    return None


def overrides_problem(overrides: dict[str, Any], kind: str) -> str | None:
    """Why backend `kind` cannot send the parameters of --overrides, or None; the messages are the rows'."""
    try:
        if kind == "chat":
            chat_params(overrides)
        elif kind == "responses" and (problem := responses_param_problem(overrides)):
            return problem.replace("cannot send this", "cannot send it")
    except ConversionError as exc:
        return f"--backend-kind chat cannot send it: {exc}"
    return None
