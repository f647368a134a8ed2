"""The simulated backend over real HTTP: shapes, determinism, capacity, faults, live config."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import aiohttp
import orjson
import pytest

from rollflow.infra.local import Service, spawn_simulator
from rollflow.infra.simulator import SimConfig, start_simulator

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]
ROW = {"responses_create_params": {"input": MESSAGES, "model": "m"}, "expected_answer": "42"}

Post = tuple[int, bytes]


async def post(session: aiohttp.ClientSession, url: str, body: object, rollout: int = 0) -> Post:
    headers = {"X-Rollflow-Rollout-Index": str(rollout)}
    async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, await resp.read()


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as resp:
        assert resp.status == 200
        return orjson.loads(await resp.read())


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., str]]:
    """Start simulators with custom flags for one test; all stopped at its end."""
    started: list[Service] = []

    def start(*args: str) -> str:
        started.append(spawn_simulator(*args))
        return started[-1].url

    yield start
    for sim in started:
        sim.stop()


async def test_reply_shapes(simulator: str) -> None:
    async with aiohttp.ClientSession() as s:
        assert await get_json(s, f"{simulator}/health") == {"status": "ok"}
        status, raw = await post(s, f"{simulator}/run", ROW)
        assert status == 200
        run = orjson.loads(raw)
        assert run["responses_create_params"] == ROW["responses_create_params"]
        assert run["reward"] in (0.0, 1.0)
        response = run["response"]
        assert response["object"] == "response" and response["status"] == "completed"
        assert response["id"].startswith("resp_") and response["model"] == "m"
        message = response["output"][0]
        assert message["type"] == "message" and message["role"] == "assistant"
        assert message["id"].startswith("msg_") and message["status"] == "completed"
        part = message["content"][0]
        assert part["type"] == "output_text" and part["annotations"] == []
        usage = response["usage"]
        assert 16 <= usage["output_tokens"] <= 256
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        boxed = "\\boxed{42}"
        assert (run["reward"] == 1.0) == part["text"].endswith(boxed)

        status, raw = await post(s, f"{simulator}/v1/responses", ROW["responses_create_params"])
        assert status == 200 and orjson.loads(raw)["output"][0]["content"][0]["type"] == "output_text"

        status, raw = await post(s, f"{simulator}/v1/chat/completions", {"model": "m", "messages": MESSAGES})
        chat = orjson.loads(raw)
        assert status == 200 and chat["object"] == "chat.completion"
        choice = chat["choices"][0]
        assert choice["finish_reason"] == "stop" and "\\boxed{" in choice["message"]["content"]
        u = chat["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]

        _, raw = await post(s, f"{simulator}/verify", {**ROW, "response": response})
        assert orjson.loads(raw) == {"reward": run["reward"]}
        plain = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "so\n42"}]}]}
        _, raw = await post(s, f"{simulator}/verify", {**ROW, "response": plain})
        assert orjson.loads(raw) == {"reward": 1.0}

        status, _ = await post(s, f"{simulator}/run", {"no": "params"})
        assert status == 400
        async with s.post(f"{simulator}/run", data=b"{not json") as resp:
            assert resp.status == 400


async def test_determinism(simulator: str) -> None:
    chat_body = {"model": "m", "messages": MESSAGES}
    async with aiohttp.ClientSession() as s:
        for path, body in (
            ("/run", ROW),
            ("/v1/responses", ROW["responses_create_params"]),
            ("/v1/chat/completions", chat_body),
        ):
            a = await post(s, f"{simulator}{path}", body, rollout=3)
            b = await post(s, f"{simulator}{path}", body, rollout=3)
            c = await post(s, f"{simulator}{path}", body, rollout=4)
            assert a == b, path
            assert a[1] != c[1], path
        # Across rollouts of one prompt, the share of correct answers follows --correct-rate (0.7).
        rewards = [
            orjson.loads((await post(s, f"{simulator}/run", ROW, rollout=i))[1])["reward"] for i in range(200)
        ]
        assert 0.55 <= sum(rewards) / len(rewards) <= 0.85
        # metadata.expected_answer steers responses/chat answers the same way.
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"expected_answer": "x"},
        }
        texts = [
            orjson.loads((await post(s, f"{simulator}/v1/chat/completions", body, rollout=i))[1])["choices"][
                0
            ]
            for i in range(50)
        ]
        assert 20 <= sum(t["message"]["content"].endswith("\\boxed{x}") for t in texts) <= 48


async def test_a_second_process_gives_identical_bytes(simulator: str, sim_factory) -> None:
    other = sim_factory("--latency-ms", "0")
    async with aiohttp.ClientSession() as s:
        for rollout in range(3):
            assert await post(s, f"{simulator}/run", ROW, rollout) == await post(
                s, f"{other}/run", ROW, rollout
            )


@pytest.mark.alone  # asserts 0.7-1.6 s
async def test_capacity_queues_and_counts(sim_factory) -> None:
    url = sim_factory("--slots", "4", "--latency-ms", "200")
    seen_in_flight: list[int] = []
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        work = asyncio.gather(*(post(s, f"{url}/run", ROW, rollout=i) for i in range(16)))
        while not work.done():
            seen_in_flight.append((await get_json(s, f"{url}/stats"))["in_flight"])
            await asyncio.sleep(0.02)
        results = await work
        elapsed = time.perf_counter() - t0
        metrics = await get_json(s, f"{url}/stats")
        async with s.post(f"{url}/stats/reset") as resp:
            assert resp.status == 200
        reset = await get_json(s, f"{url}/stats")
    assert all(status == 200 for status, _ in results)
    assert 0.7 <= elapsed <= 1.6, elapsed
    assert max(seen_in_flight) <= 4 and metrics["max_served_seen"] == 4
    assert metrics["max_in_flight_seen"] == 16
    assert metrics["completed"] == 16 and metrics["endpoints"]["run"] == 16
    assert reset["requests"] == 0 and reset["max_in_flight_seen"] == 0 and reset["endpoints"] == {}


@pytest.mark.alone  # arrival order set by 10 ms sleeps
async def test_fifo_order(sim_factory) -> None:
    url = sim_factory("--slots", "1", "--latency-ms", "60")
    done: list[int] = []
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            await post(s, f"{url}/run", ROW, rollout=i)
            done.append(i)

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.01)  # arrival order 0..5, all while request 0 holds the only slot
        await asyncio.gather(*tasks)
    assert done == list(range(6))


@pytest.mark.alone  # asserts < 0.55 s
async def test_max_queue_and_live_slots(sim_factory) -> None:
    url = sim_factory("--slots", "2", "--latency-ms", "300", "--max-queue", "2")
    async with aiohttp.ClientSession() as s:
        statuses = [st for st, _ in await asyncio.gather(*(post(s, f"{url}/run", ROW) for _ in range(8)))]
        assert statuses.count(503) == 4 and statuses.count(200) == 4
        assert (await get_json(s, f"{url}/stats"))["faults"]["queue_full"] == 4
        status, raw = await post(s, f"{url}/admin/config", {"slots": 0})
        assert status == 400 and b"slots" in raw
        status, raw = await post(s, f"{url}/admin/config", {"seed": 3})
        assert status == 400
        status, raw = await post(s, f"{url}/admin/config", {"slots": 8, "max_queue": None})
        assert status == 200 and orjson.loads(raw)["slots"] == 8
        t0 = time.perf_counter()
        await asyncio.gather(*(post(s, f"{url}/run", ROW) for _ in range(8)))
        assert time.perf_counter() - t0 < 0.55


@pytest.mark.alone  # a 0.5 s client timeout, the hang within 1.5 s
@pytest.mark.parametrize("kind", ["429", "500", "503", "reset", "hang", "malformed"])
async def test_each_fault_kind(sim_factory, kind: str) -> None:
    url = sim_factory("--fault-rate", "1", "--fault-kinds", kind, "--retry-after-s", "2", "--latency-ms", "1")
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        if kind == "reset":
            with pytest.raises(aiohttp.ClientConnectionError):
                await post(s, f"{url}/run", ROW)
        elif kind == "hang":
            t0 = time.perf_counter()
            with pytest.raises(asyncio.TimeoutError):
                await post(s, f"{url}/run", ROW)
            assert time.perf_counter() - t0 < 1.5
        else:
            async with s.post(f"{url}/run", data=orjson.dumps(ROW)) as resp:
                body = await resp.read()
                if kind == "malformed":
                    assert resp.status == 200
                    with pytest.raises(orjson.JSONDecodeError):
                        orjson.loads(body)
                else:
                    assert resp.status == int(kind)
                    if kind == "429":
                        assert resp.headers["Retry-After"] == "2"
        metrics = await get_json(s, f"{url}/stats")
    assert metrics["faults"] == {kind: 1}


@pytest.mark.alone  # asserts < 0.5 s
async def test_hung_requests_hold_no_slot(sim_factory) -> None:
    url = sim_factory("--slots", "1", "--latency-ms", "1", "--fault-rate", "1", "--fault-kinds", "hang")
    async with aiohttp.ClientSession() as s:
        hung = [asyncio.create_task(post(s, f"{url}/run", ROW)) for _ in range(3)]
        await asyncio.sleep(0.2)
        status, _ = await post(s, f"{url}/admin/config", {"fault_rate": 0})
        assert status == 200
        t0 = time.perf_counter()
        status, _ = await asyncio.wait_for(post(s, f"{url}/run", ROW), 2)
        assert status == 200 and time.perf_counter() - t0 < 0.5
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)


async def test_in_process_starter() -> None:
    sim = await start_simulator(SimConfig(slots=2, latency_ms=0))
    try:
        assert sim.url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as s:
            status, raw = await post(s, f"{sim.url}/run", ROW)
            assert status == 200 and "reward" in orjson.loads(raw)
    finally:
        await sim.close()


def test_sigterm_exits_cleanly_and_bad_flags_refused() -> None:
    sim = spawn_simulator("--latency-ms", "0")
    sim.stop()
    assert sim.proc.returncode == 0
    with pytest.raises(RuntimeError, match="exited with 2"):
        spawn_simulator("--slots", "0")
