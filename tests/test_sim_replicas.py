"""The simulator as an engine: Prometheus /metrics in vLLM's and SGLang's format, and several replicas of
unequal capacity, in one process or as separate processes that can die and come back on their port."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest

from rollflow.infra.local import free_port_block, spawn_replicas, spawn_simulator, wait_http

ROW = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}], "model": "m"}}
LISTENING = re.compile(r"rollflow simulator listening on (http://\S+)")


def gauge(text: str, name: str) -> float:
    """The value of the first sample of `name` in Prometheus text (the test reads it by hand on purpose)."""
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert match, f"{name} missing from:\n{text}"
    return float(match.group(1))


async def load_and_read(url: str, requests: int, names: tuple[str, str, str]) -> list[float]:
    """Fire `requests` at once, read /metrics while they are under way, then return the gauges."""
    async with aiohttp.ClientSession() as s:
        work = [asyncio.create_task(s.post(f"{url}/run", data=orjson.dumps(ROW))) for _ in range(requests)]
        for _ in range(40):  # until every request has arrived (bounded: 2 s, within the 3 s service time)
            await asyncio.sleep(0.05)
            async with s.get(f"{url}/metrics") as resp:
                assert resp.status == 200 and resp.content_type == "text/plain"
                text = await resp.text()
            if gauge(text, names[0]) + gauge(text, names[1]) == requests:
                break
        for task in work:  # no need to wait out the service time
            task.cancel()
        await asyncio.gather(*work, return_exceptions=True)
    assert text.count("# TYPE") >= 4 and "_bucket{" in text
    return [gauge(text, name) for name in names]


@pytest.mark.alone  # gauges read within the 3 s service time
async def test_metrics_in_vllm_format_by_default() -> None:
    sim = spawn_simulator("--slots", "4", "--latency-ms", "3000")
    try:
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        running, waiting, kv = await load_and_read(sim.url, 10, names)
    finally:
        sim.stop()
    assert (running, waiting, kv) == (4, 6, 1.0)


@pytest.mark.alone  # gauges read within the 3 s service time
async def test_metrics_in_sglang_format() -> None:
    sim = spawn_simulator("--slots", "8", "--latency-ms", "3000", "--metrics-format", "sglang")
    try:
        names = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")
        running, waiting, usage = await load_and_read(sim.url, 2, names)
    finally:
        sim.stop()
    assert (running, waiting, usage) == (2, 0, 0.25)


@pytest.mark.parametrize(("fmt", "status"), [("none", 404), ("garbage", 200)])
async def test_metrics_absent_or_garbage(fmt: str, status: int) -> None:
    sim = spawn_simulator("--metrics-format", fmt)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{sim.url}/metrics") as resp:
            assert resp.status == status
            assert "vllm:" not in await resp.text()
            async with s.get(f"{sim.url}/stats") as stats:
                assert (await stats.json())["slots"] == 64
    finally:
        sim.stop()


async def timed_batch(url: str, n: int) -> float:
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        for response in await asyncio.gather(
            *(s.post(f"{url}/run", data=orjson.dumps(ROW)) for _ in range(n))
        ):
            assert response.status == 200
            response.release()
        return time.perf_counter() - t0


@pytest.mark.alone  # times batches
async def test_replicas_in_one_process_on_consecutive_ports() -> None:
    port = free_port_block(2)  # the replica takes the next port: both must be free
    cmd = [sys.executable, "-m", "rollflow.infra.simulator", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--replica", "2x200", "--replica", "8x200"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        urls = [LISTENING.search(proc.stdout.readline()).group(1) for _ in range(2)]  # type: ignore[union-attr]
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        small, big = await asyncio.gather(timed_batch(urls[0], 8), timed_batch(urls[1], 8))
    finally:
        proc.terminate()
        proc.wait(10)
    assert small > 0.7 and big < 0.4, (small, big)  # 4 waves of 200 ms against one


def test_a_bad_replica_flag_is_a_clear_error() -> None:
    cmd = [sys.executable, "-m", "rollflow.infra.simulator", "--replica", "16by100"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SLOTSxLATENCY_MS such as 16x100" in done.stderr


@pytest.mark.alone  # times batches
async def test_spawned_replicas_die_and_come_back_on_their_port() -> None:
    replicas = spawn_replicas([(2, 200), (8, 200)])
    try:
        small, big = await asyncio.gather(*(timed_batch(r.url, 8) for r in replicas))
        assert small > 0.7 and big < 0.4, (small, big)
        first = replicas[0]
        url = first.url
        first.kill()
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectionError):
                await s.get(f"{url}/health")
        first.restart()
        assert first.url == url
        wait_http(f"{url}/health", 5)
        assert await timed_batch(url, 2) < 0.4
    finally:
        for replica in replicas:
            replica.stop()
