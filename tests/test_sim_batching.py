"""The simulator's continuous-batching profiles over real HTTP: a closed loop at fixed concurrency measures
the curve each profile promises (gradual rise, KV plateau, preemption decline) against steady_rate()."""

from __future__ import annotations

import asyncio
import itertools
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from rollflow.infra.local import Service, spawn_simulator
from rollflow.infra.simulator.batching import steady_rate
from rollflow.infra.simulator.cli import config_from_args, make_parser, replica_configs
from rollflow.infra.simulator.config import SimConfig
from rollflow.infra.simulator.profiles import PROFILES

ROW = orjson.dumps({"responses_create_params": {"input": [{"role": "user", "content": "What is 2 + 3?"}]}})
WINDOW_S = 1.5
MAX_REQUESTS = 4000


def profile_config(name: str) -> SimConfig:
    return SimConfig(**PROFILES[name].settings)  # type: ignore[arg-type]


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert match, f"{name} missing from:\n{text}"
    return float(match.group(1))


@dataclass
class Load:
    """One closed-loop run: completions per second in the window, their p50 latency, mid-run /metrics."""

    rate: float
    p50_s: float
    metrics: str


async def closed_loop(url: str, in_flight: int, expected_rate: float) -> Load:
    """`in_flight` clients each posting /run back to back; warm up for ~1.5 turnovers, then count a window.

    Bounded by WINDOW_S after the warm-up and by MAX_REQUESTS; requests still under way at the end are
    abandoned (the batching engine aborts them when their connection closes).
    """
    warmup = max(0.3, 1.5 * in_flight / expected_rate)
    start = time.monotonic()
    measure_from, end = start + warmup, start + warmup + WINDOW_S
    latencies: list[float] = []
    counter = itertools.count()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client() -> None:
            while (i := next(counter)) < MAX_REQUESTS:
                t0 = time.monotonic()
                headers = {"X-Rollflow-Rollout-Index": str(i)}
                async with s.post(f"{url}/run", data=ROW, headers=headers) as resp:
                    assert resp.status == 200
                    await resp.read()
                t1 = time.monotonic()
                if measure_from <= t1 < end:
                    latencies.append(t1 - t0)

        clients = [asyncio.create_task(client()) for _ in range(in_flight)]
        await asyncio.sleep(warmup + WINDOW_S / 2)
        async with s.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        for task in clients:
            task.cancel()
        results = await asyncio.gather(*clients, return_exceptions=True)
    failures = [r for r in results if not isinstance(r, asyncio.CancelledError | None)]
    assert not failures, failures
    return Load(len(latencies) / WINDOW_S, statistics.median(latencies), metrics)


@pytest.fixture
def profile_sim() -> Iterator[Callable[..., Service]]:
    """Start simulators with the given flags for one test; all stopped at its end."""
    started: list[Service] = []

    def start(*args: str) -> Service:
        started.append(spawn_simulator(*args))
        return started[-1]

    yield start
    for sim in started:
        sim.stop()


async def measure(url: str, config: SimConfig, levels: tuple[int, ...]) -> dict[int, Load]:
    loads = {n: await closed_loop(url, n, steady_rate(config, n)) for n in levels}
    for n, load in loads.items():
        want = steady_rate(config, n)
        assert abs(load.rate / want - 1) < 0.1, (n, load.rate, want)
    return loads


@pytest.mark.alone  # measures rates and latencies
async def test_batching_rises_sublinearly_and_latency_grows(profile_sim) -> None:
    sim = profile_sim("--profile", "batching")
    loads = await measure(sim.url, profile_config("batching"), (8, 32, 64))
    rate = {n: load.rate for n, load in loads.items()}
    assert rate[8] < rate[32] < rate[64] < 2 * rate[32]
    assert loads[8].p50_s < loads[32].p50_s < loads[64].p50_s
    assert gauge(loads[64].metrics, "vllm:num_requests_waiting") == 0


@pytest.mark.alone  # measures rates
async def test_kv_limited_flattens_and_queues(profile_sim) -> None:
    sim = profile_sim("--profile", "kv-limited")
    loads = await measure(sim.url, profile_config("kv-limited"), (64, 128))
    assert abs(loads[128].rate / loads[64].rate - 1) < 0.1
    text = loads[128].metrics
    assert gauge(text, "vllm:num_requests_waiting") > 0
    assert gauge(text, "vllm:kv_cache_usage_perc") >= 0.9
    assert 35 <= gauge(text, "vllm:num_requests_running") <= 60


@pytest.mark.alone  # measures rates
async def test_preempting_falls_past_its_best_point(profile_sim) -> None:
    sim = profile_sim("--profile", "preempting", "--metrics-format", "sglang")
    loads = await measure(sim.url, profile_config("preempting"), (48, 128))
    assert loads[128].rate < 0.8 * loads[48].rate
    assert gauge(loads[128].metrics, "sglang:num_running_reqs") > 100


async def stats(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(f"{url}/stats") as resp:
        return await resp.json()


@pytest.mark.alone  # asserts a request < 0.5 s
async def test_a_disconnected_client_frees_its_place(profile_sim) -> None:
    sim = profile_sim("--profile", "kv-limited", "--step-ms", "50", "--max-num-seqs", "2")
    async with aiohttp.ClientSession() as s:
        posts = [asyncio.create_task(s.post(f"{sim.url}/run", data=ROW)) for _ in range(4)]
        for _ in range(50):
            seen = await stats(s, sim.url)
            if (seen["in_flight"], seen["queued"]) == (2, 2):
                break
            await asyncio.sleep(0.02)
        assert (seen["in_flight"], seen["queued"]) == (2, 2) and seen["kv_cache_usage"] > 0
        assert seen["model"] == "batching" and seen["max_num_seqs"] == 2 and seen["kv_tokens"] == 4608
        for task in posts:
            task.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
        for _ in range(50):
            seen = await stats(s, sim.url)
            if (seen["in_flight"], seen["queued"]) == (0, 0):
                break
            await asyncio.sleep(0.02)
        assert (seen["in_flight"], seen["queued"], seen["kv_cache_usage"]) == (0, 0, 0.0)
        async with s.post(f"{sim.url}/admin/config", data=orjson.dumps({"step_ms": 1.0})) as resp:
            assert resp.status == 200
        t0 = time.monotonic()
        async with s.post(f"{sim.url}/run", data=ROW) as resp:
            assert resp.status == 200
        assert time.monotonic() - t0 < 0.5


def test_steady_rate_is_the_documented_curve() -> None:
    batching, kv, preempting = (profile_config(n) for n in ("batching", "kv-limited", "preempting"))
    curve = {n: round(steady_rate(batching, n)) for n in (1, 8, 16, 32, 64, 128)}
    assert curve == {1: 29, 8: 152, 16: 219, 32: 281, 64: 327, 128: 356}
    limit = 1000 / batching.seq_step_ms / 32
    assert steady_rate(batching, 12) < limit / 2 < steady_rate(batching, 13)
    assert steady_rate(batching, 64) / steady_rate(batching, 32) > 1.15
    assert steady_rate(kv, 48) == steady_rate(kv, 64) == steady_rate(kv, 128)
    best = max(steady_rate(preempting, n) for n in range(1, 257))
    assert best == steady_rate(preempting, 48) and steady_rate(preempting, 128) < 0.65 * best
    assert steady_rate(SimConfig(slots=4, latency_ms=200), 16) == pytest.approx(20.0)
    assert steady_rate(batching, 64, mean_tokens=64) == pytest.approx(steady_rate(batching, 64) / 2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"model": "vllm"}, "model must be one of slots, batching"),
        ({"step_ms": 0, "seq_step_ms": 0}, "cannot both be 0"),
        ({"seq_step_ms": -1}, "seq_step_ms must be a number >= 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"kv_tokens": 0}, "kv_tokens must be an integer >= 1 or null"),
        ({"preempt_after": 2.5}, "preempt_after must be an integer >= 1 or null"),
        ({"kv_prompt_tokens": -1}, "kv_prompt_tokens must be an integer >= 0"),
        ({"recompute": "lots"}, "recompute must be a number >= 0"),
    ],
)
def test_config_validation(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimConfig(**settings)  # type: ignore[arg-type]
    config = profile_config("batching")
    if "model" not in settings:
        with pytest.raises(ValueError, match=message):
            config.update(settings)
        assert config == profile_config("batching")


def test_flags_over_profiles_and_replicas() -> None:
    parse = make_parser().parse_args
    config = config_from_args(parse(["--profile", "kv-limited", "--kv-tokens", "1000", "--max-tokens", "64"]))
    assert (config.model, config.kv_tokens, config.step_ms, config.max_tokens) == ("batching", 1000, 1.0, 64)
    sharp = config_from_args(parse([]))
    assert (sharp.model, sharp.slots, sharp.max_tokens) == ("slots", 64, 256)
    with pytest.raises(ValueError, match="--step-ms apply to the batching profiles"):
        config_from_args(parse(["--step-ms", "2"]))
    with pytest.raises(ValueError, match="cannot be changed live"):
        config.update({"model": "slots"})
    replicas = replica_configs(config, [(16, 2.0), (64, 1.0)])
    assert [(r.max_num_seqs, r.step_ms, r.kv_tokens) for r in replicas] == [(16, 2.0, 1000), (64, 1.0, 1000)]
