"""`--verifier math`: Hugging Face's math-verify, the checker verl, TRL and open-r1 reward functions use.

The gold answer is parsed as LaTeX (or a plain expression) and the reply's final answer is extracted the
way math-verify does for model output, the last \\boxed{} first (first match); SymPy then decides
equivalence, so `(x+1)^2` scores for `x^2+2x+1` and `\\frac12` for `0.5`. math-verify's own timeouts
(SIGALRM, main thread only, 0.4 ms a check) are left off: in the verifier pool, --verify-timeout-s stops
a check that runs too long by stopping its process.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _library() -> Any:
    import math_verify

    # It warns on every call that its timeouts are off; the pool's timeout is the one that applies.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


@lru_cache(maxsize=1)
def _configs() -> tuple[list[Any], list[Any]]:
    mv = _library()
    gold = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    answer = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return gold, answer


@lru_cache(maxsize=4096)
def parse_gold(expected: str) -> list[Any]:
    """The gold answer as math-verify reads it: in $...$ first (bare LaTeX), else as written; cached,
    since every rollout of a task shares it."""
    mv = _library()
    gold_configs, _ = _configs()
    text = expected.strip()
    wrapped = text if text.startswith("$") or "\\boxed" in text else f"${text}$"
    return mv.parse(wrapped, gold_configs, parsing_timeout=None) or mv.parse(
        text, gold_configs, parsing_timeout=None
    )


def math_verify_match(row: dict[str, Any], text: str) -> float:
    """1.0 when the reply's final answer is mathematically equal to expected_answer, else 0.0."""
    if "expected_answer" not in row:
        return 0.0
    gold = parse_gold(str(row["expected_answer"]))
    if not gold:
        return 0.0
    mv = _library()
    _, answer_configs = _configs()
    answer = mv.parse(text, answer_configs, extraction_mode="first_match", parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if mv.verify(gold, answer, timeout_seconds=None) else 0.0


def warm_up() -> None:
    """Import math-verify and SymPy and run one check, so a process's first real check is not the slow one."""
    math_verify_match({"expected_answer": "x^2+1"}, r"\boxed{1+x^2}")
