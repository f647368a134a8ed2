"""Verifiers: exact_match, math, an HTTP /verify server on 127.0.0.1, module:function, the cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from aiohttp import web
from local_http import RESPONSE, ScriptedServer

from rollflow.settings import VerifySettings
from rollflow.tasks.backends.backends import BackendError, RolloutResult
from rollflow.tasks.backends.retry import RetryPolicy
from rollflow.tasks.verify.verifiers import (
    CachedVerifier,
    VerifierError,
    answer_view,
    exact_match,
    last_boxed,
    make_verifier,
    math_match,
    verifier_cache_key,
)

FAST = RetryPolicy(max_retries=2, base_s=0.01, max_s=0.05)


def result(text: str) -> RolloutResult:
    return RolloutResult({"response": RESPONSE}, None, text, 1, 0.0, 1)


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"\boxed{1} and \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b}}} end", r"\sqrt{\frac{a}{b}}"),
        (r"\boxed{}", ""),
        ("no box here", None),
        (r"\boxed{never closed", None),
    ],
)
def test_last_boxed(text: str, boxed: str | None) -> None:
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("text", "expected", "reward"),
    [
        ("  Paris \n", "Paris", 1.0),
        (r"The capital is \boxed{ Paris }", "Paris", 1.0),
        ("paris", "Paris", 0.0),
        ("42", 42, 1.0),
        (r"\boxed{41}", "42", 0.0),
    ],
)
def test_exact_match(text: str, expected: object, reward: float) -> None:
    assert exact_match({"expected_answer": expected}, text) == reward


def test_exact_match_without_expected_answer_is_zero() -> None:
    assert exact_match({}, "anything") == 0.0 and math_match({}, r"\boxed{1}") == 0.0


@pytest.mark.parametrize(
    ("text", "expected", "reward"),
    [
        (r"first \boxed{7} then \boxed{42}", "42", 1.0),
        (r"\boxed{7} then \boxed{42}", "7", 0.0),
        (r"\boxed{ 1/2 }", "0.5", 1.0),
        (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
        (r"\boxed{$3.0$}", "3", 1.0),
        (r"\boxed{42.}", 42, 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{x + 1}", "x+1", 1.0),
        (r"\boxed{x+2}", "x+1", 0.0),
        ("42", "42", 0.0),
        (r"\boxed{1/0}", "0", 0.0),
    ],
)
def test_math(text: str, expected: object, reward: float) -> None:
    assert math_match({"expected_answer": expected}, text) == reward


async def test_builtin_verifiers_via_make() -> None:
    exact = make_verifier(VerifySettings(verifier="exact_match"))
    math = make_verifier(VerifySettings(verifier="math"))
    assert exact is not None and math is not None
    assert await exact({"expected_answer": "42"}, result(r"\boxed{42}")) == 1.0
    assert await math({"expected_answer": "0.5"}, result(r"\boxed{1/2}")) == 1.0
    assert make_verifier(VerifySettings(verifier="none")) is None


async def test_http_verifier_posts_row_and_response(server: ScriptedServer) -> None:
    url = await server.start({"reward": 0.75})
    verify = make_verifier(VerifySettings(verifier="http", url=url + "/"), FAST)
    assert verify is not None
    row = {"responses_create_params": {"input": "hi"}, "expected_answer": "42"}
    assert await verify(row, result("x = 42")) == 0.75
    seen = server.seen[0]
    assert seen.path == "/verify" and seen.json() == {**row, "response": RESPONSE}
    assert "Authorization" not in seen.headers


async def test_http_verifier_cache_avoids_second_call(server: ScriptedServer) -> None:
    url = await server.start({"reward": 1.0})
    verify = make_verifier(VerifySettings(verifier="http", url=url), FAST)
    assert isinstance(verify, CachedVerifier)
    row = {"responses_create_params": {"input": "hi"}, "expected_answer": "42"}
    assert await verify(row, result("42")) == 1.0
    assert await verify(dict(row), result("42")) == 1.0
    assert len(server.seen) == 1 and verify.hits == 1
    calls = {**RESPONSE, "output": [{"type": "function_call", "name": "f", "arguments": "{}"}]}
    await verify(row, RolloutResult({"response": calls}, None, "42", 1, 0.0, 1))
    assert len(server.seen) == 2, "the same text with other tool calls is another input"
    other = {"responses_create_params": {"input": "other question"}, "expected_answer": "42"}
    await verify(other, result("42"))  # http verifiers may read any field: another row is another key
    await verify(row, result("43"))  # the server is sent the response, not the text: the same input
    assert len(server.seen) == 3


async def test_http_verifier_retries_then_fails(server: ScriptedServer) -> None:
    url = await server.start(web.Response(status=503), {"reward": 1})
    verify = make_verifier(VerifySettings(verifier="http", url=url), FAST)
    assert verify is not None and await verify({}, result("a")) == 1.0 and len(server.seen) == 2

    server.script = [web.Response(status=400, text="bad row")]
    with pytest.raises(BackendError) as info:
        await verify({"n": 2}, result("b"))
    assert info.value.kind == "verifier" and info.value.status == 400 and info.value.attempts == 1
    assert "bad row" in str(info.value)

    server.script = [{"score": 1}]
    with pytest.raises(BackendError, match="no numeric reward") as info:
        await verify({"n": 3}, result("c"))
    assert info.value.attempts == FAST.max_retries + 1


async def test_http_verifier_timeout(server: ScriptedServer) -> None:
    url = await server.start("hang")
    verify = make_verifier(VerifySettings(verifier="http", url=url, timeout_s=0.3), RetryPolicy(0, 0.0, 0.0))
    assert verify is not None
    with pytest.raises(BackendError, match=r"no reply within 0\.3s"):
        await verify({}, result("a"))


async def test_module_function_verifiers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rf_test_rewards.py").write_text(
        "calls = []\n"
        "def sync_score(row, text):\n    calls.append(text)\n    return len(text) / 10\n"
        "async def async_score(row, text):\n    calls.append(text)\n    return row['bonus'] + 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sync_v = make_verifier(VerifySettings(verifier="rf_test_rewards:sync_score", processes=0))  # in-thread
    async_v = make_verifier(VerifySettings(verifier="rf_test_rewards:async_score"))
    assert sync_v is not None and async_v is not None
    assert await sync_v({}, result("abcde")) == 0.5
    assert await sync_v({}, result("abcde")) == 0.5
    assert await async_v({"bonus": 1}, result("z")) == 2.0
    assert await async_v({"bonus": 2}, result("z")) == 3.0  # the row is part of a callable's key
    assert sys.modules["rf_test_rewards"].calls == ["abcde", "z", "z"]


async def test_an_object_with_an_async_call_stays_on_the_event_loop(tmp_path: Path, monkeypatch) -> None:
    """Not a coroutine function, yet awaitable: never sent to a verifier process (it cannot await there)."""
    (tmp_path / "rf_test_obj.py").write_text(
        "class Scorer:\n    async def __call__(self, row, text):\n        return len(text) / 10\n"
        "score = Scorer()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    verify = make_verifier(VerifySettings(verifier="rf_test_obj:score", processes=2))
    assert verify is not None and verify.processes is None  # type: ignore[attr-defined]
    assert await verify({}, result("abcd")) == 0.4


def test_bad_specs_fail_at_make_time() -> None:
    with pytest.raises(VerifierError, match=r"'no_such_module_xyz:f'.*module:function"):
        make_verifier(VerifySettings(verifier="no_such_module_xyz:f"))
    with pytest.raises(VerifierError, match=r"'os:no_such_function'.*module:function"):
        make_verifier(VerifySettings(verifier="os:no_such_function"))
    with pytest.raises(VerifierError, match="Unknown verifier"):
        make_verifier(VerifySettings.model_construct(verifier="fuzzy", url=None, timeout_s=60.0))
    with pytest.raises(VerifierError, match="--verifier-url"):
        make_verifier(VerifySettings(verifier="http"))


async def test_cache_is_a_bounded_lru() -> None:
    calls: list[str] = []

    async def score(seen: tuple[dict, str]) -> float:
        calls.append(seen[1])
        return 1.0

    verify = CachedVerifier("t", answer_view, score, size=2)
    for text in ["a", "b", "a", "c", "b"]:  # "a" refreshed, so "b" is the one evicted by "c"
        await verify({"expected_answer": 1}, result(text))
    assert calls == ["a", "b", "c", "b"] and len(verify.cache) == 2
    assert verifier_cache_key("t", ({"expected_answer": 1}, "a")) != verifier_cache_key(
        "u", ({"expected_answer": 1}, "a")
    )
