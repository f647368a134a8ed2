"""Rewards for backends that return none: exact_match, math (math-verify), math_fast, an HTTP resources
server, or your callable."""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import importlib
import inspect
import pickle
import re
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
from rollflow.tasks.storage import rowjson
from rollflow.tasks.verify.mathcheck import math_verify_match
from rollflow.tasks.verify.pool import VerifyMeter, default_processes, shared_pool
from rollflow.tasks.verify.threads import check_threads
from rollflow.tasks.verify.worker import error_text

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


# An answer past these is compared as text, never as a number: Fraction("1e10000000") computes a
# ten-million-digit power holding the GIL (the event loop, the lease and every check's timeout stop).
MAX_NUMBER_CHARS = 200
MAX_EXPONENT = 1000
_EXPONENT = re.compile(r"[eE]\s*([+-]?\d+)")


def _small_number(part: str) -> bool:
    found = _EXPONENT.search(part)
    return len(part) <= MAX_NUMBER_CHARS and (found is None or abs(int(found.group(1))) <= MAX_EXPONENT)


def _as_number(answer: str) -> Fraction | None:
    """42, 0.5, 1e3, 1/2, (1)/(2), 1,000 as an exact number; anything else (or past the bounds) None."""
    if _THOUSANDS.match(answer):
        answer = answer.replace(",", "")
    num, slash, den = answer.partition("/")
    if not (_small_number(num) and _small_number(den)):
        return None
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


def verifier_cache_key(name: str, seen: Any) -> bytes:
    """sha1 of the verifier and everything it is given (`seen`: the bytes it is sent, or its arguments,
    exactly: integers of any size, 1 apart from 1.0): the one rule for every verifier, so a cached
    reward is reused only when the verifier would see the very same input."""
    if not isinstance(seen, bytes):
        try:
            seen = rowjson.dumps(seen)
        except (TypeError, ValueError):
            seen = pickle.dumps(seen, protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha1(name.encode() + b"\0" + seen).digest()


View = Callable[[dict[str, Any], RolloutResult], Any]
Check = Callable[[Any], Awaitable[Any]]


def answer_view(row: dict[str, Any], result: RolloutResult) -> tuple[dict[str, Any], str]:
    """What a built-in reads: the row's expected_answer alone, and the final text."""
    return {k: row[k] for k in ("expected_answer",) if k in row}, result.text


def row_view(row: dict[str, Any], result: RolloutResult) -> tuple[dict[str, Any], str]:
    """What a module:function is given: a copy of the whole row (one that changes it changes neither the
    output nor the row's other rollouts, as in a verifier process) and the final text."""
    return copy.deepcopy(row), result.text


class CachedVerifier:
    """Verify each input once per process: re-runs and repeats of one output cost nothing.

    `view` picks what the verifier is given from (row, rollout); `check` scores it. The key is that
    input (verifier_cache_key). An LRU of `size` sha1 keys (~100 bytes each). Two identical calls in
    flight at once may both run.
    """

    def __init__(self, name: str, view: View, check: Check, size: int = CACHE_SIZE) -> None:
        self.name = name
        self.view = view
        self.check = check
        self.size = size
        self.cache: OrderedDict[bytes, float] = OrderedDict()
        self.hits = 0
        self.processes: int | None = None  # CPU-bound checks: verifier processes (0: a thread)
        self.meter: VerifyMeter | None = None
        # A check cheap enough to run inline (microseconds): bulk callers (reverify) batch it on one thread.
        self.plain: Callable[[dict[str, Any], str], float] | None = None
        # Starts its verifier processes and waits for them: the seconds it took (pooled checks only).
        self.warm: Callable[[], Awaitable[float]] | None = None

    def usage(self) -> tuple[float, float, int]:
        """CPU and busy seconds the checks have taken so far, and how many (CPU-bound verifiers)."""
        meter = self.meter
        return (meter.cpu_s, meter.busy_s, meter.checks) if meter is not None else (0.0, 0.0, 0)

    async def __call__(self, row: dict[str, Any], result: RolloutResult) -> float:
        seen = self.view(row, result)
        key = verifier_cache_key(self.name, seen)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            self.hits += 1
            return hit
        reward = float(await self.check(seen))
        self.cache[key] = reward
        if len(self.cache) > self.size:
            self.cache.popitem(last=False)
        return reward


def check_failed(exc: BaseException) -> BackendError:
    """A check's own error, worded and capped as a verifier process words it (never a 300 KB message)."""
    return BackendError(f"verifier failed: {error_text(exc)}", kind="verifier", retryable=False)


def timeout_error(name: str, timeout_s: float, then: str) -> BackendError:
    return BackendError(
        f"verifier {name!r} took longer than --verify-timeout-s {timeout_s:g}s on this rollout; {then}",
        kind="verifier_timeout",
    )


async def _bounded(name: str, timeout_s: float, awaitable: Awaitable[Any]) -> Any:
    """An awaited check under --verify-timeout-s, cancelled past it."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise timeout_error(name, timeout_s, "it was cancelled") from None


def _threaded(name: str, fn: Callable[..., Any], timeout_s: float, meter: VerifyMeter | None = None) -> Check:
    """A synchronous reward function on this process's check threads (never on the event loop, where
    a slow one would stall the output lease's renewals and every other rollout). An awaitable it
    returns is awaited on the loop, as in a verifier process."""

    async def check(seen: tuple[dict[str, Any], str]) -> Any:
        try:
            value = await check_threads().run(functools.partial(fn, *seen), timeout_s, meter)
        except TimeoutError:
            raise timeout_error(name, timeout_s, "its thread is left to finish, and replaced") from None
        except BackendError:
            raise
        except Exception as exc:
            raise check_failed(exc) from None
        if inspect.isawaitable(value):
            value = await _bounded(name, timeout_s, value)
        return value

    return check


def _cpu_bound(
    spec: str, settings: VerifySettings, fn: Callable[..., Any], view: View, sharers: int
) -> CachedVerifier:
    """A CPU-bound check: in this process's verifier pool, or on a thread when --verify-processes is 0."""
    processes = (
        settings.processes
        if settings.processes is not None
        else default_processes(settings.node_processes, sharers)
    )
    meter = VerifyMeter()

    async def pooled(seen: tuple[dict[str, Any], str]) -> float:
        pool = shared_pool(spec, processes, settings.check_timeout_s, settings.start_timeout_s)
        return await pool.check(*seen, meter)

    check = pooled if processes else _threaded(spec, fn, settings.check_timeout_s, meter)
    verifier = CachedVerifier(spec, view, check)
    verifier.processes, verifier.meter = processes, meter
    if processes:
        verifier.warm = lambda: shared_pool(
            spec, processes, settings.check_timeout_s, settings.start_timeout_s
        ).warm()
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


def _async(spec: str, fn: Callable[..., Awaitable[Any]], timeout_s: float) -> Check:
    """An async reward function stays on the event loop (it waits on I/O; it does not burn a core),
    under --verify-timeout-s."""

    async def check(seen: tuple[dict[str, Any], str]) -> Any:
        try:
            return await _bounded(spec, timeout_s, fn(*seen))
        except BackendError:
            raise
        except Exception as exc:
            raise check_failed(exc) from None

    return check


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


def _http(settings: VerifySettings, policy: RetryPolicy) -> tuple[View, Check]:
    """NeMo Gym resources server: POST {url}/verify with the row and its response, read `reward`; the
    whole check, retries included, under --verify-timeout-s."""
    if not settings.url:
        raise VerifierError("--verifier http needs --verifier-url (the resources server's base URL).")
    url = settings.url.rstrip("/") + "/verify"
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)

    def body(row: dict[str, Any], result: RolloutResult) -> bytes:
        return rowjson.dumps({**row, "response": result.fields.get("response")})

    async def post(data: bytes) -> float:
        tries = 0
        while True:
            try:
                return await _post_verify(url, data, timeout)
            except BackendError as exc:
                tries += 1
                exc.attempts = tries
                if not exc.retryable or tries > policy.max_retries:
                    raise
                await asyncio.sleep(policy.delay(tries - 1, exc.retry_after))

    async def check(data: bytes) -> float:
        return await _bounded(f"http:{settings.url}", settings.check_timeout_s, post(data))  # type: ignore[no-any-return]

    return body, check


def make_verifier(
    settings: VerifySettings, policy: RetryPolicy = DEFAULT_POLICY, sharers: int = 1
) -> Verifier | None:
    """The reward function named by settings.verifier (None for `none`); bad specs fail here, not per row.

    `policy` is the retry policy of the http verifier (pass the backend's to retry alike). `sharers`:
    the worker processes of this node that share its verifier processes (Dask, Ray).
    """
    spec = settings.verifier_for("responses")
    timeout_s = settings.check_timeout_s
    if spec == "none":
        return None
    if spec == "exact_match":
        verifier = CachedVerifier(spec, answer_view, _threaded(spec, exact_match, timeout_s))
        verifier.plain = exact_match
        return verifier
    if spec == "math":
        return _cpu_bound(spec, settings, math_verify_match, answer_view, sharers)
    if spec == "math_fast":
        verifier = CachedVerifier(spec, answer_view, _threaded(spec, math_match, timeout_s))
        verifier.plain = math_match
        return verifier
    if spec == "http":
        return CachedVerifier(f"http:{settings.url}", *_http(settings, policy))
    if ":" in spec:
        fn = _callable(spec)
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            return CachedVerifier(spec, row_view, _async(spec, fn, timeout_s))
        return _cpu_bound(spec, settings, fn, row_view, sharers)
    raise VerifierError(
        f"Unknown verifier {spec!r}. Use exact_match, math, math_fast, http (with --verifier-url), none, or "
        f"module:function."
    )
