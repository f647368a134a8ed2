"""A continuous-batching engine (as vLLM and SGLang schedule decoding): processor sharing in virtual time.

Every running sequence advances one token per decode step, and a step costs step_ms + seq_step_ms * n with
n sequences in the batch, so each request slows as the batch grows while total throughput rises
sublinearly towards 1000 / seq_step_ms tokens/s. Past `preempt_after` running sequences the engine starts
preempting and recomputing, dividing every sequence's rate further, so throughput falls. Requests are
admitted FIFO while fewer than max_num_seqs run and (with kv_tokens) the KV cache has room for their
reservation; the rest wait.

The model is exact and event-driven: V is the progress, in tokens, every running sequence has made since
start. A request admitted at V needing w tokens finishes when V reaches V + w, so the running requests sit
in a heap keyed by that finish point, and one timer is set for the smallest. The rate dV/dt changes only
when n does (an admission, a completion, a disconnect, a live config change), so each event costs a heap
operation and rescheduling one timer, whatever the batch size.

With kv_blocks the cache is paged, as vLLM's: a running request holds its prompt and the tokens decoded so
far, so the cache fills as the batch decodes. Its use is S + n * V (S sums each running request's prompt
minus its start point), so the moment it fills is one more timer. Then the youngest running request is
preempted: it goes back to the head of the queue and loses its progress (recomputing its prompt and
those tokens adds `recompute` decode steps per token to its work), and no
request is admitted until one completes, as vLLM admits none in a step that preempted.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import time
from collections import deque

from rollflow.infra.simulator.capacity import Counters, QueueFull
from rollflow.infra.simulator.config import SimConfig

EARLY_S = 0.0002
WAITING, RUNNING, DONE = 0, 1, 2


def step_s(config: SimConfig, n: int) -> float:
    """Seconds one decode step takes with n sequences in the batch (a base plus a per-sequence cost)."""
    return (config.step_ms + config.seq_step_ms * n) / 1000.0


def seq_rate(config: SimConfig, n: int) -> float:
    """Tokens per second each of n running sequences makes, after any preemption slowdown."""
    rate = 1.0 / step_s(config, max(1, n))
    after = config.preempt_after
    if after is not None and n > after:
        rate /= 1.0 + config.recompute * (n - after) / after
    return rate


def kv_fit(config: SimConfig, mean_tokens: float) -> int | None:
    """How many average requests the KV cache holds at once (None: no KV limit)."""
    if config.kv_tokens is None:
        return None
    return max(1, math.floor(config.kv_tokens / (mean_tokens + config.kv_prompt_tokens)))


def steady_rate(config: SimConfig, in_flight: int, mean_tokens: float | None = None) -> float:
    """Rollouts/s the config's model sustains with `in_flight` requests always under way (a closed loop).

    mean_tokens defaults to the middle of min_tokens..max_tokens, the mean of the content model's draw.
    """
    if mean_tokens is None:
        mean_tokens = (config.min_tokens + config.max_tokens) / 2
    if in_flight < 1:
        return 0.0
    if config.model == "slots":
        busy = min(in_flight, config.slots)
        service = (config.latency_ms + config.per_token_ms * mean_tokens) / 1000.0
        if config.contention and config.slots > 1:
            service *= 1.0 + config.contention * (busy - 1) / config.slots
        return math.inf if service == 0 else busy / service
    n = min(in_flight, config.max_num_seqs)
    fit = kv_fit(config, mean_tokens)
    if fit is not None:
        n = min(n, fit)
    return n * seq_rate(config, n) / (mean_tokens + config.prefill_tokens)


class _Request:
    """One request's place in the engine: its work, KV reservation, state and the future it waits on."""

    __slots__ = ("future", "gen", "kv", "start", "state", "work")

    def __init__(self, work: float, kv: int, future: asyncio.Future[None]) -> None:
        self.work = work
        self.kv = kv
        self.future = future
        self.state = WAITING
        self.start = 0.0  # V at admission (the paged cache's growth is measured from it)
        self.gen = 0  # admissions so far: a preempted request's old heap entry is stale


def _live(req: _Request, gen: int) -> bool:
    """An entry made at admission `gen` still stands for a running request (not a preempted one's past)."""
    return req.state == RUNNING and req.gen == gen


class BatchingEngine:
    """The engine behind one simulated backend; serve() returns when the request's last token is decoded."""

    def __init__(self, config: SimConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.rng = random.Random(config.seed + 1)
        self.v = 0.0
        self.t = time.monotonic()
        self.rate = seq_rate(config, 0)
        self.running: list[tuple[float, int, _Request]] = []
        self.n = 0
        self.waiting: deque[_Request] = deque()
        self.n_waiting = 0
        self.reserved = 0
        self.held = 0.0  # paged cache: sum of (prompt tokens - start point) over running requests
        self.admitted: list[tuple[int, _Request]] = []  # paged cache: (gen, request) by admission
        self.pressure = False  # paged cache: preempted since the last completion, so admit nothing
        self.order = itertools.count()
        self.timer: asyncio.TimerHandle | None = None

    def busy_now(self) -> int:
        """Sequences in the running batch."""
        return self.n

    def kv_capacity(self) -> int | None:
        """The paged cache's size in tokens (None without one)."""
        cfg = self.config
        return None if cfg.kv_blocks is None else cfg.kv_blocks * cfg.block_size

    def kv_held(self) -> float:
        """Tokens the running requests hold in the paged cache now."""
        return self.held + self.n * self.v

    def kv_use(self) -> float:
        """KV-cache use as vLLM reports it: held (paged) or reserved / cache, else running / max_num_seqs."""
        cfg, cap = self.config, self.kv_capacity()
        if cap is not None:
            self._advance()
            return min(1.0, self.kv_held() / cap)
        if cfg.kv_tokens is None:
            return min(1.0, self.n / cfg.max_num_seqs)
        return min(1.0, self.reserved / cfg.kv_tokens)

    def nominal_latency_s(self) -> float:
        """A lone request's time for the middle token count (what /metrics' latency sum assumes)."""
        cfg = self.config
        return ((cfg.min_tokens + cfg.max_tokens) / 2 + cfg.prefill_tokens) / seq_rate(cfg, 1)

    def resize(self) -> None:
        """Apply a live config change: progress so far at the old rate, then the new rate and admissions."""
        self._advance()
        self._admit()
        self._reschedule()

    async def serve(self, output_tokens: int, cached: bool = False) -> None:
        """Wait (FIFO) for admission, then decode `output_tokens` (after prefilling the prompt unless its
        prefix is `cached`); QueueFull if too many already wait."""
        cfg = self.config
        work = float(output_tokens + (0 if cached else cfg.prefill_tokens))
        if cfg.jitter:
            work = max(0.0, work * (1.0 + cfg.jitter * (2.0 * self.rng.random() - 1.0)))
        req = _Request(work, output_tokens + cfg.kv_prompt_tokens, asyncio.get_running_loop().create_future())
        self._advance()
        must_wait = self.n_waiting > 0 or not self._fits(req)
        if must_wait and cfg.max_queue is not None and self.n_waiting >= cfg.max_queue:
            raise QueueFull
        self.waiting.append(req)
        self.n_waiting += 1
        if self._admit():
            self._reschedule()
        try:
            await req.future
        except asyncio.CancelledError:
            self._drop(req)
            raise

    def _fits(self, req: _Request) -> bool:
        """Room in the batch and (with a KV limit) the cache; a request larger than the cache runs alone."""
        cfg, cap = self.config, self.kv_capacity()
        if self.n >= cfg.max_num_seqs:
            return False
        if cap is not None:
            # vLLM's watermark: a prompt is admitted only while 1% of the cache stays free beyond it
            return self.n == 0 or (not self.pressure and self.kv_held() + cfg.kv_prompt_tokens <= 0.99 * cap)
        if cfg.kv_tokens is None or self.n == 0:
            return True
        return self.reserved + req.kv <= cfg.kv_tokens

    def _advance(self) -> None:
        """Move V to now at the rate that held since the last event."""
        now = time.monotonic()
        self.v += (now - self.t) * self.rate
        self.t = now

    def _admit(self) -> bool:
        """Start waiting requests in arrival order while the head fits (no overtaking, as vLLM's FCFS).

        True if any started, so the batch size (and the rate) changed.
        """
        started = False
        while self.waiting:
            req = self.waiting[0]
            if req.state != WAITING:
                self.waiting.popleft()
                continue
            if not self._fits(req):
                break
            self.waiting.popleft()
            self.n_waiting -= 1
            req.state, req.start = RUNNING, self.v
            req.gen += 1
            heapq.heappush(self.running, (self.v + req.work, next(self.order), req.gen, req))
            self.n += 1
            self.reserved += req.kv
            if self.config.kv_blocks is not None:
                self.held += self.config.kv_prompt_tokens - req.start
                self.admitted.append((req.gen, req))
            started = True
        self._count()
        return started

    def _finish(self, req: _Request) -> None:
        req.state = DONE
        self._release(req)

    def _release(self, req: _Request) -> None:
        """Give back a running request's sequence slot and cache."""
        self.n -= 1
        self.reserved -= req.kv
        if self.config.kv_blocks is not None:
            self.held -= self.config.kv_prompt_tokens - req.start
            if self.n == 0:
                self.held = 0.0  # no float drift survives an empty batch
            if len(self.admitted) > 4 * self.n + 64:
                self.admitted = [(g, r) for g, r in self.admitted if _live(r, g)]

    def _preempt_youngest(self) -> None:
        """The cache is full: the youngest running request goes back to the head of the queue, its progress
        lost (vLLM recomputes it), and admissions stop until a request completes."""
        while not _live(self.admitted[-1][1], self.admitted[-1][0]):
            self.admitted.pop()
        req = self.admitted.pop()[1]
        self._release(req)
        # its decoded tokens are lost, and recomputing its prompt and them costs `recompute` steps per token
        req.work += self.config.recompute * (self.config.kv_prompt_tokens + self.v - req.start)
        req.state = WAITING
        self.waiting.appendleft(req)
        self.n_waiting += 1
        self.pressure = True
        self.counters.preemptions += 1

    def _drop(self, req: _Request) -> None:
        """A client gave up: free its place in the queue or its sequence slot and KV reservation."""
        if req.state == WAITING:
            req.state = DONE
            self.n_waiting -= 1
            self._count()
        elif req.state == RUNNING:
            self._advance()
            self._finish(req)
            self._admit()
            self._reschedule()

    def _on_timer(self) -> None:
        """Complete every request whose finish point V has reached, then admit and set the next timer."""
        self.timer = None
        self._advance()
        limit = self.v + EARLY_S * self.rate
        while self.running and self.running[0][0] <= limit:
            _, _, gen, req = heapq.heappop(self.running)
            if _live(req, gen):
                self._finish(req)
                self.pressure = False
                if not req.future.done():
                    req.future.set_result(None)
        cap = self.kv_capacity()
        while cap is not None and self.n > 1 and self.kv_held() >= cap * (1 - 1e-9):
            self._preempt_youngest()
        self._admit()
        self._reschedule()

    def _reschedule(self) -> None:
        """Recompute the per-sequence rate for the current batch and set the timer for the next completion."""
        self.rate = seq_rate(self.config, self.n)
        while self.running and not _live(self.running[0][3], self.running[0][2]):
            heapq.heappop(self.running)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.running:
            until = self.running[0][0]
            cap = self.kv_capacity()
            if cap is not None and self.n > 1:
                until = min(until, max(self.v, (cap - self.held) / self.n))  # the cache fills there
            delay = max(0.0, (until - self.v) / self.rate)
            self.timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _count(self) -> None:
        """Mirror the engine into the counters /stats and /metrics read."""
        c = self.counters
        c.in_flight = self.n
        c.queued = self.n_waiting
        if self.n + self.n_waiting > c.max_in_flight_seen:
            c.max_in_flight_seen = self.n + self.n_waiting
        if self.n > c.max_served_seen:
            c.max_served_seen = self.n
