"""Reverify at scale: N synthetic rollouts (default 1,000,000) rescored with exact_match and with math.

Runs the reverify core (plan, chunks, compare, publish) in this process, as the flow does but without
Prefect's per-task overhead, and prints rows/s, peak memory (this process; the verifier processes apart)
and where the time went: reading (source I/O and JSON parsing), verifying, writing (JSON and commits),
plus the plan scan, the compare pass and the publish copy.

`math` costs about a millisecond a check: pass `--math-rows` (default 50,000) to time it on fewer rows;
the figure for N is then extrapolated from the measured rate, and printed as such.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import time
from pathlib import Path

import orjson
import psutil
from cpumeter import CpuMeter
from results import save

from rollflow.settings import VerifySettings
from rollflow.settings.reverify import ReverifySpec
from rollflow.tasks.reverify.chunk import ReverifyContext, reverify_chunk
from rollflow.tasks.reverify.compare import compare_run
from rollflow.tasks.reverify.plan import plan_reverify
from rollflow.tasks.reverify.publish import publish_jsonl
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.store import Store
from rollflow.tasks.verify.pool import close_pools
from rollflow.tasks.verify.verifiers import make_verifier

WORDS = [
    "let",
    "us",
    "work",
    "through",
    "this",
    "carefully",
    "step",
    "by",
    "step",
    "first",
    "we",
    "note",
    "that",
    "the",
    "terms",
    "combine",
]


def write_source(path: Path, rows: int, repeats: int = 8) -> None:
    """A published dataset's shape: chat-style response, usage, expected answers some of which (7.0)
    only math-aware verifiers accept."""
    with path.open("wb") as fh:
        for n in range(rows):
            task, rollout = divmod(n, repeats)
            answer = 2 * task + 1
            got = answer if (n * 2654435761) % 10 < 6 else answer + 1
            text = (
                " ".join(WORDS[(n + i) % len(WORDS)] for i in range(40)) + f". The answer is \\boxed{{{got}}}"
            )
            prompt = [{"role": "user", "content": f"What is {task} + {task + 1}?"}]
            row = {
                "responses_create_params": {"input": prompt},
                "expected_answer": str(answer) if task % 2 else f"{answer}.0",
                "response": {
                    "id": f"r{n}", "object": "response", "model": "sim",
                    "output": [{"type": "message", "role": "assistant", "status": "completed",
                                "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                    "usage": {"input_tokens": 12, "output_tokens": 60, "total_tokens": 72},
                },
                "reward": float(got == answer and task % 2 == 1),
                "_ng_task_index": task,
                "_ng_rollout_index": rollout,
                "_rf": {"attempts": 1},
            }  # fmt: skip
            fh.write(orjson.dumps(row) + b"\n")


async def run(source: Path, out: Path, verifier: str, chunk_size: int, processes: int | None) -> dict:
    spec = ReverifySpec(
        source=str(source),
        output=str(out),
        verify=VerifySettings(verifier=verifier, processes=processes),
        chunk_size=chunk_size,
    )
    store = Store(str(out))
    ledger = Ledger(store)
    cpu0 = time.process_time()
    with CpuMeter(verifier_process) as kids:  # read before the pool ends its processes
        t0 = time.perf_counter()
        plan = plan_reverify(spec, store, ledger, {}, {})
        t_plan = time.perf_counter() - t0
        verify_fn = make_verifier(spec.verify)
        assert verify_fn is not None
        ctx = ReverifyContext(
            ledger, plan.source.url, plan.source.mode, {}, verify_fn, verifier, spec.parallelism
        )
        sums = {"read_s": 0.0, "verify_s": 0.0, "write_s": 0.0}
        t1 = time.perf_counter()
        for chunk in plan.pending:
            outcome = await reverify_chunk(ctx, chunk)
            for key in sums:
                sums[key] += outcome.timings.get(key, 0.0)
        t_rescore = time.perf_counter() - t1
        t2 = time.perf_counter()
        manifests = ledger.committed()
        summary = compare_run(ledger, plan.source.chunks, manifests, 1.0, plan.source.max_k)
        t_compare = time.perf_counter() - t2
        t3 = time.perf_counter()
        publish_jsonl(ledger, plan.source.chunks, manifests, spec.dataset_url(), {})
        t_publish = time.perf_counter() - t3
    close_pools()
    total = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    assert summary.complete and summary.failed == 0, summary.problems
    return {
        "rows": summary.rows,
        "changed": summary.changed,
        "rescore_rows_per_s": summary.rows / t_rescore,
        "whole_rows_per_s": summary.rows / total,
        "total_s": total,
        "plan_s": t_plan,
        "rescore_s": t_rescore,
        "compare_s": t_compare,
        "publish_s": t_publish,
        **sums,
        "cpu_s": cpu,
        "children_cpu_s": kids.seconds("verifier"),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_peak_rss_mb": kids.peak_rss_mb("verifier"),
    }


def verifier_process(proc: psutil.Process) -> str | None:
    """ "verifier" for this bench's descendants (its verifier pool's processes)."""
    return "verifier" if any(p.pid == os.getpid() for p in proc.parents()) else None


def report(name: str, fig: dict, extrapolate_to: int | None = None) -> None:
    rescore = fig["read_s"] + fig["verify_s"] + fig["write_s"]
    share = {k: fig[k] / rescore if rescore else 0.0 for k in ("read_s", "verify_s", "write_s")}
    cpu = fig["cpu_s"] + fig["children_cpu_s"]
    parts = [
        f"{name}: {fig['rows']:,} rows in {fig['total_s']:.1f} s",
        f"{fig['whole_rows_per_s']:,.0f} rows/s whole, {fig['rescore_rows_per_s']:,.0f} rows/s rescoring",
        f"plan {fig['plan_s']:.1f} s, rescore {fig['rescore_s']:.1f} s (read {share['read_s']:.0%}, verify "
        f"{share['verify_s']:.0%}, write {share['write_s']:.0%}), compare {fig['compare_s']:.1f} s, "
        f"publish {fig['publish_s']:.1f} s",
        f"peak RSS {fig['peak_rss_mb']:.0f} MB (verifier processes {fig['children_peak_rss_mb']:.0f} MB)",
        f"{fig['changed']:,} rewards changed",
        f"CPU {fig['cpu_s']:.1f} s here + {fig['children_cpu_s']:.1f} s in verifier processes = "
        f"{fig['rows'] / cpu:,.0f} rows per CPU-second",
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
    ]
    print("; ".join(parts))
    if extrapolate_to:
        print(
            f"  EXTRAPOLATED to {extrapolate_to:,} rows at the measured rate: "
            f"{extrapolate_to / fig['whole_rows_per_s']:,.0f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--math-rows", type=int, default=50_000, help="rows timed with math (then extrapolated)")
    p.add_argument("--chunk-size", type=int, default=10_000)
    p.add_argument("--processes", type=int, default=None, help="verifier processes for math (default: cores)")
    p.add_argument("--only", choices=("exact_match", "math"))
    args = p.parse_args()
    figures: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        t = time.perf_counter()
        write_source(base / "big.jsonl", args.rows)
        print(f"source: {args.rows:,} rows, {(base / 'big.jsonl').stat().st_size / 1e6:,.0f} MB, "
              f"written in {time.perf_counter() - t:.1f} s")  # fmt: skip
        if args.only in (None, "exact_match"):
            fig = asyncio.run(run(base / "big.jsonl", base / "exact", "exact_match", args.chunk_size, None))
            report("exact_match", fig)
            figures.append({"verifier": "exact_match", **fig})
        if args.only in (None, "math"):
            rows = min(args.math_rows, args.rows)
            if rows < args.rows:
                write_source(base / "math.jsonl", rows)
            src = base / "math.jsonl" if rows < args.rows else base / "big.jsonl"
            fig = asyncio.run(run(src, base / "math", "math", args.chunk_size, args.processes))
            report("math", fig, extrapolate_to=args.rows if rows < args.rows else None)
            figures.append({"verifier": "math", **fig})
    save("reverify", figures, title="Reverify: a published output scored again", params=vars(args))


if __name__ == "__main__":
    main()
