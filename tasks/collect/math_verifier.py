"""`--verifier math`: Hugging Face's math-verify, the checker verl, TRL and open-r1 reward functions use.

The gold answer is parsed as LaTeX (or a plain expression) and the reply's final answer is extracted the
way math-verify does, the last \\boxed{} first; SymPy then decides equivalence, so `(x+1)^2` scores for
`x^2+2x+1` and `\\frac12` for `0.5`. math-verify's own timeouts use SIGALRM, which works only in a
process's main thread: elsewhere (a verifier thread of the collecting process) they are left off rather
than failing every check.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5


@lru_cache(maxsize=1)
def _configs() -> tuple[list[Any], list[Any]]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    gold = [LatexExtractionConfig(), ExprExtractionConfig()]
    answer = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return gold, answer


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


def parse_gold(expected: Any) -> list[Any]:
    """The gold answer as math-verify reads it: in $...$ first (bare LaTeX), else as written."""
    from math_verify import parse

    gold_configs, _ = _configs()
    text = str(expected).strip()
    timeout = _timeout(PARSE_TIMEOUT_S)
    wrapped = text if text.startswith("$") or "\\boxed" in text else f"${text}$"
    return parse(wrapped, gold_configs, parsing_timeout=timeout) or parse(
        text, gold_configs, parsing_timeout=timeout
    )


def math_verify_match(row: dict[str, Any], text: str) -> float:
    """1.0 when the reply's final answer is mathematically equal to expected_answer, else 0.0."""
    if "expected_answer" not in row:
        return 0.0
    from math_verify import parse, verify

    gold = parse_gold(row["expected_answer"])
    if not gold:
        return 0.0
    _, answer_configs = _configs()
    answer = parse(text, answer_configs, parsing_timeout=_timeout(PARSE_TIMEOUT_S))
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=_timeout(VERIFY_TIMEOUT_S)) else 0.0


def warm_up() -> None:
    """Import math-verify and SymPy and run one check, so a process's first real check is not the slow one."""
    math_verify_match({"expected_answer": "x^2+1"}, r"\boxed{1+x^2}")
