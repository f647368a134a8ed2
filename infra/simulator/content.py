"""Deterministic answers: text, token counts and correctness are a pure function of
(prompt, rollout index, seed), so two runs against the simulator give byte-identical datasets.

For /run the row's expected_answer is known; for /v1/responses and /v1/chat/completions the simulator
sees only the prompt, so it answers a "What is A op B?" question it finds there, and otherwise a number
derived from the hash. A rollout is correct with probability correct_rate (decided by the hash).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

QUESTION = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")
WORDS = (
    "Let", "us", "work", "through", "this", "carefully", "step", "by", "first", "we", "note", "that",
    "the", "terms", "combine", "and", "so", "checking", "again", "gives", "result", "which", "is",
)  # fmt: skip


def prompt_digest(messages: Any, rollout: int, seed: int) -> bytes:
    return hashlib.blake2b(orjson.dumps([messages, rollout, seed]), digest_size=16).digest()


def _question_answer(messages: Any) -> str | None:
    text = messages if isinstance(messages, str) else orjson.dumps(messages).decode()
    found = QUESTION.findall(text)
    if not found:
        return None
    a, op, b = found[-1]
    x, y = int(a), int(b)
    return str({"+": x + y, "-": x - y, "*": x * y}[op])


def answer_for(digest: bytes, expected: str | None, correct_rate: float) -> str:
    roll = int.from_bytes(digest[:4], "big") / 2**32
    if expected is not None and roll < correct_rate:
        return expected
    wrong = int.from_bytes(digest[4:8], "big") % 1000
    if expected is not None and str(wrong) == expected:
        wrong += 1
    return str(wrong)


def completion(
    messages: Any,
    rollout: int,
    seed: int,
    expected: str | None,
    correct_rate: float,
    min_tok: int,
    max_tok: int,
) -> tuple[str, int, int, str]:
    """(text, output_tokens, input_tokens, id hex) for one rollout."""
    digest = prompt_digest(messages, rollout, seed)
    if expected is None:
        expected = _question_answer(messages)
    answer = answer_for(digest, expected, correct_rate)
    span = max(0, max_tok - min_tok)
    tokens = min_tok + (int.from_bytes(digest[8:12], "big") % (span + 1))
    n_words = max(1, tokens - 6)
    start = digest[12]
    words = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n_words))
    text = f"{words}. The answer is \\boxed{{{answer}}}"
    input_tokens = max(1, len(orjson.dumps(messages)) // 4)
    return text, tokens, input_tokens, digest.hex()


def responses_object(text: str, out_tok: int, in_tok: int, ident: str, model: str | None) -> dict[str, Any]:
    return {
        "id": f"resp_{ident}",
        "object": "response",
        "model": model or "rollflow-sim",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": f"msg_{ident}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {"input_tokens": in_tok, "output_tokens": out_tok, "total_tokens": in_tok + out_tok},
    }


def chat_object(text: str, out_tok: int, in_tok: int, ident: str, model: str | None) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{ident}",
        "object": "chat.completion",
        "created": 0,
        "model": model or "rollflow-sim",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": in_tok, "completion_tokens": out_tok, "total_tokens": in_tok + out_tok},
    }
