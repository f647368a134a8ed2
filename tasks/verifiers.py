"""Rewards for backends that return none: exact_match, math, an HTTP resources server, or your callable."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from fractions import Fraction
from typing import Any

import aiohttp
import orjson

from settings import VerifySettings
from tasks.backends import BackendError, RolloutResult
from tasks.retry import RETRYABLE_STATUS, RetryPolicy, parse_retry_after

Verifier = Callable[[dict[str, Any], RolloutResult], Awaitable[float]]
CACHE_SIZE = 100_000


class VerifierError(Exception):
    """The --verifier setting cannot be used; the message says what to pass instead."""


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


def _normalise(answer: str) -> str:
    return answer.strip().strip("$").replace(" ", "").rstrip(".")


def _as_number(answer: str) -> Fraction | None:
    try:
        return Fraction(answer.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(row: dict[str, Any], text: str) -> float:
    """1.0 if the final text (or its \\boxed{} content) equals expected_answer; rows without one score 0."""
    if "expected_answer" not in row:
        return 0.0
    boxed = last_boxed(text)
    candidate = boxed if boxed is not None else text
    return 1.0 if candidate.strip() == str(row["expected_answer"]).strip() else 0.0


def math_match(row: dict[str, Any], text: str) -> float:
    """The last \\boxed{} against expected_answer, as numbers when both parse (1/2 == 0.5 == 0.50)."""
    boxed = last_boxed(text)
    if boxed is None or "expected_answer" not in row:
        return 0.0
    got, want = _normalise(boxed), _normalise(str(row["expected_answer"]))
    if got == want:
        return 1.0
    a, b = _as_number(got), _as_number(want)
    return 1.0 if a is not None and a == b else 0.0


class _Cached:
    """Verify each (answer, text) once per process: re-runs and repeats of one output cost nothing."""

    def __init__(self, name: str, fn: Verifier) -> None:
        self.name = name
        self.fn = fn
        self.cache: OrderedDict[bytes, float] = OrderedDict()

    async def __call__(self, row: dict[str, Any], result: RolloutResult) -> float:
        key = hashlib.sha1(
            orjson.dumps([self.name, row.get("expected_answer"), result.text], default=str)
        ).digest()
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        reward = float(await self.fn(row, result))
        self.cache[key] = reward
        if len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return reward


def _sync(fn: Callable[[dict[str, Any], str], float]) -> Verifier:
    async def verify(row: dict[str, Any], result: RolloutResult) -> float:
        return fn(row, result.text)

    return verify


def _callable(spec: str) -> Verifier:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise VerifierError(
            f"Cannot import verifier {spec!r} ({type(exc).__name__}: {exc}). Expected module:function, a "
            f"callable (row, text) -> float importable from the current environment."
        ) from exc

    async def verify(row: dict[str, Any], result: RolloutResult) -> float:
        value = fn(row, result.text)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    return verify


def _http(settings: VerifySettings) -> Verifier:
    """NeMo Gym resources server: POST {url}/verify with the row and its response, read `reward`."""
    if not settings.url:
        raise VerifierError("--verifier http needs --verifier-url (the resources server's base URL).")
    url = settings.url.rstrip("/") + "/verify"
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    policy = RetryPolicy(5, 0.5, 30.0)
    sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    async def verify(row: dict[str, Any], result: RolloutResult) -> float:
        loop = asyncio.get_running_loop()
        session = sessions.get(loop)
        if session is None or session.closed:
            session = sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        body = orjson.dumps({**row, "response": result.fields.get("response")})
        for attempt in range(policy.max_retries + 1):
            retry_after = None
            try:
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/json"}, timeout=timeout
                ) as resp:
                    payload = await resp.read()
                    if resp.status < 400:
                        return float(orjson.loads(payload)["reward"])
                    if resp.status not in RETRYABLE_STATUS:
                        raise BackendError(
                            f"verifier HTTP {resp.status} from {url}: {payload[:200]!r}",
                            kind="verifier",
                            status=resp.status,
                        )
                    retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError, ValueError) as exc:
                if attempt >= policy.max_retries:
                    raise BackendError(f"verifier at {url} failed: {exc}", kind="verifier") from exc
            if attempt < policy.max_retries:
                await asyncio.sleep(policy.delay(attempt, retry_after))
        raise BackendError(
            f"verifier at {url} kept failing", kind="verifier", attempts=policy.max_retries + 1
        )

    return verify


def make_verifier(settings: VerifySettings) -> Verifier | None:
    spec = settings.verifier
    if spec == "none":
        return None
    if spec == "exact_match":
        return _Cached(spec, _sync(exact_match))
    if spec == "math":
        return _Cached(spec, _sync(math_match))
    if spec == "http":
        return _Cached(f"http:{settings.url}", _http(settings))
    if ":" in spec:
        return _Cached(spec, _callable(spec))
    raise VerifierError(
        f"Unknown verifier {spec!r}. Use exact_match, math, http (with --verifier-url), none, or "
        f"module:function."
    )
