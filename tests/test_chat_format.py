"""Responses-API params to Chat Completions and back, so every backend kind gives one row shape."""

from __future__ import annotations

from rollflow.tasks.backends.chat_reply import chat_to_response
from rollflow.tasks.backends.formats import chat_request
from rollflow.tasks.backends.replies import responses_text


def test_chat_request_conversion() -> None:
    params = {
        "instructions": "be brief",
        "input": [
            {"role": "developer", "content": "sys"},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
        ],
        "max_output_tokens": 64,
        "temperature": 0.7,
        "reasoning": {"effort": "low"},
    }
    body = chat_request(params, "m")
    assert body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "ab"},
        ],
        "max_tokens": 64,
        "temperature": 0.7,
        "reasoning_effort": "low",
    }
    assert chat_request({"input": "hi"}, None)["messages"] == [{"role": "user", "content": "hi"}]


def test_chat_reply_becomes_responses_shape() -> None:
    reply = {
        "id": "c1",
        "model": "m",
        "choices": [{"message": {"role": "assistant", "content": "x \\boxed{3}"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7},
    }
    response, text, tokens = chat_to_response(reply)
    assert text == "x \\boxed{3}" and tokens == 7
    assert responses_text(response) == text
    assert response["usage"] == {"input_tokens": 5, "output_tokens": 7, "total_tokens": 12}
