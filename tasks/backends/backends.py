"""The three backend kinds (NeMo Gym agent, Responses API, Chat Completions) behind one rollout() call."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from rollflow.settings import BackendKind, BackendSettings, redact
from rollflow.tasks.backends.chat_reply import chat_to_response
from rollflow.tasks.backends.endpoints import Endpoint, EndpointPool, UnknownAgent, split_limit
from rollflow.tasks.backends.formats import chat_request
from rollflow.tasks.backends.http import auth_headers
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.backends.observe import AttemptObserver
from rollflow.tasks.backends.replies import (
    ReplyShapeError,
    UnfinishedReply,
    agent_response,
    agent_reward,
    check_response,
    responses_text,
)
from rollflow.tasks.backends.retry import RETRYABLE_STATUS, RetryPolicy, parse_retry_after
from rollflow.tasks.storage import rowjson

# ServerDisconnectedError is a ClientConnectionError. Any other aiohttp.ClientError (a garbled status line,
# a bad chunked encoding) is also a transport failure: counted as "connection" and retried.
CONNECTION_ERRORS = (aiohttp.ClientError, ConnectionError)
PATHS = {
    BackendKind.agent: "/run",
    BackendKind.responses: "/v1/responses",
    BackendKind.chat: "/v1/chat/completions",
}
LEAVE_GRACE_S = 0.5
MAX_SNIPPET = 300  # characters of an error reply quoted in the failure's message
MAX_BODY = 2000  # characters of an error reply kept with the failure (NeMo Gym's sidecar keeps as many)


def _url_hint(url: str, status: int) -> str:
    """Advice for a 404 at a doubled path: a base URL given with its /v1 (as OpenAI clients take it)."""
    if status != 404 or "/v1/v1/" not in url:
        return ""
    base = url[: url.index("/v1/v1/") + 3]
    return (
        f" (the backend URL {base} ends in /v1, and rollflow adds the API path /v1/...: give "
        f"--backend-url {base[:-3]} instead)"
    )


def _replica_failure(kind: str) -> bool:
    """A failure a dying replica causes (as opposed to a rejected request or a rate limit)."""
    return kind in ("connection", "timeout", "malformed") or kind.startswith("http_5")


class BackendError(Exception):
    """A rollout that failed for good (after its retries, or at once for a non-retryable error)."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        status: int | None = None,
        retryable: bool = False,
        attempts: int = 1,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.retryable = retryable
        self.attempts = attempts
        self.retry_after = retry_after
        self.url: str | None = None  # where an HTTP error came from, and its body (masked, cut)
        self.body: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields: the default Exception pickling would lose them (Dask ships errors across).
        fields = (
            self.kind,
            self.status,
            self.retryable,
            self.attempts,
            self.retry_after,
            self.url,
            self.body,
        )
        return (_rebuild_error, (str(self), *fields))


def _rebuild_error(
    message: str,
    kind: str,
    status: int | None,
    retryable: bool,
    attempts: int,
    retry_after: float | None,
    url: str | None = None,
    body: str | None = None,
) -> BackendError:
    error = BackendError(
        message, kind=kind, status=status, retryable=retryable, attempts=attempts, retry_after=retry_after
    )
    error.url, error.body = url, body
    return error


@dataclass(slots=True)
class RolloutResult:
    """One successful rollout: `fields` merge into the output row; the rest feeds verifiers and metrics."""

    fields: dict[str, Any]
    reward: float | None
    text: str
    output_tokens: int
    latency_s: float
    attempts: int


class BackendClient:
    """Sends one rollout's request with bounded retries; the caller bounds concurrency.

    Each attempt goes to the endpoint `pool` chooses; a failure caused by a replica leaving rotation is
    retried on the others without using up the rollout's retries. Everything constant (URLs, headers,
    timeout, policy) is built once here: rollout() is the hot path.
    """

    def __init__(
        self,
        settings: BackendSettings,
        session: aiohttp.ClientSession,
        observers: tuple[AttemptObserver, ...] = (),
        pool: EndpointPool | None = None,
    ) -> None:
        self.settings = settings
        self.session = session
        self.observers = observers
        self.kind = BackendKind(settings.kind)
        urls = settings.urls
        self.pool = pool or EndpointPool(
            urls, split_limit(len(urls), urls), ConcurrencyLimit(len(urls)), settings.groups()
        )
        self._targets = {ep.url: ep.url.rstrip("/") + PATHS[self.kind] for ep in self.pool.endpoints}
        self.url = self._targets[self.pool.endpoints[0].url]
        self.timeout = aiohttp.ClientTimeout(total=settings.timeout_s, connect=settings.connect_timeout_s)
        self.policy = RetryPolicy.from_settings(settings)
        self.max_free = 3 * len(self.pool.endpoints)
        self._headers = {"Content-Type": "application/json", **auth_headers(settings)}
        redact.register(None, settings.api_key.get_secret_value() if settings.api_key is not None else "")

    def _body(self, row: dict[str, Any]) -> bytes:
        if self.kind is BackendKind.agent:
            return rowjson.dumps(row)
        params = row["responses_create_params"]
        if self.kind is BackendKind.chat:
            return rowjson.dumps(chat_request(params, self.settings.model))
        if self.settings.model and "model" not in params:
            params = {**params, "model": self.settings.model}
        return rowjson.dumps(params)

    def _affine_to(self, task_index: int) -> int | None:
        """The task whose replica an attempt prefers (None: least loaded only)."""
        return task_index if self.settings.prefix_affinity else None

    async def rollout(self, row: dict[str, Any], task_index: int, rollout_index: int) -> RolloutResult:
        """The rollout's result, or BackendError once retries are exhausted (or at once if not retryable)."""
        body = self._body(row)
        headers = {
            **self._headers,
            "X-Rollflow-Task-Index": str(task_index),
            "X-Rollflow-Rollout-Index": str(rollout_index),
        }
        failed: list[tuple[Endpoint, int]] = []
        agent = (row.get("agent_ref") or {}).get("name") if self.pool.routed else None
        while True:
            try:
                ep = self.pool.choose(
                    (failed[-1][0].url,) if failed else (), agent, self._affine_to(task_index)
                )
            except UnknownAgent as exc:
                raise BackendError(str(exc), kind="unknown_agent") from None
            start = time.perf_counter()  # before begin: an attempt counted in flight at a mark began by it
            token = self.pool.begin(ep)
            try:
                reply = await self._post(self._targets[ep.url], body, headers)
                latency = time.perf_counter() - start
                result = self._result(self._targets[ep.url], reply, latency, len(failed) + 1)
            except BackendError as exc:
                self.pool.end(ep, started=start)
                self._failed(ep, exc)
                failed.append((ep, token))
                exc.attempts = len(failed)
                if not exc.retryable or not await self._retry_after_backoff(failed, exc, agent):
                    raise
                continue
            except BaseException:
                self.pool.end(ep, abandoned=True, started=start)
                raise
            self.pool.end(ep, started=start)
            self.pool.succeeded(ep, result.latency_s)
            for observer in self.observers:
                observer.success(result.latency_s)
            return result

    def _failed(self, ep: Endpoint, exc: BackendError) -> None:
        refused = isinstance(exc.__cause__, aiohttp.ClientConnectorError)
        self.pool.failed(ep, exc.kind, refused=refused)
        for observer in self.observers:
            observer.failure(exc.kind)

    async def _retry_after_backoff(
        self, failed: list[tuple[Endpoint, int]], exc: BackendError, agent: str | None = None
    ) -> bool:
        """Back off, then whether to try again: retries left, or the failure was a replica leaving.

        A replica that dies drops its requests before it refuses new ones, so with no retry left and
        other endpoints in rotation, the verdict waits a moment for it to leave rotation.
        """
        counted = self._counted(failed, agent)
        if counted <= self.policy.max_retries:
            await asyncio.sleep(self.policy.delay(max(0, counted - 1), exc.retry_after))
            return True
        ep = failed[-1][0]
        if not _replica_failure(exc.kind) or not self.pool.others_in_rotation(ep, agent):
            return False
        await asyncio.sleep(LEAVE_GRACE_S)
        return self._counted(failed, agent) <= self.policy.max_retries

    def _counted(self, failed: list[tuple[Endpoint, int]], agent: str | None = None) -> int:
        """Failures that use up retries: all but those a replica leaving rotation caused (bounded)."""
        free = sum(1 for ep, token in failed if self.pool.caused_by_rotation(ep, token, agent))
        return len(failed) - min(free, self.max_free)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> Any:
        try:
            async with self.session.post(url, data=body, headers=headers, timeout=self.timeout) as resp:
                payload = await resp.read()
                status = resp.status
                retry_after = (
                    parse_retry_after(resp.headers.get("Retry-After")) if status in RETRYABLE_STATUS else None
                )
                # parsed only when the raw header may name an event stream (a JSON reply's never does)
                raw_type = resp.headers.get("Content-Type", "")
                event_stream = "event-stream" in raw_type.lower() and resp.content_type == "text/event-stream"
        except TimeoutError as exc:
            raise BackendError(
                f"no reply within {self.settings.timeout_s:g}s from {url}",
                kind="timeout",
                retryable=True,
            ) from exc
        except aiohttp.InvalidURL:
            raise BackendError(f"invalid backend URL {url}", kind="connection") from None
        except CONNECTION_ERRORS as exc:
            raise BackendError(
                self._scrub(f"connection to {url} failed: {type(exc).__name__}: {exc}"),
                kind="connection",
                retryable=True,
            ) from exc
        if status >= 400:
            # masked before it is cut: a cut through an echoed key would leave its first characters
            text = self._scrub(payload[: 4 * MAX_BODY].decode("utf-8", "replace"))
            error = BackendError(
                self._scrub(
                    f"HTTP {status} from {url}: {text[:MAX_SNIPPET]}{_url_hint(url, status)}"
                    f"{self._waits_less(retry_after)}"
                ),
                kind=f"http_{status}",
                status=status,
                retryable=status in RETRYABLE_STATUS,
                retry_after=retry_after,
            )
            error.url, error.body = url, text[:MAX_BODY]
            raise error
        if event_stream:
            raise BackendError(
                f"an event stream (text/event-stream) from {url} (HTTP {status}) where a JSON reply was "
                f"asked for: the server streams although the request did not ask it to",
                kind="malformed",
                status=status,
                retryable=True,
            )
        try:
            return rowjson.loads(payload)
        except (orjson.JSONDecodeError, UnicodeDecodeError):
            raise BackendError(
                f"malformed JSON body from {url} (HTTP {status}, {len(payload)} bytes)",
                kind="malformed",
                status=status,
                retryable=True,
            ) from None

    def _waits_less(self, retry_after: float | None) -> str:
        """Said when the server asks for a longer wait than backoff_max_s: the retries came sooner."""
        if retry_after is None or retry_after <= self.policy.max_s:
            return ""
        return (
            f" (Retry-After: {retry_after:g} s, longer than backoff_max_s = {self.policy.max_s:g} s, so "
            f"the retries came sooner than the server asked; set ROLLFLOW_BACKEND__BACKOFF_MAX_S to wait "
            f"that long)"
        )

    def _scrub(self, message: str) -> str:
        """A backend that echoes the request (headers included) must not put the key into an error."""
        return redact.redact(message)

    def _result(self, url: str, reply: Any, latency: float, attempts: int) -> RolloutResult:
        """The reply read as its kind's shape; anything else (an error object in a 200) is malformed."""
        try:
            if not isinstance(reply, dict):
                raise ReplyShapeError(f"expected a JSON object, got {type(reply).__name__}")
            if self.kind is BackendKind.chat:
                response, text, tokens = chat_to_response(reply)
                return RolloutResult({"response": response}, None, text, tokens, latency, attempts)
            if self.kind is BackendKind.responses:
                check_response(reply)
                tokens = int((reply.get("usage") or {}).get("output_tokens") or 0)
                return RolloutResult(
                    {"response": reply}, None, responses_text(reply), tokens, latency, attempts
                )
            response = agent_response(reply)
            reward = agent_reward(reply)
            tokens = int((response.get("usage") or {}).get("output_tokens") or 0)
            return RolloutResult(reply, reward, responses_text(response), tokens, latency, attempts)
        except UnfinishedReply as exc:
            raise BackendError(
                self._scrub(f"unfinished reply from {url}: {exc}"), kind="unfinished", retryable=False
            ) from None
        except (ReplyShapeError, AttributeError, TypeError, ValueError) as exc:
            raise BackendError(
                self._scrub(f"unexpected reply shape from {url}: {exc}"),
                kind="malformed",
                retryable=True,
            ) from None
