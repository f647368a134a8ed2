"""Responses tools, tool choices, function calls and their outputs as Chat Completions, and back."""

from __future__ import annotations

import pytest

from rollflow.tasks.backends.chat_reply import chat_to_response
from rollflow.tasks.backends.formats import ConversionError, chat_problem, chat_request

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def test_function_tools_and_tool_choice_become_chat_tools() -> None:
    body = chat_request(
        {
            "input": "Weather in Paris?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
        "m",
    )
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    for word in ("auto", "none", "required"):
        assert chat_request({"input": "x", "tool_choice": word}, "m")["tool_choice"] == word


def test_function_calls_and_outputs_become_tool_calls_and_tool_messages() -> None:
    params = {
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "summary": []},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "function_call_output", "call_id": "c2", "output": {"temp": 21}},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Mild."}]},
        ],
        "tools": [WEATHER],
    }
    assert chat_request(params, "m")["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"temp":21}'},
        {"role": "assistant", "content": "Mild."},
    ]


@pytest.mark.parametrize(
    "params",
    [
        {"input": ["plain", "strings"]},
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        {"input": [{"type": "web_search_call", "id": "w"}]},
        {"input": [{"type": "function_call", "call_id": "c"}]},
        {"input": "x", "tools": [{"type": "web_search"}]},
        {"input": "x", "tool_choice": {"type": "web_search"}},
        {"input": 42},
    ],
)
def test_what_chat_cannot_express_is_refused_never_an_empty_message(params: dict) -> None:
    with pytest.raises(ConversionError):
        chat_request(params, "m")
    assert "--backend-kind chat cannot send this row" in (chat_problem(params) or "")


def test_reply_tool_calls_become_function_call_items() -> None:
    reply = {
        "id": "x",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c9",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
    }
    response, text, _ = chat_to_response(reply)
    assert text == "" and response["output"] == [
        {
            "type": "function_call",
            "call_id": "c9",
            "name": "get_weather",
            "arguments": "{}",
            "status": "completed",
        }
    ]
