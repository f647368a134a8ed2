"""Prometheus text at GET /metrics the way vLLM or SGLang publish it, so engine-metrics readers are tested
against the real names, label sets, comments and neighbouring histograms rather than a tidy subset.
"""

from __future__ import annotations

_VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{model}"}} {running:.1f}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{model}"}} {waiting:.1f}
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting to be processed, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",model_name="{model}",reason="capacity"}} {waiting:.1f}
vllm:num_requests_waiting_by_reason{{engine="0",model_name="{model}",reason="deferred"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} {kv}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{model}"}} {preemptions:.1f}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{model}"}} {prefix_queries:.1f}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{model}"}} {prefix_hits:.1f}
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{model}"}} {completed:.1f}
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="0.3",model_name="{model}"}} {completed:.1f}
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="{model}"}} {completed:.1f}
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{model}"}} {completed:.1f}
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="{model}"}} {latency_sum}
{cache_info}"""

_CACHE_INFO = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",kv_cache_max_concurrency="{concurrency}",kv_cache_size_tokens="{tokens}",num_cpu_blocks="None",\
num_gpu_blocks="{blocks}"}} 1.0
"""

_SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="{model}",tp_rank="0"}} {running:.1f}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="{model}",tp_rank="0"}} {waiting:.1f}
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{model_name="{model}",tp_rank="0"}} {kv}
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{{le="0.3",model_name="{model}"}} {completed:.1f}
sglang:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="{model}"}} {completed:.1f}
sglang:e2e_request_latency_seconds_count{{model_name="{model}"}} {completed:.1f}
sglang:e2e_request_latency_seconds_sum{{model_name="{model}"}} {latency_sum}
"""

GARBAGE = "<html><body>metrics moved</body></html>\n{not prometheus at all\n"


def exposition(
    fmt: str,
    running: int,
    waiting: int,
    kv: float,
    completed: int,
    latency_s: float,
    preemptions: int = 0,
    cache: tuple[int, int, int] | None = None,
    prefix: tuple[int, int] = (0, 0),
) -> str:
    """The /metrics body for `fmt` ('vllm' or 'sglang'); `kv` is the capacity model's KV-cache use, 0..1,
    `cache` the paged cache's (blocks, block size, tokens a request may hold), as vLLM's cache_config_info,
    `prefix` the prefix cache's queried and hit tokens."""
    template = _VLLM if fmt == "vllm" else _SGLANG
    cache_info = ""
    if cache is not None:
        blocks, size, per_request = cache
        concurrency = round(blocks * size / per_request, 2)
        cache_info = _CACHE_INFO.format(
            block_size=size, tokens=blocks * size, blocks=blocks, concurrency=concurrency
        )
    return template.format(
        model="sim",
        running=running,
        waiting=waiting,
        kv=round(min(1.0, kv), 4),
        completed=completed,
        latency_sum=round(completed * latency_s, 3),
        preemptions=preemptions,
        cache_info=cache_info,
        prefix_queries=prefix[0],
        prefix_hits=prefix[1],
    )
