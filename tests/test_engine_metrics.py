"""The engine-metrics reader: vLLM's and SGLang's real exposition text, and /metrics over HTTP from the
simulator in each format, with none (404), with garbage, and from a port that refuses connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from rollflow.infra.local import Service, free_port, spawn_simulator
from rollflow.tasks.backends.engine_metrics import EngineSampler, metrics_url, parse_engine_metrics

MODEL = 'model_name="Qwen/Qwen3-8B"'
VLLM = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 12.0
vllm:num_requests_running{{engine="1",{MODEL}}} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 30.0
vllm:num_requests_waiting{{engine="1",{MODEL}}} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.98
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.71
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",{MODEL}}} 123456.0
vllm:prompt_tokens_created{{engine="0",{MODEL}}} 1.7636e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{MODEL}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 815.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 815.0
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 96.5
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf",{MODEL}}} 40.0
vllm:request_prompt_tokens_count{{engine="0",{MODEL}}} 40.0
vllm:request_prompt_tokens_sum{{engine="0",{MODEL}}} 1000.0
vllm:request_prompt_tokens_count{{engine="1",{MODEL}}} 10.0
vllm:request_prompt_tokens_sum{{engine="1",{MODEL}}} 250.0
# HELP vllm:request_generation_tokens Number of generation tokens processed.
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_bucket{{engine="0",le="+Inf",{MODEL}}} 40.0
vllm:request_generation_tokens_count{{engine="0",{MODEL}}} 40.0
vllm:request_generation_tokens_sum{{engine="0",{MODEL}}} 30000.0
vllm:request_generation_tokens_sum{{engine="1",{MODEL}}} 7500.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000"}} 1.0
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 28.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8192.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 355.23
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 61.0
sglang:e2e_request_latency_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 61.0
sglang:e2e_request_latency_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 130.7
"""


def test_vllm_text_sums_engines_and_keeps_the_fullest_cache() -> None:
    sample = parse_engine_metrics(VLLM, at=5.0)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_cache_usage, sample.at) == (21, 37, 0.98, 5.0)
    # finished requests and the prompt + reply tokens they held, over both engines; the cache's block
    assert (sample.finished, sample.finished_tokens, sample.kv_block_tokens) == (50, 38750, 16)


def test_sglang_text() -> None:
    sample = parse_engine_metrics(SGLANG)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_cache_usage) == (28, 4, 0.28)


def test_missing_gauges_are_none_and_no_gauge_at_all_is_no_signal() -> None:
    only_waiting = "\n".join(
        line for line in VLLM.splitlines() if "running" not in line and "kv_" not in line
    )
    sample = parse_engine_metrics(only_waiting + "\n")
    assert sample is not None and (sample.running, sample.waiting, sample.kv_cache_usage) == (None, 37, None)
    unrelated = "\n".join(line for line in VLLM.splitlines() if "vllm:" not in line) + "\n"
    assert "python_gc" in unrelated and parse_engine_metrics(unrelated) is None
    assert parse_engine_metrics("") is None
    assert parse_engine_metrics("<html>\n{not prometheus at all\n") is None
    assert parse_engine_metrics('vllm:num_requests_waiting{engine="0" 3\n') is None


def test_metrics_url_from_a_backend_url() -> None:
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"


@pytest.fixture
def slow_sim() -> Iterator[Service]:
    """2 slots x 1 s: requests beyond two wait long enough to be seen waiting."""
    sim = spawn_simulator("--slots", "2", "--latency-ms", "1000")
    yield sim
    sim.stop()


ROW = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}


async def _load(session: aiohttp.ClientSession, url: str, n: int) -> list[asyncio.Task]:
    async def one() -> None:
        async with session.post(f"{url}/run", data=orjson.dumps(ROW)) as resp:
            await resp.read()

    return [asyncio.create_task(one()) for _ in range(n)]


@pytest.mark.alone  # counts samples in a 1.6 s window
async def test_sampler_sees_a_queue_that_stays(slow_sim: Service) -> None:
    async with aiohttp.ClientSession() as s:
        async with EngineSampler(slow_sim.url, s) as idle:
            await asyncio.sleep(1.2)
        assert idle.available and idle.latest is not None and idle.latest.waiting == 0
        assert not idle.waiting_persistent(1.0)
        work = await _load(s, slow_sim.url, 6)
        async with EngineSampler(slow_sim.url, s) as busy:
            await asyncio.sleep(1.6)
            persistent = busy.waiting_persistent(1.0)
            count = len(busy.samples)
        for task in work:
            task.cancel()
        await asyncio.gather(*work, return_exceptions=True)
    assert persistent and 3 <= count <= 5  # at most twice a second
    summary = busy.summary()
    assert summary is not None and summary["preemptions"] == 0  # the counter's growth while sampled
    assert {k: summary[k] for k in ("running_max", "waiting_max", "kv_cache_usage_max")} == {
        "running_max": 2, "waiting_max": 4, "kv_cache_usage_max": 1.0,
    }  # fmt: skip


async def _requests_to_metrics(url: str, open_s: float) -> tuple[EngineSampler, int]:
    hits = 0

    async def on_start(*_: object) -> None:
        nonlocal hits
        hits += 1

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_start)
    async with (
        aiohttp.ClientSession(trace_configs=[trace]) as s,
        EngineSampler(url, s, retry_s=30) as sampler,
    ):
        await asyncio.sleep(open_s)
    return sampler, hits


@pytest.mark.alone  # counts requests in 1.5 s, bounds the time
@pytest.mark.parametrize("fmt", ["none", "garbage", "refused"])
async def test_no_signal_is_no_error_and_asked_rarely(fmt: str) -> None:
    sim = None if fmt == "refused" else spawn_simulator("--metrics-format", fmt)
    url = sim.url if sim else f"http://127.0.0.1:{free_port()}"
    try:
        t0 = time.monotonic()
        sampler, hits = await _requests_to_metrics(url, 1.5)
    finally:
        if sim:
            sim.stop()
    assert time.monotonic() - t0 < 5
    assert hits == 1
    assert not sampler.available and sampler.latest is None and sampler.summary() is None
    assert not sampler.waiting_persistent(1.0)


async def test_sglang_over_http() -> None:
    sim = spawn_simulator("--metrics-format", "sglang", "--slots", "8")
    try:
        async with aiohttp.ClientSession() as s:
            sample = await EngineSampler(sim.url, s).sample_once()
    finally:
        sim.stop()
    assert sample is not None and (sample.running, sample.waiting, sample.kv_cache_usage) == (0, 0, 0.0)


@pytest.mark.alone  # counts samples in timed windows
async def test_a_slow_scrape_of_an_engine_with_gauges_is_a_missed_sample_not_no_signal() -> None:
    """vLLM took 1.02 s to render /metrics at 160 in flight: the sampler's 1 s timeout then called it "no
    signal" and asked again only 30 s later, so later tuning steps carried no engine reading at all."""
    slow = {"s": 0.0}

    async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        await asyncio.sleep(slow["s"])
        return aiohttp.web.Response(text=VLLM, content_type="text/plain")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", metrics)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        url = f"http://127.0.0.1:{port}/v1"
        async with aiohttp.ClientSession() as session, EngineSampler(url, session) as sampler:
            assert await sampler.has_signal()
            before = len(sampler.samples)
            slow["s"] = 1.5  # past the first scrape's 1 s bound, within a loaded engine's
            await asyncio.sleep(6.0)  # a page each 2 s: about three
            during = len(sampler.samples) - before
            slow["s"] = 0.0
            await asyncio.sleep(3.0)  # a page each 0.5 s: about six
            assert sampler.available
            assert during >= 2, "the slow engine's pages were dropped"
            assert len(sampler.samples) >= before + during + 2, "sampling paused after a slow page"
    finally:
        await runner.cleanup()
