"""A bounded load on a vLLM server on loopback: N chat requests at a fixed concurrency, then a summary.

    python infra/vllm/load.py --url http://127.0.0.1:18080 --concurrency 1 16 64 --requests 200

Per concurrency level: completed and failed requests, wall time, requests/s, output tokens/s, latency
percentiles, the peaks of vllm:num_requests_running / num_requests_waiting / kv_cache_usage_perc sampled
from /metrics while it ran, and how much vllm:num_preemptions_total and the prefix-cache counters grew.
--shared-prefix-words puts the same system message before every prompt, to see prefix-cache hits. Every
level stops at --requests or --time-limit seconds, whichever comes first. Standard library and
httpx only. Only loopback URLs are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

try:
    from .stack import MODEL_NAME, parse_metrics
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stack import MODEL_NAME, parse_metrics

COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
REASON = re.compile(r'reason="([^"]*)"')
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def total(metrics: dict[str, list[tuple[str, float]]], name: str) -> float:
    return sum(v for _, v in metrics.get(name, []))


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, list[tuple[str, float]]]:
    resp = await client.get(f"{url}/metrics", timeout=10)
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def run_level(
    url: str, model: str, concurrency: int, requests: int, max_tokens: int, time_limit: float,
    prompt_words: int, seed: int | None, shared_prefix_words: int = 0,
) -> dict:  # fmt: skip
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(time_limit + 30), trust_env=False
    ) as client:
        before = await scrape(client, url)
        peaks = dict.fromkeys(GAUGES, 0.0)
        latencies: list[float] = []
        out_tokens = 0
        errors: list[str] = []
        next_id = 0
        shared = " ".join(f"rule{k % 89}" for k in range(shared_prefix_words))
        started = time.monotonic()
        deadline = started + time_limit

        async def one(i: int) -> None:
            nonlocal out_tokens
            filler = " ".join(f"word{(i * 7 + k) % 97}" for k in range(prompt_words))
            messages = [{"role": "user", "content": f"Request {i}: {filler}"}]
            if shared_prefix_words:
                messages.insert(0, {"role": "system", "content": shared})
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "ignore_eos": True,  # vLLM's extension: every reply is max_tokens long
                "temperature": 1.0,
            }
            if seed is not None:
                body["seed"] = seed + i
            t0 = time.monotonic()
            try:
                resp = await client.post(f"{url}/v1/chat/completions", json=body)
                resp.raise_for_status()
                out_tokens += resp.json()["usage"]["completion_tokens"]
                latencies.append(time.monotonic() - t0)
            except Exception as exc:  # counted and reported
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

        async def worker() -> None:
            nonlocal next_id
            while next_id < requests and time.monotonic() < deadline:
                i, next_id = next_id, next_id + 1
                await one(i)

        async def sampler() -> None:
            while True:
                with_metrics = await scrape(client, url)
                for name in GAUGES:
                    peaks[name] = max(peaks[name], total(with_metrics, name))
                for labels, value in with_metrics.get("vllm:num_requests_waiting_by_reason", []):
                    reason = REASON.search(labels)
                    key = f"vllm:num_requests_waiting_by_reason:{reason.group(1) if reason else labels}"
                    peaks[key] = max(peaks.get(key, 0.0), value)
                await asyncio.sleep(0.5)

        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), time_limit + 60)
        finally:
            sampling.cancel()
        wall = time.monotonic() - started
        after = await scrape(client, url)
    lat = sorted(latencies)
    return {
        "concurrency": concurrency,
        "completed": len(lat),
        "failed": len(errors),
        "first_errors": errors[:3],
        "wall_s": round(wall, 2),
        "req_per_s": round(len(lat) / wall, 2),
        "out_tok_per_s": round(out_tokens / wall, 1),
        "lat_p50_s": round(statistics.median(lat), 3) if lat else None,
        "lat_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None,
        "peak": {k.removeprefix("vllm:"): round(v, 4) for k, v in peaks.items()},
        "delta": {k.removeprefix("vllm:"): total(after, k) - total(before, k) for k in COUNTERS},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:18080")
    parser.add_argument("--model", default=MODEL_NAME)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=20)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per level at most")
    parser.add_argument(
        "--shared-prefix-words",
        type=int,
        default=0,
        help="words in a system message shared by every request (prefix-cache hits: blocks are 128 tokens)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed each request (seed + its index)")
    args = parser.parse_args(argv)
    host = urlparse(args.url).hostname or ""
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        parser.error("only loopback URLs")
    for level in args.concurrency:
        result = asyncio.run(
            run_level(
                args.url,
                args.model,
                level,
                args.requests,
                args.max_tokens,
                args.time_limit,
                args.prompt_words,
                args.seed,
                args.shared_prefix_words,
            )
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
