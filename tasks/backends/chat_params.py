"""Responses create params as Chat Completions body fields: passed through, mapped, or refused.

A parameter the run records as used must reach the server. Chat parameters and engine extras (top_k,
min_p, chat_template_kwargs, logprobs, max_tokens, seed, stop, ...) go through unchanged, since vLLM and
SGLang read their extras from the body; Responses parameters are mapped to their chat field; the few
that Chat Completions cannot express raise ConversionError, which the plan reports before any request.
"""

from __future__ import annotations

from typing import Any


class ConversionError(ValueError):
    """A Responses input that has no Chat Completions equivalent; the message names the item."""


# Keys the message and tool conversion consumes (formats.py).
CONVERTED = frozenset({"model", "input", "instructions", "tools", "tool_choice"})
# Responses-only keys whose neutral value asks for nothing: they are left out of the chat request.
RESPONSES_ONLY = frozenset(
    {"background", "truncation", "conversation", "previous_response_id", "prompt", "max_tool_calls"}
)
STATE = "Chat Completions keeps no server-side state; put the earlier turns in 'input'"
# key: (values that ask for nothing, why any other value is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": (
        (None, False),
        "rollflow reads each reply whole, not as Server-Sent Events; remove it or set it to false",
    ),
    "n": (
        (None, 1),
        "each request is one rollout, so the other choices would be lost; ask for several rollouts per "
        "row with --num-repeats N instead",
    ),
    "background": (
        (None, False),
        "rollflow does not poll background responses; remove it",
    ),
    "previous_response_id": ((None,), STATE),
    "conversation": ((None,), STATE),
    "prompt": (
        (None,),
        "a stored prompt template cannot be used by Chat Completions; put the prompt in 'input'",
    ),
    "max_tool_calls": ((None,), "Chat Completions has no limit on the number of tool calls"),
    "truncation": ((None, "disabled"), "Chat Completions does not truncate the input; remove it"),
    "messages": ((None,), "give the conversation as 'input' (Responses items), which rollflow converts"),
}
# Which of them the responses kind refuses too: it sends the params as they are, but reads a whole reply.
RESPONSES_REFUSED = ("stream", "background")
INCLUDE_LOGPROBS = "message.output_text.logprobs"
FORMATS = ("text", "json_object", "json_schema")


def _refuse(key: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"parameter {key!r} = {value!r:.80}: {why}")


def _refused(params: dict[str, Any], keys: tuple[str, ...] | None = None) -> None:
    for key in keys or tuple(REFUSED):
        if key in params:
            allowed, why = REFUSED[key]
            value = params[key]
            if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
                raise _refuse(key, value, why)


def _reasoning(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse("reasoning", value, "expected an object such as {'effort': 'low'}")
    for key in value:
        if key != "effort" and value[key] is not None:
            raise _refuse(
                f"reasoning.{key}",
                value[key],
                "Chat Completions replies carry no reasoning summary; only reasoning.effort has a chat "
                "equivalent (reasoning_effort)",
            )
    return {"reasoning_effort": value["effort"]} if value.get("effort") is not None else {}


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMATS:
        raise _refuse("text.format", fmt, f"expected an object whose type is one of {', '.join(FORMATS)}")
    if kind != "json_schema":
        return {"type": kind}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _text(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse("text", value, "expected an object with 'format' and/or 'verbosity'")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key == "format" and item is not None:
            out["response_format"] = _response_format(item)
        elif key == "verbosity" and item is not None:
            out["verbosity"] = item
        elif item is not None and key not in ("format", "verbosity"):
            raise _refuse(f"text.{key}", item, "has no Chat Completions equivalent")
    return out


def _include(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise _refuse("include", value, "expected a list")
    for item in value:
        if item != INCLUDE_LOGPROBS:
            raise _refuse(
                "include", item, f"Chat Completions can only include logprobs ({INCLUDE_LOGPROBS!r})"
            )
    return {"logprobs": True} if value else {}


def _mapped(params: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of the Responses parameters that have a different name or shape in chat."""
    out: dict[str, Any] = {}
    if params.get("max_output_tokens") is not None:
        limit = params["max_output_tokens"]
        for other in ("max_tokens", "max_completion_tokens"):
            if params.get(other) is not None and params[other] != limit:
                raise _refuse(
                    "max_output_tokens",
                    limit,
                    f"conflicts with {other} = {params[other]!r}; give one of them (a key of --overrides "
                    f"replaces only the row's key of the same name: to change a row's limit, override the "
                    f"key the row has)",
                )
        # the same limit given under a chat name goes under that name alone (OpenAI's reasoning models
        # refuse max_tokens beside max_completion_tokens)
        if all(params.get(other) is None for other in ("max_tokens", "max_completion_tokens")):
            out["max_tokens"] = limit
    out.update(_reasoning(params.get("reasoning")))
    out.update(_text(params.get("text")))
    out.update(_include(params.get("include")))
    if params.get("top_logprobs") is not None:
        out["top_logprobs"] = params["top_logprobs"]
        out["logprobs"] = True
    return out


MAPPED = frozenset({"max_output_tokens", "reasoning", "text", "include", "top_logprobs"})


def chat_params(params: dict[str, Any]) -> dict[str, Any]:
    """Every parameter of `params` but the messages and tools, as chat body fields; raises ConversionError.

    A field the user gave under its chat name wins over the one mapped from a Responses parameter
    (reasoning_effort over reasoning.effort, logprobs over include).
    """
    _refused(params)
    body = _mapped(params)
    for key, value in params.items():
        if key in CONVERTED or key in MAPPED or key in RESPONSES_ONLY:
            continue
        body[key] = value
    return body


def responses_param_problem(params: dict[str, Any]) -> str | None:
    """Why the responses kind cannot send `params` (it reads whole, finished replies), or None."""
    try:
        _refused(params, RESPONSES_REFUSED)
    except ConversionError as exc:
        return f"--backend-kind responses cannot send this: {exc}"
    return None
