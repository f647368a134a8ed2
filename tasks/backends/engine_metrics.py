"""What the inference engine says about its own load: vLLM's or SGLang's Prometheus gauges at `/metrics`.

Running and waiting requests tell saturation directly (a non-empty waiting queue means more concurrency only
adds queueing), which throughput alone shows only after many rollouts. A server without these gauges
(404, other text, refused) is simply "no signal": never an error, and asked again only rarely.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rollflow.tasks.backends.endpoints import EndpointPool
from rollflow.tasks.backends.http import session_for_loop

# Gauge names by field, vLLM first; gpu_cache_usage_perc is vLLM's name before kv_cache_usage_perc.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
PREEMPTIONS = ("vllm:num_preemptions_total", "sglang:num_retracted_reqs_total")
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
CACHE_INFO = "vllm:cache_config_info"
_FIELD = {name: field for field, names in (("running", RUNNING), ("waiting", WAITING)) for name in names}
_FIELD.update({name: "kv" for name in KV_CACHE})
_FIELD.update({name: "preemptions" for name in PREEMPTIONS})
_FIELD.update(
    {"vllm:prefix_cache_queries_total": "prefix_queries", "vllm:prefix_cache_hits_total": "prefix_hits"}
)
# Finished requests and the tokens they held (prompt + reply): what one request takes of the KV cache.
_FIELD.update(
    {
        "vllm:request_prompt_tokens_count": "finished",
        "vllm:request_prompt_tokens_sum": "finished_tokens",
        "vllm:request_generation_tokens_sum": "finished_tokens",
    }
)


@dataclass(frozen=True)
class EngineSample:
    """One reading of the engine: requests running and waiting (None when that gauge is absent), the KV
    cache's used fraction, and when it was taken (time.perf_counter(), the clock of request records)."""

    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    at: float
    preemptions: int | None = None  # the engine's cumulative count (a counter: compare two samples)
    waiting_for_capacity: int | None = None  # vLLM's waiting_by_reason{reason="capacity"}
    kv_capacity_tokens: int | None = None  # cache_config_info: blocks x block size
    kv_max_concurrency: float | None = None  # cache_config_info: requests of max_model_len it holds
    prefix_queries: int | None = None  # prompt tokens looked up in the prefix cache (a counter)
    prefix_hits: int | None = None  # of them, found there (a counter)
    finished: int | None = None  # requests finished (a counter)
    finished_tokens: int | None = None  # prompt + reply tokens of those requests (a counter)
    kv_block_tokens: int | None = None  # cache_config_info: tokens per block (a request holds whole blocks)


def parse_engine_metrics(text: str, at: float | None = None) -> EngineSample | None:
    """The engine's gauges in Prometheus text, or None when it has none of them or is not Prometheus text.

    Running and waiting are summed over label sets (engines, ranks of one server); the KV cache's use is
    the highest of them, since a fraction summed over engines is no longer a fraction.
    """
    found: dict[str, list[float]] = {}
    cache: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = _FIELD.get(sample.name)
                if field is None and sample.name == WAITING_BY_REASON:
                    field = "capacity" if sample.labels.get("reason") == "capacity" else None
                if field is not None and _plausible(field, float(sample.value)):
                    found.setdefault(field, []).append(float(sample.value))
                elif sample.name == CACHE_INFO:
                    cache = dict(sample.labels)
    except Exception:  # the parser's errors on foreign text are not one documented type: any is "no signal"
        return None
    if not found:
        return None
    running, waiting, kv = found.get("running"), found.get("waiting"), found.get("kv")
    preempted, capacity = found.get("preemptions"), found.get("capacity")
    queries, hits = found.get("prefix_queries"), found.get("prefix_hits")
    finished, tokens = found.get("finished"), found.get("finished_tokens")
    block = _number(cache.get("block_size"))
    return EngineSample(
        running=round(sum(running)) if running else None,
        waiting=round(sum(waiting)) if waiting else None,
        kv_cache_usage=max(kv) if kv else None,
        at=time.perf_counter() if at is None else at,
        preemptions=round(sum(preempted)) if preempted else None,
        waiting_for_capacity=round(sum(capacity)) if capacity else None,
        kv_capacity_tokens=_cache_tokens(cache),
        kv_max_concurrency=_number(cache.get("kv_cache_max_concurrency")),
        prefix_queries=round(sum(queries)) if queries else None,
        prefix_hits=round(sum(hits)) if hits else None,
        finished=round(sum(finished)) if finished else None,
        finished_tokens=round(sum(tokens)) if tokens else None,
        kv_block_tokens=None if block is None else round(block),
    )


def _plausible(field: str, value: float) -> bool:
    """A count is finite and not negative, a KV cache's use a fraction: anything else is no reading."""
    return math.isfinite(value) and value >= 0 and (field != "kv" or value <= 1)


def _cache_tokens(labels: dict[str, str]) -> int | None:
    """The KV cache's size in tokens from cache_config_info's labels (blocks x block size)."""
    blocks, size = _number(labels.get("num_gpu_blocks")), _number(labels.get("block_size"))
    if blocks is not None and size is not None:
        return round(blocks * size)
    tokens = _number(labels.get("kv_cache_size_tokens"))
    return None if tokens is None else round(tokens)


def _number(text: str | None) -> float | None:
    """A label's number; None for absent, 'None' or anything else that is not a finite positive number."""
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def metrics_url(url: str) -> str:
    """`<server>/metrics` for a backend URL, also when it was given with the OpenAI `/v1` suffix."""
    base = url.rstrip("/")
    return f"{base.removesuffix('/v1')}/metrics"


class EngineSampler:
    """Samples `<url>/metrics` in the background while open, at most once per `min_interval_s`.

    After a reply without signal it waits `retry_s` before asking again, so a server without metrics costs
    one request per half minute. Probe steps may ask for a sample at a moment of their choosing
    (`sample_soon`), within the same rate limit. Summaries cover everything seen while open; recent
    samples are kept for `waiting_persistent` and `between`.
    """

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        headers: dict[str, str] | None = None,
        min_interval_s: float = 0.5,
        retry_s: float = 30.0,
        keep: int = 2400,
    ) -> None:
        self.url = metrics_url(url)
        self.session = session
        self.headers = dict(headers or {})
        self.min_interval_s = max(0.5, min_interval_s)
        self.retry_s = retry_s
        self.samples: deque[EngineSample] = deque(maxlen=keep)
        self.available = False
        self.attempts = 0
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._tried = asyncio.Event()
        self._last_fetch = -math.inf
        self._held = False
        self._max: dict[str, float] = {}
        self._timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * self.min_interval_s))
        # A loaded engine is slow to render its page (vLLM took 1.02 s at 160 in flight): once it has
        # shown its gauges, a slow or lost scrape is a missed sample, never "no signal" for half a minute.
        self._loaded_timeout = aiohttp.ClientTimeout(total=max(5.0, 4 * self.min_interval_s))
        self.seen_signal = False
        self.missed = 0
        self._first: EngineSample | None = None

    @property
    def latest(self) -> EngineSample | None:
        return self.samples[-1] if self.samples else None

    async def __aenter__(self) -> EngineSampler:
        self._task = asyncio.create_task(self._run(), name=f"engine-metrics {self.url}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def sample_once(self) -> EngineSample | None:
        """One GET of /metrics now (rate limit aside); the sample (also recorded) or None for no signal."""
        sent = time.perf_counter()
        self._last_fetch = sent
        self.attempts += 1
        timeout = self._loaded_timeout if self.seen_signal else self._timeout
        try:
            async with self.session.get(self.url, headers=self.headers, timeout=timeout) as resp:
                text: str | None = await resp.text(errors="replace") if resp.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, ValueError):
            text = None  # no answer: a missed sample of an engine that has gauges
        if text is None and self.seen_signal:
            self.missed += 1
            self._tried.set()
            return None
        # The gauges describe some instant between sending and receiving: take the middle. An engine's
        # page runs to thousands of lines (histograms): parse it off the event loop that drives rollouts.
        at = (sent + time.perf_counter()) / 2
        sample = await asyncio.to_thread(parse_engine_metrics, text, at) if text else None
        self.available = sample is not None
        self.seen_signal = self.seen_signal or self.available
        self._tried.set()
        if sample is not None:
            self._record(sample)
        return sample

    async def has_signal(self) -> bool:
        """Whether the engine publishes its gauges, waiting for the first answer if none came yet."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._tried.wait(), self._timeout.total or 1.0)
        return self.available

    async def reserve(self) -> bool:
        """Keep the next sample for the caller (the background cadence pauses until it is taken or
        release()), and wait until it may be taken; False, and nothing held, when there is no signal."""
        if not await self.has_signal():
            return False
        self._held = True
        await asyncio.sleep(max(0.0, self._last_fetch + self.min_interval_s - time.perf_counter()))
        return True

    async def sample_soon(self) -> EngineSample | None:
        """A sample as soon as the rate limit allows (None without signal: no extra request then)."""
        async with self._lock:
            if not self.available:
                return None
            await asyncio.sleep(max(0.0, self._last_fetch + self.min_interval_s - time.perf_counter()))
            try:
                return await self.sample_once()
            finally:
                self._held = False

    def release(self) -> None:
        """Give a reservation back untaken (the step ended before its sample)."""
        self._held = False

    def between(self, t0: float, t1: float) -> list[EngineSample]:
        """Samples whose instant lies in [t0, t1] (perf_counter times)."""
        return [s for s in self.samples if t0 <= s.at <= t1]

    def _record(self, sample: EngineSample) -> None:
        if self._first is None:
            self._first = sample
        self.samples.append(sample)
        for key, value in (
            ("running_max", sample.running),
            ("waiting_max", sample.waiting),
            ("kv_cache_usage_max", sample.kv_cache_usage),
        ):
            if value is not None and value > self._max.get(key, -1.0):
                self._max[key] = value

    async def _run(self) -> None:
        while True:
            pause = self.min_interval_s if self.available or self.attempts == 0 else self.retry_s
            due = self._last_fetch + pause
            if self._held and self.available:
                await asyncio.sleep(self.min_interval_s / 10)
                continue
            if time.perf_counter() < due:
                await asyncio.sleep(due - time.perf_counter())
                continue  # a probe step may have sampled meanwhile: the next one is due later
            async with self._lock:
                if time.perf_counter() >= self._last_fetch + pause:
                    await self.sample_once()

    def summary(self, since: float | None = None) -> dict[str, Any] | None:
        """running_max, waiting_max, kv_cache_usage_max over all samples (or those at or after `since`)."""
        if since is None:
            if not self._max:
                return None
            peaks = {k: self._max.get(k) for k in ("running_max", "waiting_max", "kv_cache_usage_max")}
            return {**peaks, **self._growth()}
        recent = [s for s in self.samples if s.at >= since]
        if not recent:
            return None
        return {
            "running_max": _max_of(s.running for s in recent),
            "waiting_max": _max_of(s.waiting for s in recent),
            "kv_cache_usage_max": _max_of(s.kv_cache_usage for s in recent),
        }

    def stated(self) -> dict[str, Any]:
        """What the engine says it holds (cache_config_info), the capacity line of the tuning plot."""
        last = self.samples[-1] if self.samples else None
        if last is None or last.kv_max_concurrency is None:
            return {}
        return {"kv_max_concurrency": round(last.kv_max_concurrency, 2)}

    def _growth(self) -> dict[str, Any]:
        """The counters' growth while sampled: preemptions, and the prefix cache's hit rate."""
        first = self._first
        last = self.samples[-1] if self.samples else None
        out: dict[str, Any] = {}
        if first is None or last is None:
            return out
        if first.preemptions is not None and last.preemptions is not None:
            out["preemptions"] = max(0, last.preemptions - first.preemptions)
        if None not in (first.prefix_queries, last.prefix_queries, first.prefix_hits, last.prefix_hits):
            asked = last.prefix_queries - first.prefix_queries  # type: ignore[operator]
            hit = last.prefix_hits - first.prefix_hits  # type: ignore[operator]
            out["prefix_cache_hit_rate"] = round(hit / asked, 4) if asked > 0 else None
        return out

    def waiting_persistent(self, window_s: float, now: float | None = None) -> bool:
        """Every sample of the last `window_s` had requests waiting, and there were enough samples to say so
        (at least two, covering half the window): a queue that stays, not one burst."""
        now = time.perf_counter() if now is None else now
        recent = [s for s in self.samples if s.at >= now - window_s]
        needed = max(2, int(window_s / self.min_interval_s / 2))
        return len(recent) >= needed and all(s.waiting is not None and s.waiting > 0 for s in recent)


def _max_of(values: Any) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


async def engine_gauges(urls: list[str], headers: dict[str, str]) -> dict[str, EngineSample | None]:
    """One reading of each endpoint's engine now (None where it publishes no gauges), each bounded."""
    session = session_for_loop()
    return {url: await EngineSampler(url, session, headers).sample_once() for url in urls}


@contextlib.asynccontextmanager
async def sample_endpoints(
    pool: EndpointPool, headers: dict[str, str]
) -> AsyncIterator[dict[str, EngineSampler]]:
    """While collecting, one sampler per endpoint (by URL); each endpoint's report row reads its peaks."""
    session = session_for_loop()
    samplers: dict[str, EngineSampler] = {}
    async with contextlib.AsyncExitStack() as stack:
        for ep in pool.endpoints:
            sampler = await stack.enter_async_context(EngineSampler(ep.url, session, headers))
            ep.engine, samplers[ep.url] = sampler.summary, sampler
        yield samplers
