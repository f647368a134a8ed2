"""Built-in verifiers and the content cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollflow.settings import VerifySettings
from rollflow.tasks.backends.backends import RolloutResult
from rollflow.tasks.verify.verifiers import VerifierError, exact_match, last_boxed, make_verifier, math_match


def result(text: str) -> RolloutResult:
    return RolloutResult({"response": {}}, None, text, 1, 0.0, 1)


def test_last_boxed_balanced() -> None:
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}} end") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{open") is None


@pytest.mark.parametrize(
    ("text", "expected", "reward"),
    [
        (r"so \boxed{42}", "42", 1.0),
        (r"so \boxed{ 1/2 }", "0.5", 1.0),
        (r"so \boxed{$3.0$}", "3", 1.0),
        (r"so \boxed{41}", "42", 0.0),
        ("42", "42", 0.0),
    ],
)
def test_math(text: str, expected: str, reward: float) -> None:
    assert math_match({"expected_answer": expected}, text) == reward


def test_exact_match() -> None:
    assert exact_match({"expected_answer": "Paris"}, " Paris ") == 1.0
    assert exact_match({"expected_answer": "7"}, r"it is \boxed{7}") == 1.0
    assert exact_match({}, "anything") == 0.0


async def test_callable_verifier_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A callable may read any field of the row: the cache reuses a reward only for the same row and text."""
    (tmp_path / "my_reward.py").write_text(
        "calls = []\nasync def score(row, text):\n    calls.append((row['id'], text))\n"
        "    return row['weight'] * len(text) / 10\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    verify = make_verifier(VerifySettings(verifier="my_reward:score"))
    assert verify is not None
    first, second = {"id": 1, "weight": 1.0}, {"id": 2, "weight": 2.0}
    assert await verify(first, result("abcde")) == 0.5
    assert await verify(dict(first), result("abcde")) == 0.5
    assert await verify(second, result("abcde")) == 1.0
    assert sys.modules["my_reward"].calls == [(1, "abcde"), (2, "abcde")]


def test_bad_specs() -> None:
    with pytest.raises(VerifierError, match="module:function"):
        make_verifier(VerifySettings(verifier="no_such_module_xyz:f"))
    with pytest.raises(VerifierError, match="Unknown verifier"):
        make_verifier(VerifySettings.model_construct(verifier="fuzzy", url=None, timeout_s=60.0))
    with pytest.raises(VerifierError, match="--verifier-url"):
        make_verifier(VerifySettings(verifier="http"))
    assert make_verifier(VerifySettings(verifier="none")) is None
