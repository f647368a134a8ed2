"""Deterministic answers: text, token counts, ids and correctness are a pure function of
(canonical JSON of the prompt's `input` messages, rollout index, seed), so two runs against the simulator
give byte-identical replies and datasets. A request that carries its own sampling `seed` (top level for
chat and Responses, in `responses_create_params` for /run) is answered from that seed instead of its
rollout index, as a seeded engine samples: the same seed gives the same reply, another seed another.

Where the expected answer comes from:
- /run gets the whole NeMo Gym row, so it uses the row's `expected_answer` and computes the reward.
- /v1/responses and /v1/chat/completions see only the request; they use a top-level
  `metadata.expected_answer` if the request carries one, else the answer to the last "A op B" arithmetic
  question in the prompt ("What is 12 + 7?"), else none.
A rollout is correct with probability `correct_rate` (decided by the hash); a wrong or answer-less rollout
ends with a number derived from the hash that differs from the expected answer. Every text ends with
`The answer is \\boxed{N}`, which is what /verify (and rollflow's math verifier) read.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from typing import Any, NamedTuple

import orjson

QUESTION = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")
WORDS = (
    "Let", "us", "work", "through", "this", "carefully", "step", "by", "first", "we", "note", "that",
    "the", "terms", "combine", "and", "so", "checking", "again", "gives", "result", "which", "is",
)  # fmt: skip
CACHE_SIZE = 4096


class Completion(NamedTuple):
    """One rollout's generated content; ident is the hex digest the reply ids are made from."""

    text: str
    output_tokens: int
    input_tokens: int
    ident: str


def canonical(messages: Any) -> bytes:
    """Key-order-independent JSON of the prompt, the input of every hash."""
    return orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)


Draw = int | tuple[str, int]  # the rollout index, or ("seed", n) when the request carries a sampling seed


def prompt_digest(canon: bytes, draw: Draw, seed: int) -> bytes:
    """16 bytes of hash that every deterministic choice of one rollout is cut from: a request's own
    sampling seed replaces its rollout index, as a seeded engine's sample depends on the seed alone."""
    key = b"%d" % draw if isinstance(draw, int) else b"s%d" % draw[1]
    return hashlib.blake2b(b"%d\x00%s\x00%s" % (seed, key, canon), digest_size=16).digest()


def question_answer(canon: bytes) -> str | None:
    """The answer to the last "A op B" in the prompt, or None."""
    found = QUESTION.findall(canon.decode())
    if not found:
        return None
    a, op, b = found[-1]
    x, y = int(a), int(b)
    return str({"+": x + y, "-": x - y, "*": x * y}[op])


Difficulty = tuple[str, float]  # ("flat", _) or ("spread", settled share)
FLAT: Difficulty = ("flat", 0.0)
SPREAD_LOW, SPREAD_HIGH = 0.2, 0.8


def task_rate(canon: bytes, seed: int, correct_rate: float, difficulty: Difficulty) -> float:
    """The prompt's chance of a correct rollout. "spread": a hash of the prompt alone (not the rollout)
    puts it among the settled share, half always solved and half never, or at a rate spread evenly over
    [SPREAD_LOW, SPREAD_HIGH]; "flat": correct_rate for every prompt."""
    kind, settled_share = difficulty
    if kind == "flat":
        return correct_rate
    h = hashlib.blake2b(b"%d\x00task\x00%s" % (seed, canon), digest_size=8).digest()
    pick = int.from_bytes(h[:4], "big") / 2**32
    spread = int.from_bytes(h[4:], "big") / 2**32
    if pick < settled_share:
        return 1.0 if pick < settled_share / 2 else 0.0
    return SPREAD_LOW + (SPREAD_HIGH - SPREAD_LOW) * spread


def answer_for(digest: bytes, expected: str | None, correct_rate: float) -> str:
    """The expected answer with probability correct_rate, else a hash-derived number that is not it."""
    roll = int.from_bytes(digest[:4], "big") / 2**32
    if expected is not None and roll < correct_rate:
        return expected
    wrong = int.from_bytes(digest[4:8], "big") % 1000
    if expected is not None and str(wrong) == expected:
        wrong += 1
    return str(wrong)


def completion(
    messages: Any,
    rollout: Draw,
    seed: int,
    expected: str | None,
    correct_rate: float,
    min_tok: int,
    max_tok: int,
    difficulty: Difficulty = FLAT,
) -> Completion:
    """Generate one rollout's content (uncached; see ContentModel for the cached path)."""
    canon = canonical(messages)
    digest = prompt_digest(canon, rollout, seed)
    if expected is None:
        expected = question_answer(canon)
    answer = answer_for(digest, expected, task_rate(canon, seed, correct_rate, difficulty))
    span = max(0, max_tok - min_tok)
    tokens = min_tok + (int.from_bytes(digest[8:12], "big") % (span + 1))
    n_words = max(1, tokens - 6)
    start = digest[12]
    words = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n_words))
    text = f"{words}. The answer is \\boxed{{{answer}}}"
    input_tokens = max(1, len(canon) // 4)
    return Completion(text, tokens, input_tokens, digest.hex())


class ContentModel:
    """completion() behind a small LRU: retries and repeated runs of one rollout cost a dict lookup."""

    def __init__(
        self, seed: int, correct_rate: float, min_tokens: int, max_tokens: int, difficulty: Difficulty = FLAT
    ) -> None:
        self.args = (seed, correct_rate, min_tokens, max_tokens)
        self.difficulty = difficulty
        self.cache: OrderedDict[tuple[bytes, Draw, str | None], Completion] = OrderedDict()

    def get(self, messages: Any, rollout: Draw, expected: str | None) -> Completion:
        """The rollout's content; the LRU key is the exact prompt bytes, so hits are always exact."""
        key = (orjson.dumps(messages), rollout, expected)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        seed, rate, lo, hi = self.args
        made = completion(messages, rollout, seed, expected, rate, lo, hi, self.difficulty)
        self.cache[key] = made
        if len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return made


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def reward(text: str, expected: Any) -> float:
    """1.0 if the last \\boxed{} (or, without one, the final line) equals expected_answer, else 0.0."""
    if expected is None:
        return 0.0
    boxed = last_boxed(text)
    if boxed is not None:
        candidate = boxed
    else:
        lines = text.strip().splitlines()
        candidate = lines[-1] if lines else ""
    return 1.0 if candidate.strip() == str(expected).strip() else 0.0


def response_text(response: Any) -> str:
    """All output_text of a Responses object, concatenated (what a verifier reads)."""
    if not isinstance(response, dict):
        return ""
    parts: list[str] = []
    for item in response.get("output") or ():
        if isinstance(item, dict):
            for part in item.get("content") or ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
    return "".join(parts)


def responses_object(c: Completion, model: str | None) -> dict[str, Any]:
    """An OpenAI Responses API object for the completion (ids derived from the hash, so deterministic)."""
    return {
        "id": f"resp_{c.ident}",
        "object": "response",
        "model": model or "rollflow-sim",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": f"msg_{c.ident}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": c.text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": c.input_tokens,
            "output_tokens": c.output_tokens,
            "total_tokens": c.input_tokens + c.output_tokens,
        },
    }


def chat_object(c: Completion, model: str | None) -> dict[str, Any]:
    """An OpenAI chat.completion object for the completion (created=0 keeps it byte-identical)."""
    return {
        "id": f"chatcmpl-{c.ident}",
        "object": "chat.completion",
        "created": 0,
        "model": model or "rollflow-sim",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": c.input_tokens,
            "completion_tokens": c.output_tokens,
            "total_tokens": c.input_tokens + c.output_tokens,
        },
    }
