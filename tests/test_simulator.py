"""The simulated backend over real HTTP: shapes, determinism, capacity, faults, live config."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from infra.local import Service, spawn_simulator

ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "What is 6 * 7?"}]},
    "expected_answer": "42",
}


async def post(session: aiohttp.ClientSession, url: str, body: object, rollout: int = 0) -> tuple[int, bytes]:
    headers = {"X-Rollflow-Rollout-Index": str(rollout)}
    async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, await resp.read()


@pytest.fixture
def sim_factory():
    started: list[Service] = []

    def start(*args: str) -> Service:
        sim = spawn_simulator(*args)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


async def test_shapes_and_determinism(simulator: str) -> None:
    async with aiohttp.ClientSession() as s:
        status, run_a = await post(s, f"{simulator}/run", ROW, rollout=3)
        _, run_b = await post(s, f"{simulator}/run", ROW, rollout=3)
        _, run_c = await post(s, f"{simulator}/run", ROW, rollout=4)
        assert status == 200 and run_a == run_b and run_a != run_c
        reply = orjson.loads(run_a)
        assert reply["reward"] in (0.0, 1.0) and reply["response"]["output"][0]["type"] == "message"
        _, resp = await post(s, f"{simulator}/v1/responses", ROW["responses_create_params"])
        assert orjson.loads(resp)["usage"]["output_tokens"] >= 16
        messages = [{"role": "user", "content": "What is 6 * 7?"}]
        _, chat = await post(s, f"{simulator}/v1/chat/completions", {"model": "m", "messages": messages})
        body = orjson.loads(chat)
        assert body["object"] == "chat.completion" and "\\boxed{" in body["choices"][0]["message"]["content"]
        _, verified = await post(s, f"{simulator}/verify", {**ROW, "response": reply["response"]})
        assert orjson.loads(verified)["reward"] == reply["reward"]


async def test_capacity_queues_fifo(sim_factory) -> None:
    sim = sim_factory("--slots", "4", "--latency-ms", "200")
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(post(s, f"{sim.url}/run", ROW, rollout=i) for i in range(16)))
        elapsed = time.perf_counter() - t0
        metrics = orjson.loads(await (await s.get(f"{sim.url}/metrics")).read())
    assert all(status == 200 for status, _ in results)
    assert 0.75 <= elapsed <= 1.6, elapsed
    assert metrics["max_served_seen"] == 4 and metrics["max_in_flight_seen"] == 16


async def test_max_queue_and_live_slots(sim_factory) -> None:
    sim = sim_factory("--slots", "2", "--latency-ms", "300", "--max-queue", "2")
    async with aiohttp.ClientSession() as s:
        statuses = [st for st, _ in await asyncio.gather(*(post(s, f"{sim.url}/run", ROW) for _ in range(8)))]
        assert statuses.count(503) == 4 and statuses.count(200) == 4
        async with s.post(f"{sim.url}/admin/config", data=orjson.dumps({"slots": 8, "max_queue": None})) as r:
            assert r.status == 200
        t0 = time.perf_counter()
        await asyncio.gather(*(post(s, f"{sim.url}/run", ROW) for _ in range(8)))
        assert time.perf_counter() - t0 < 0.55


@pytest.mark.parametrize("kind", ["429", "500", "503", "reset", "hang", "malformed"])
async def test_each_fault_kind(sim_factory, kind: str) -> None:
    sim = sim_factory("--fault-rate", "1", "--fault-kinds", kind, "--retry-after-s", "2", "--latency-ms", "1")
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        if kind in ("reset", "hang"):
            expected = aiohttp.ServerDisconnectedError if kind == "reset" else asyncio.TimeoutError
            with pytest.raises((expected, aiohttp.ClientConnectionError)):
                await post(s, f"{sim.url}/run", ROW)
            return
        async with s.post(f"{sim.url}/run", data=orjson.dumps(ROW)) as resp:
            body = await resp.read()
            if kind == "malformed":
                assert resp.status == 200
                with pytest.raises(orjson.JSONDecodeError):
                    orjson.loads(body)
            else:
                assert resp.status == int(kind)
                if kind == "429":
                    assert resp.headers["Retry-After"] == "2"
