"""Rewards for backends that return none: exact_match, math (math-verify), math_fast, an HTTP resources
server, or your callable."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from fractions import Fraction
from typing import Any

import aiohttp
import orjson

from rollflow.settings import VerifySettings
from rollflow.tasks.backends.backends import BackendError, RolloutResult
from rollflow.tasks.backends.http import session_for_loop
from rollflow.tasks.backends.retry import RETRYABLE_STATUS, RetryPolicy, parse_retry_after
from rollflow.tasks.verify.mathcheck import math_verify_match
from rollflow.tasks.verify.pool import VerifyMeter, default_processes, shared_pool

Verifier = Callable[[dict[str, Any], RolloutResult], Awaitable[float]]
CACHE_SIZE = 100_000
DEFAULT_POLICY = RetryPolicy(5, 0.5, 30.0)  # BackendParams' defaults

_JSON = {"Content-Type": "application/json"}


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


_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def _normalise(answer: str) -> str:
    """Light normalisation: no spaces or $, no trailing period, \frac{a}{b} as a/b."""
    answer = answer.replace(" ", "").strip("$").rstrip(".")
    return _FRAC.sub(r"(\1)/(\2)", answer) if "frac" in answer else answer


def _as_number(answer: str) -> Fraction | None:
    """42, 0.5, 1e3, 1/2, (1)/(2), 1,000 as an exact number; anything else None."""
    if _THOUSANDS.match(answer):
        answer = answer.replace(",", "")
    num, slash, den = answer.partition("/")
    try:
        value = Fraction(num.strip("()"))
        return value / Fraction(den.strip("()")) if slash else value
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
    """`math_fast`: the last \\boxed{} against expected_answer, as numbers when both parse (1/2 == 0.5),
    else as normalised strings; no algebra, so a hundred times cheaper than `math` and blind to forms."""
    boxed = last_boxed(text)
    if boxed is None or "expected_answer" not in row:
        return 0.0
    got, want = _normalise(boxed), _normalise(str(row["expected_answer"]))
    if got == want:
        return 1.0
    a, b = _as_number(got), _as_number(want)
    return 1.0 if a is not None and a == b else 0.0


def verifier_cache_key(name: str, row: dict[str, Any], text: str, whole_row: bool = False) -> bytes:
    """sha1 of what decides a reward: the verifier, the expected answer (or the whole row) and the text.

    Built-ins read only expected_answer; http and callable verifiers may read any field of the row,
    so for them the whole row is part of the key.
    """
    what = row if whole_row else row.get("expected_answer")
    return hashlib.sha1(orjson.dumps([name, what, text], default=str)).digest()


class CachedVerifier:
    """Verify each (answer, text) once per process: re-runs and repeats of one output cost nothing.

    An LRU of `size` sha1 keys (~100 bytes each). Two identical calls in flight at once may both run.
    """

    def __init__(self, name: str, fn: Verifier, whole_row: bool = False, size: int = CACHE_SIZE) -> None:
        self.name = name
        self.fn = fn
        self.whole_row = whole_row
        self.size = size
        self.cache: OrderedDict[bytes, float] = OrderedDict()
        self.hits = 0
        self.processes: int | None = None  # CPU-bound checks: verifier processes (0: a thread)
        self.meter: VerifyMeter | None = None
        # A check cheap enough to run inline (microseconds): bulk callers (reverify) batch it on one thread.
        self.plain: Callable[[dict[str, Any], str], float] | None = None

    def usage(self) -> tuple[float, float, int]:
        """CPU and busy seconds the checks have taken so far, and how many (CPU-bound verifiers)."""
        meter = self.meter
        return (meter.cpu_s, meter.busy_s, meter.checks) if meter is not None else (0.0, 0.0, 0)

    async def __call__(self, row: dict[str, Any], result: RolloutResult) -> float:
        key = verifier_cache_key(self.name, row, result.text, self.whole_row)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            self.hits += 1
            return hit
        reward = float(await self.fn(row, result))
        self.cache[key] = reward
        if len(self.cache) > self.size:
            self.cache.popitem(last=False)
        return reward


def _sync(fn: Callable[[dict[str, Any], str], Any], meter: VerifyMeter | None = None) -> Verifier:
    """A synchronous reward function, run on a thread: a slow one must not stall the event loop (and
    with it the output lease's renewals and every other rollout)."""

    def timed(row: dict[str, Any], text: str) -> Any:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return fn(row, text)
        finally:
            if meter is not None:
                meter.add(time.thread_time() - cpu, time.perf_counter() - wall)

    async def verify(row: dict[str, Any], result: RolloutResult) -> float:
        value = await asyncio.to_thread(timed, row, result.text)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    return verify


def _cpu_bound(
    spec: str, settings: VerifySettings, fn: Callable[[dict[str, Any], str], Any], whole_row: bool
) -> CachedVerifier:
    """A CPU-bound check: in this process's verifier pool, or in a thread when --verify-processes is 0."""
    processes = settings.processes if settings.processes is not None else default_processes()
    meter = VerifyMeter()

    async def pooled(row: dict[str, Any], result: RolloutResult) -> float:
        pool = shared_pool(spec, processes, settings.check_timeout_s)
        sent = row if whole_row else {k: row[k] for k in ("expected_answer",) if k in row}
        return await pool.check(sent, result.text, meter)

    verifier = CachedVerifier(spec, pooled if processes else _sync(fn, meter), whole_row=whole_row)
    verifier.processes, verifier.meter = processes, meter
    return verifier


def _callable(spec: str) -> Callable[..., Any]:
    """The function module:function names, imported here so a bad spec fails before any request."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise VerifierError(
            f"Cannot import verifier {spec!r} ({type(exc).__name__}: {exc}). Expected module:function, a "
            f"callable (row, text) -> float importable from the current environment."
        ) from exc
    return fn  # type: ignore[no-any-return]


def _async(fn: Callable[[dict[str, Any], str], Awaitable[Any]]) -> Verifier:
    """An async reward function stays on the event loop (it waits on I/O; it does not burn a core)."""

    async def verify(row: dict[str, Any], result: RolloutResult) -> float:
        return float(await fn(row, result.text))

    return verify


async def _post_verify(url: str, body: bytes, timeout: aiohttp.ClientTimeout) -> float:
    """One POST to the resources server; a transport error, 4xx/5xx or reply without a reward raises."""
    try:
        async with session_for_loop().post(url, data=body, headers=_JSON, timeout=timeout) as resp:
            payload = await resp.read()
            status = resp.status
            retry_after = parse_retry_after(resp.headers.get("Retry-After")) if status == 429 else None
    except TimeoutError as exc:
        raise BackendError(
            f"verifier at {url}: no reply within {timeout.total:g}s", kind="verifier", retryable=True
        ) from exc
    except aiohttp.ClientError as exc:
        raise BackendError(
            f"verifier at {url}: {type(exc).__name__}: {exc}", kind="verifier", retryable=True
        ) from exc
    if status >= 400:
        raise BackendError(
            f"verifier HTTP {status} from {url}: {payload[:300].decode('utf-8', 'replace')}",
            kind="verifier",
            status=status,
            retryable=status in RETRYABLE_STATUS,
            retry_after=retry_after,
        )
    return _reward_of(payload, url, status)


def _reward_of(payload: bytes, url: str, status: int) -> float:
    try:
        reward = orjson.loads(payload)["reward"]
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise TypeError(f"reward is {type(reward).__name__}, not a number")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise BackendError(
            f"verifier at {url} gave no numeric reward ({type(exc).__name__}: {exc})",
            kind="verifier",
            status=status,
            retryable=True,
        ) from None
    return float(reward)


def _http(settings: VerifySettings, policy: RetryPolicy) -> Verifier:
    """NeMo Gym resources server: POST {url}/verify with the row and its response, read `reward`."""
    if not settings.url:
        raise VerifierError("--verifier http needs --verifier-url (the resources server's base URL).")
    url = settings.url.rstrip("/") + "/verify"
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)

    async def verify(row: dict[str, Any], result: RolloutResult) -> float:
        body = orjson.dumps({**row, "response": result.fields.get("response")})
        tries = 0
        while True:
            try:
                return await _post_verify(url, body, timeout)
            except BackendError as exc:
                tries += 1
                exc.attempts = tries
                if not exc.retryable or tries > policy.max_retries:
                    raise
                await asyncio.sleep(policy.delay(tries - 1, exc.retry_after))

    return verify


def make_verifier(settings: VerifySettings, policy: RetryPolicy = DEFAULT_POLICY) -> Verifier | None:
    """The reward function named by settings.verifier (None for `none`); bad specs fail here, not per row.

    `policy` is the retry policy of the http verifier (pass the backend's to retry alike).
    """
    spec = settings.verifier
    if spec == "none":
        return None
    if spec == "exact_match":
        verifier = CachedVerifier(spec, _sync(exact_match))
        verifier.plain = exact_match
        return verifier
    if spec == "math":
        return _cpu_bound(spec, settings, math_verify_match, whole_row=False)
    if spec == "math_fast":
        verifier = CachedVerifier(spec, _sync(math_match))
        verifier.plain = math_match
        return verifier
    if spec == "http":
        return CachedVerifier(f"http:{settings.url}", _http(settings, policy), whole_row=True)
    if ":" in spec:
        fn = _callable(spec)
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            return CachedVerifier(spec, _async(fn), whole_row=True)
        return _cpu_bound(spec, settings, fn, whole_row=True)
    raise VerifierError(
        f"Unknown verifier {spec!r}. Use exact_match, math, math_fast, http (with --verifier-url), none, or "
        f"module:function."
    )
