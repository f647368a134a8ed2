"""Client CPU of BackendClient.rollout(): 20,000 rollouts at concurrency 256 against a trivial server.

The server runs in a separate process (so its CPU is not counted); prints rollouts/s and the client
process's CPU per rollout. Budget: < 400 µs for the whole pipeline (raw aiohttp measured ~128 µs here).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

from aiohttp import web

from rollflow.infra.local import free_port, wait_http
from rollflow.settings import BackendSettings
from rollflow.tasks.backends.backends import BackendClient
from rollflow.tasks.backends.http import close_loop_session, session_for_loop

RESPONSE = (
    b'{"id":"r1","object":"response","model":"m","output":[{"type":"message","role":"assistant",'
    b'"content":[{"type":"output_text","text":"the answer is \\\\boxed{42}"}]}],'
    b'"usage":{"input_tokens":12,"output_tokens":9,"total_tokens":21}}'
)
CHAT = (
    b'{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"the answer is \\\\boxed{42}"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}'
)
AGENT = b'{"response":' + RESPONSE + b',"reward":1.0}'
ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "What is 6 x 7?"}], "temperature": 1},
    "agent_ref": {"type": "responses_api_agents", "name": "math"},
    "expected_answer": "42",
}


def serve(port: int) -> None:
    async def handler(body: bytes, request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/responses", lambda r: handler(RESPONSE, r))
    app.router.add_post("/v1/chat/completions", lambda r: handler(CHAT, r))
    app.router.add_post("/run", lambda r: handler(AGENT, r))
    app.router.add_get("/health", lambda r: handler(b"{}", r))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def drive(url: str, kind: str, n: int, concurrency: int) -> tuple[float, float]:
    settings = BackendSettings(kind=kind, url=url, model="m", timeout_s=30)
    client = BackendClient(settings, session_for_loop())
    for i in range(concurrency):  # warm the connection pool
        await client.rollout(ROW, 0, i)
    left = iter(range(n))

    async def worker() -> None:
        for i in left:
            await client.rollout(ROW, i, 0)

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await close_loop_session()
    return n / wall, cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--kind", nargs="+", default=["responses", "chat", "agent"])
    args = ap.parse_args()
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        for kind in args.kind:
            rate, cpu_us = asyncio.run(drive(url, kind, args.rollouts, args.concurrency))
            print(
                f"{kind:9s} {args.rollouts} rollouts @ {args.concurrency}: {rate:8.0f} rollouts/s, "
                f"client CPU {cpu_us:6.1f} µs/rollout"
            )
    finally:
        proc.terminate()
        proc.join(5)


if __name__ == "__main__":
    main()
