"""Several replicas of one backend: per-endpoint limits, least-loaded dispatch, and rotation.

Each attempt goes to the in-rotation endpoint with the least outstanding requests relative to its limit,
so unequal replicas get load in proportion to their capacity. A replica that refuses connections, or
fails STREAK_OUT times in a row (5xx, dropped connection, timeout, a garbled 200 body), leaves rotation;
after a backoff, capped so a replica that comes back gets load again within seconds, one trial request
decides whether it is back (half-open). The one ConcurrencyLimit that workers take follows the
in-rotation limits. A task's repeats go to the replica that served it before while that replica is about
as free as the least loaded (prefix affinity), so the engine computes the prompt once.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.backends.observe import AttemptObserver

STREAK_OUT = 5
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 2.0  # trial interval cap: a returning replica is back within this plus one request
# A replica answering 200 with a body that is not a reply (garbled, truncated, an event stream) is as
# broken as one answering 5xx: "malformed" counts toward the streak too.
STREAK_KINDS = ("connection", "timeout", "malformed")
OUT_AT_START = -1
AFFINITY_SLACK = 0.25  # a task's replica may carry this share of its limit more than the least loaded
AFFINITY_TASKS = 4096  # tasks remembered (repeats of a task are dispatched close together)
FOLLOWED_TRIAL_S = 4 * BACKOFF_MAX_S  # a trial of a replica another worker took out, if it never returns
# Numbers this process's rotation findings, across all its pools: a pool opened later for the same run
# (same worker name) reports larger numbers than an earlier one, so the book never takes them as old.
_FINDINGS = itertools.count(1)


@dataclass(eq=False)
class Endpoint:
    """One replica: its limit, what is in flight there, whether it takes load, and what it served."""

    url: str
    limit: int
    outstanding: int = 0
    in_rotation: bool = True
    rollouts: int = 0
    errors: int = 0
    out_of_rotation_s: float = 0.0
    ejections: int = 0
    streak: int = 0
    trial: bool = False
    backoff_s: float = 0.0
    retry_at: float = 0.0
    out_since: float | None = None
    # When it last got an attempt (a pool-wide count): ties go to the least recently used endpoint.
    last_begun: int = 0
    # ("out" | "in", epoch seconds): when the endpoint left and rejoined rotation.
    events: list[tuple[str, float]] = field(default_factory=list)
    # This pool's own newest finding (not one it followed), and its number (_FINDINGS; 0: none yet).
    finding: str = "in"
    found: int = 0
    followed: int = 0  # the newest run-wide rotation event (the share book's sequence) applied here
    book_in: bool = True  # in rotation as the share book last published (what this worker's share is of)
    observers: list[AttemptObserver] = field(default_factory=list)
    engine: Callable[[], dict[str, Any] | None] | None = None
    agents: frozenset[str] = frozenset()  # the agents whose rows it answers (empty: any row)
    peak: int = 0  # the most in flight at once since a controller last read it (`take_peak`)
    marked_at: float = 0.0  # perf_counter time of the last `mark`
    left: int = 0  # attempts in flight at the last `mark` that have not ended yet

    def mark(self) -> None:
        """Start a turnover: from now, count down the attempts in flight until each of them has ended."""
        self.marked_at, self.left = time.perf_counter(), self.outstanding

    def take_peak(self) -> int:
        """The most in flight at once since the last call (an instant's count is noise at small limits)."""
        peak, self.peak = max(self.peak, self.outstanding), self.outstanding
        return peak

    @property
    def weight(self) -> int:
        """Its share in dispatch: its limit, and 1 for an endpoint with no fixed slots (limit 0)."""
        return max(1, self.limit)

    def out_for(self, now: float) -> float:
        """Seconds out of rotation so far, the current spell included."""
        current = now - self.out_since if self.out_since is not None else 0.0
        return self.out_of_rotation_s + current


def split_limit(total: int, weights: dict[str, int] | list[str]) -> dict[str, int]:
    """`total` split in proportion to `weights` (evenly over a list of URLs); the sum is always `total`.

    Units left over go to the largest remainders, ties to the first URLs. With fewer slots than endpoints,
    the last ones get 0 fixed slots: they still take attempts as slots free up (the pool's total is the
    cap), so every endpoint is used and the user's total holds.
    """
    if not isinstance(weights, dict) or sum(weights.values()) <= 0:
        weights = dict.fromkeys(weights, 1)
    whole = sum(weights.values())
    exact = {url: total * n / whole for url, n in weights.items()}
    shares = {url: int(x) for url, x in exact.items()}
    by_remainder = sorted(weights, key=lambda url: shares[url] - exact[url])
    for url in by_remainder[: total - sum(shares.values())]:
        shares[url] += 1
    return shares


class UnknownAgent(LookupError):
    """A row names an agent no endpoint of the pool answers for (the plan refuses such rows first)."""


class EndpointPool:
    """The endpoints of one backend and the choice of where each attempt goes.

    With `groups` (URL -> agent names), an attempt for an agent goes only to that agent's endpoints:
    a row is always answered by the server it names.
    """

    def __init__(
        self,
        urls: list[str],
        limits: dict[str, int],
        total: ConcurrencyLimit,
        groups: dict[str, frozenset[str]] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("an endpoint pool needs at least one URL")
        groups = groups or {}
        self.endpoints = [Endpoint(url, limits[url], agents=groups.get(url, frozenset())) for url in urls]
        self.routed = any(ep.agents for ep in self.endpoints)
        self.total = total
        self._by_url = {ep.url: ep for ep in self.endpoints}
        self.share: int | None = None  # a worker process's part of the run's limit (None: all of it)
        self.run_limits: dict[str, int] = {}  # the run's limits, which a share is spread like
        self.started: float | None = None
        self.last: float | None = None
        self._begun = 0
        self._affinity: OrderedDict[int, str] = OrderedDict()  # task -> the replica that last served it
        self.affine = 0  # attempts sent to their task's replica for its prefix cache
        self._sync_total()

    def endpoint(self, url: str) -> Endpoint:
        return self._by_url[url]

    def serving(self, agent: str | None) -> list[Endpoint]:
        """The endpoints that may answer a row of `agent` (all of them when rows are not routed)."""
        if not self.routed:
            return self.endpoints
        found = [ep for ep in self.endpoints if agent is not None and agent in ep.agents]
        if not found:
            known = sorted({a for ep in self.endpoints for a in ep.agents})
            raise UnknownAgent(f"no server answers for agent {agent!r} (known agents: {', '.join(known)})")
        return found

    def choose(
        self, exclude: Collection[str] = (), agent: str | None = None, task: int | None = None
    ) -> Endpoint:
        """A due half-open trial first; else the in-rotation endpoint with the most free capacity, or the
        one that served `task` before while it is nearly as free (prefix affinity).

        With every endpoint out of rotation, requests still go out (to the least loaded), so a run whose
        replicas are all down fails through the usual bounded retries. Only `agent`'s endpoints are
        considered when rows are routed by agent.
        """
        now = time.monotonic()
        if self.started is None:
            self.started = now
        endpoints = self.serving(agent)
        for ep in endpoints:
            if not ep.in_rotation and not ep.trial and now >= ep.retry_at and ep.url not in exclude:
                ep.trial = True
                return ep
        if len(endpoints) == 1:  # whatever its state, a lone endpoint is the choice (the usual case)
            return endpoints[0]
        live = [ep for ep in endpoints if ep.in_rotation]
        allowed = [ep for ep in live if ep.url not in exclude] or live
        allowed = allowed or [ep for ep in endpoints if ep.url not in exclude] or endpoints
        best = min(allowed, key=lambda ep: (ep.outstanding / ep.weight, -ep.weight, ep.last_begun))
        if task is None or len(allowed) == 1:
            return best
        return self._affine(task, best, allowed)

    def _affine(self, task: int, best: Endpoint, allowed: list[Endpoint]) -> Endpoint:
        """The replica that last served this task while it is about as free as the best (its prefix cache
        holds the prompt); else the best, remembered for the task's next repeats."""
        url = self._affinity.get(task)
        ep = self._by_url.get(url) if url is not None else None
        if ep is not None and ep in allowed:  # it may carry up to the slack past its share, not more
            slack = AFFINITY_SLACK * max(1, ep.weight)
            if ep.outstanding <= best.outstanding / best.weight * ep.weight + slack:
                self._affinity.move_to_end(task)
                self.affine += 1
                return ep
        self._affinity[task] = best.url
        self._affinity.move_to_end(task)
        while len(self._affinity) > AFFINITY_TASKS:
            self._affinity.popitem(last=False)
        return best

    def begin(self, ep: Endpoint) -> int:
        """Count an attempt in flight; the token tells `caused_by_rotation` what rotation it started in."""
        ep.outstanding += 1
        ep.peak = max(ep.peak, ep.outstanding)
        self._begun += 1
        ep.last_begun = self._begun
        return ep.ejections if ep.in_rotation else OUT_AT_START

    def end(self, ep: Endpoint, abandoned: bool = False, started: float | None = None) -> None:
        """The attempt (begun at perf_counter time `started`) is over; an abandoned (cancelled) one frees
        a trial slot without an outcome."""
        ep.outstanding -= 1
        if ep.left > 0 and (started is None or started <= ep.marked_at):  # None: not known, so counted
            ep.left -= 1
        if abandoned:
            ep.trial = False

    def succeeded(self, ep: Endpoint, latency_s: float) -> None:
        now = time.monotonic()
        ep.rollouts += 1
        ep.streak = 0
        ep.trial = False
        self.last = now
        if not ep.in_rotation:
            self._rejoin(ep, now)
        for observer in ep.observers:
            observer.success(latency_s)

    def failed(self, ep: Endpoint, kind: str, refused: bool = False) -> None:
        """Record a failed attempt; a refused connection or a streak of failures takes `ep` out."""
        now = time.monotonic()
        ep.errors += 1
        for observer in ep.observers:
            observer.failure(kind)
        if not ep.in_rotation:
            if ep.trial:
                ep.trial = False
                ep.backoff_s = min(BACKOFF_MAX_S, ep.backoff_s * 2)
                ep.retry_at = now + ep.backoff_s
            return
        if kind.startswith("http_5") or kind in STREAK_KINDS:
            ep.streak += 1
        else:
            ep.streak = 0
        if refused or ep.streak >= STREAK_OUT:
            self._eject(ep, now)

    def caused_by_rotation(self, ep: Endpoint, token: int, agent: str | None = None) -> bool:
        """Whether a failed attempt is the replica's leaving rotation, with others left to retry on (of
        the same agent, when rows are routed by agent: another agent's server is no retry)."""
        left = token == OUT_AT_START or token != ep.ejections
        return left and self.others_in_rotation(ep, agent)

    def others_in_rotation(self, ep: Endpoint, agent: str | None = None) -> bool:
        return any(other.in_rotation for other in self.serving(agent) if other is not ep)

    def set_limit(self, url: str, n: int) -> None:
        if n < 1:
            raise ValueError(f"an endpoint's limit must be at least 1, got {n} for {url}")
        self._by_url[url].limit = n
        self._sync_total()

    def set_share(self, share: int, run_limits: dict[str, int]) -> None:
        """A worker process's share of the run-wide limit, spread like the run's limits over the replicas
        the share book counts in rotation (its limit is theirs): a replica out of rotation takes none of
        it. One this worker took out, of which the book does not know yet, keeps its part unused until
        the book's next answer, so no live replica gets more than its limit meanwhile."""
        self.share, self.run_limits = share, dict(run_limits)
        self._spread()

    def follow(self, url: str, state: str, seq: int) -> None:
        """Apply the run-wide rotation: `url` left rotation (or rejoined it) as the share book's event
        `seq`; events come in the book's order, never by clocks, and each is applied once.

        A replica taken out elsewhere gets no trial here for a while: the worker that took it out tries it.
        """
        ep = self._by_url.get(url)
        if ep is None or seq <= ep.followed:
            return
        ep.followed, ep.book_in = seq, state == "in"
        now = time.monotonic()
        if state == "out" and ep.in_rotation:
            self._eject(ep, now, found=False)
            ep.backoff_s = BACKOFF_MAX_S
            ep.retry_at = now + FOLLOWED_TRIAL_S
        elif state == "in" and not ep.in_rotation:
            self._rejoin(ep, now, found=False)
        else:
            self._spread()

    def rotation(self) -> dict[str, tuple[str, int]]:
        """This pool's own findings ("out" or "in", and their number): what it reports to the book.
        What it followed is not reported back, so a finding echoed late never overrides a newer one."""
        return {ep.url: (ep.finding, ep.found) for ep in self.endpoints if ep.found}

    def in_flight(self) -> int:
        return sum(ep.outstanding for ep in self.endpoints)

    def limits(self) -> dict[str, int]:
        return {ep.url: ep.limit for ep in self.endpoints}

    def observe(self, url: str, observer: AttemptObserver) -> None:
        """`observer` sees this endpoint's attempts, besides the context's observers that see all."""
        self._by_url[url].observers.append(observer)

    def rows(self) -> list[dict[str, Any]]:
        """The report's `endpoints` table: what each endpoint served, at what rate, how long it was out."""
        now = time.monotonic()
        span = (self.last - self.started) if self.started is not None and self.last is not None else 0.0
        return [
            {
                "url": ep.url,
                **({"agents": sorted(ep.agents)} if ep.agents else {}),
                "rollouts": ep.rollouts,
                "rollouts_per_s": round(ep.rollouts / span, 3) if span > 0 else None,
                "errors": ep.errors,
                "limit": ep.limit,
                "out_of_rotation_s": round(ep.out_for(now), 3),
                "engine": ep.engine() if ep.engine is not None else None,
            }
            for ep in self.endpoints
        ]

    def _eject(self, ep: Endpoint, now: float, found: bool = True) -> None:
        ep.in_rotation = False
        ep.ejections += 1
        ep.streak = 0
        ep.out_since = now
        ep.backoff_s = BACKOFF_BASE_S
        ep.retry_at = now + ep.backoff_s
        ep.events.append(("out", time.time()))
        self._changed(ep, "out", found)

    def _rejoin(self, ep: Endpoint, now: float, found: bool = True) -> None:
        ep.in_rotation = True
        if ep.out_since is not None:
            ep.out_of_rotation_s += now - ep.out_since
        ep.out_since = None
        ep.events.append(("in", time.time()))
        self._changed(ep, "in", found)

    def _changed(self, ep: Endpoint, state: str, found: bool) -> None:
        if found:
            ep.finding, ep.found = state, next(_FINDINGS)
        self._spread()

    def _spread(self) -> None:
        """A worker's share over the endpoints the book counts in rotation (all of them when it counts
        none), none of it on those out here; then the total."""
        if self.share is not None:
            basis = {url: n for url, n in self.run_limits.items() if self._by_url[url].book_in}
            spread = split_limit(self.share, basis or self.run_limits)
            for ep in self.endpoints:
                ep.limit = spread.get(ep.url, 0) if ep.in_rotation or not basis else 0
        self._sync_total()

    def _sync_total(self) -> None:
        """The shared limit is the in-rotation endpoints' weights (all limits when none is in rotation),
        never above the sum of the limits: endpoints with 0 fixed slots never add to the user's total."""
        cap = max(1, sum(ep.limit for ep in self.endpoints))
        live = sum(ep.weight for ep in self.endpoints if ep.in_rotation)
        target = min(live, cap) if live else cap
        if self.share is not None:
            target = min(target, self.share)
        if self.total.limit != target:
            self.total.set_limit(target)
