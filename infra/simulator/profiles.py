"""Named simulator profiles (`--profile`): which capacity model, and its parameters' defaults.

The batching profiles share one decode-step cost, step_ms 1.0 + seq_step_ms 0.08 per running sequence,
and draw 16..48 output tokens (mean 32), so a lone request takes about 35 ms and the compute limit is
1000 / 0.08 / 32 = 391 rollouts/s, half of it reached at 12.5 running. steady_rate() gives, in
rollouts/s with that many requests in flight (p50 latency is about in_flight / rate):

    in flight      1     8    16    32    48    64   128
    batching      29   152   219   281   310   327   356   rising sublinearly, +16% from 32 to 64
    kv-limited    29   152   219   281   310   310   310   flat past 48 running; the rest wait
    preempting    29   152   219   281   310   280   194   best at 48, 37% below it at 128
"""

from __future__ import annotations

from dataclasses import dataclass, field

BATCHING = {
    "model": "batching",
    "step_ms": 1.0,
    "seq_step_ms": 0.08,
    "max_num_seqs": 256,
    "min_tokens": 16,
    "max_tokens": 48,
}


@dataclass(frozen=True)
class Profile:
    """A profile's one-line summary (for --help) and the SimConfig fields it sets."""

    summary: str
    settings: dict[str, object] = field(default_factory=dict)


PROFILES: dict[str, Profile] = {
    "sharp": Profile("fixed slots: service time flat until they fill, then a FIFO queue (the default)"),
    "batching": Profile(
        "continuous batching: each decode step slows as the batch grows, so throughput rises "
        "sublinearly to a compute limit (29/152/219/281/327/356 rollouts/s at 1/8/16/32/64/128 in flight)",
        BATCHING,
    ),
    "kv-limited": Profile(
        "batching with a KV cache of 4608 tokens (each request reserves its output + 64 prompt tokens, "
        "about 48 at once): throughput flattens at ~310 rollouts/s and the waiting queue grows",
        {**BATCHING, "kv_tokens": 4608},
    ),
    "paged": Profile(
        "batching with vLLM's paged KV cache of 256 blocks of 16 tokens: a request holds its 64 prompt "
        "tokens and what it decoded so far; a full cache preempts the youngest, which is recomputed "
        "(recompute 0.5): best near 48 in flight (~300 rollouts/s), ~260 with preemptions past it",
        {**BATCHING, "kv_blocks": 256, "recompute": 0.5},
    ),
    "preempting": Profile(
        "batching that preempts and recomputes past 48 running (recompute 0.5): throughput peaks at "
        "~310 rollouts/s near 48 in flight and falls to ~194 at 128",
        {**BATCHING, "preempt_after": 48, "recompute": 0.5},
    ),
}
