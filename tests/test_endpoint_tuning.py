"""Per-endpoint tuning: replicas of unequal capacity, each tuned to its own knee, all at once, over HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fixtures_net import free_port
from rollout_data import assert_complete, write_rows
from tuning_support import setup_run

from rollflow.infra.local import Service, spawn_simulator
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.backends.preflight import BackendUnreachable
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext, RolloutBatch, WorkItem, run_rollouts
from rollflow.tasks.publish.plot import throughput_png, tuning_markdown
from rollflow.tasks.tuning.adaptive import adaptive_control
from rollflow.tasks.tuning.diagnose import TuningError
from rollflow.tasks.tuning.per_endpoint import SharedFeed, for_each_endpoint
from rollflow.tasks.tuning.probe import ProbeFeed

# slots of each replica and the band the one-endpoint tests accept for that many slots; 100 ms per
# request, so two tunings in one process need half the client CPU that 50 ms would
REPLICAS = {8: (7, 15), 32: (29, 60)}
ADAPT_S = 12.0  # long enough for the larger replica's controller to double from 4 past its 16 slots


def _replicas(*extra: str) -> dict[int, Service]:
    sims: dict[int, Service] = {}
    try:
        for slots in REPLICAS:
            sims[slots] = spawn_simulator("--slots", str(slots), "--latency-ms", "100", *extra)
    except BaseException:
        for sim in sims.values():
            sim.stop()
        raise
    return sims


def _run_args(inp: Path, out: Path, urls: str, *extra: str) -> list[str]:
    return [
        "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", urls,
        "--chunk-size", "500", "--no-progress", *extra,
    ]  # fmt: skip


def _assert_each_at_its_knee(tuning: dict[str, Any], sims: dict[int, Service]) -> None:
    by_url = {ep["url"]: ep for ep in tuning["endpoints"]}
    assert set(by_url) == {sim.url for sim in sims.values()}
    for slots, sim in sims.items():
        lo, hi = REPLICAS[slots]
        assert lo <= by_url[sim.url]["chosen_parallelism"] <= hi, (slots, by_url[sim.url])
        assert by_url[sim.url]["stable"]
    assert tuning["limits"] == {url: ep["chosen_parallelism"] for url, ep in by_url.items()}
    assert tuning["chosen_parallelism"] == sum(tuning["limits"].values())


def _assert_concurrent(tuning: dict[str, Any]) -> None:
    """Every endpoint's tuning started before any other ended: they ran at the same time."""
    spans = [(ep["started_s"], ep["ended_s"]) for ep in tuning["endpoints"]]
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans
    assert tuning["wall_s"] < sum(e - s for s, e in spans), spans


@pytest.mark.alone  # tunes to a knee by measured rates
def test_auto_tunes_each_replica_at_its_own_knee_concurrently(run_cli, tmp_path: Path) -> None:
    """`run --parallelism auto` over two replicas: each tuned at once to its own knee, collected so."""
    sims = _replicas()
    # Both tunings draw on one input: ~860 rollouts with the engines' queue to steer by, 2,720 at most by
    # the rate rules alone (940 and 1,780 measured on these replicas); the rest is collected at 400
    # rollouts/s, so the input need not be larger than this
    rows = 4000
    try:
        inp, out = write_rows(tmp_path / "rows.jsonl", rows), tmp_path / "out"
        urls = ",".join(sim.url for sim in sims.values())
        # tuning each replica to its knee is what is checked here: no cap on the share it probes
        share = {"ROLLFLOW_TUNING__PROBE_SHARE": "1"}
        res = run_cli("run", *_run_args(inp, out, urls, "--parallelism", "auto"), env=share)
    finally:
        for sim in sims.values():
            sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    tuning = report["tuning"]
    _assert_each_at_its_knee(tuning, sims)
    _assert_concurrent(tuning)
    assert report["parallelism"] == tuning["chosen_parallelism"]
    assert {row["url"]: row["limit"] for row in report["endpoints"]} == tuning["limits"]
    served = {row["url"]: row["rollouts"] for row in report["endpoints"]}
    assert served[sims[32].url] > served[sims[8].url] > 0
    assert [d["url"] for d in report["diagnosis"]["endpoints"]] == [ep["url"] for ep in tuning["endpoints"]]
    per_endpoint = sum(ep["total_probe_rollouts"] for ep in tuning["endpoints"])
    assert tuning["total_probe_rollouts"] == per_endpoint > 0 and tuning["discarded"] == 0
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), rows, 1)
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    for sim in sims.values():
        assert f"tune-parallelism {sim.url}" in res.stderr and f"### {sim.url}" in md


@pytest.mark.alone  # controllers move within ADAPT_S
async def test_adaptive_moves_each_replica_limit_by_its_own_capacity(tmp_path: Path) -> None:
    """From equal limits, each replica's controller finds its own level: the larger replica ends higher."""
    small, large = spawn_simulator("--slots", "4", "--latency-ms", "100"), None
    try:
        large = spawn_simulator("--slots", "16", "--latency-ms", "100")
        s = setup_run(tmp_path, f"{small.url},{large.url}", rows=4000, chunk_size=1000)
        for url in (small.url, large.url):
            s.ctx.pool.set_limit(url, 4)
        feed, batch = ProbeFeed(s.ctx, s.plan), RolloutBatch()
        items = feed.take(4000)
        feed.close()
        async with adaptive_control(s.ctx) as group:
            runner = asyncio.create_task(run_rollouts(s.ctx, items, batch))
            await asyncio.wait({runner}, timeout=ADAPT_S)
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await close_loop_session()
    finally:
        small.stop()
        if large is not None:
            large.stop()
    final = s.ctx.pool.limits()
    assert final[large.url] > final[small.url], (final, group.history)
    assert final[large.url] > 4, "the larger replica's limit grew from the start"
    report = group.report()
    assert {ep["url"]: ep["final_limit"] for ep in report["endpoints"]} == final
    assert report["final_parallelism"] == sum(final.values()) == s.ctx.limit.limit
    assert {h["endpoint"] for h in report["history"]} == {small.url, large.url}


def test_adaptive_run_reports_each_endpoint(run_cli, tmp_path: Path) -> None:
    """`run --parallelism adaptive` over two replicas without engine gauges (too few rows to tune): a
    latency controller per endpoint."""
    sims = _replicas("--metrics-format", "none")
    rows = 300
    try:
        inp, out = write_rows(tmp_path / "rows.jsonl", rows), tmp_path / "out"
        urls = ",".join(sim.url for sim in sims.values())
        res = run_cli("run", *_run_args(inp, out, urls, "--parallelism", "adaptive"))
    finally:
        for sim in sims.values():
            sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert "tuning_skipped" in report
    said = " ".join((res.stdout + res.stderr).split())  # as printed, folded to the terminal's width
    assert f"tuning skipped: {report['tuning_skipped']}" in said, said[-3000:]  # said, not only in the file
    adaptive = report["adaptive"]
    final = {ep["url"]: ep["final_limit"] for ep in adaptive["endpoints"]}
    assert final == {row["url"]: row["limit"] for row in report["endpoints"]}
    assert set(final) == {sim.url for sim in sims.values()}
    assert adaptive["final_parallelism"] == sum(final.values())
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), rows, 1)


def _tuning(url: str, chosen: int, start: float, end: float) -> dict[str, Any]:
    steps = [
        {"phase": "search", "parallelism": p, "rollouts_per_s": r, "rollouts_per_s_err": 1.0,
         "latency_p50_s": 0.05, "latency_p95_s": 0.06, "errors": 0, "rollouts": 100, "utilisation": 1.0,
         "note": ""}
        for p, r in ((5, 100.0), (20, 150.0), (40, 151.0))
    ]  # fmt: skip
    return {
        "url": url, "steps": steps, "knee": chosen, "chosen_parallelism": chosen, "probe_rollouts": 300,
        "seed_rollouts": 200, "total_probe_rollouts": 500, "stop_reason": "plateau",
        "peak_rollouts_per_s": 151.0, "base_latency_s": 0.05, "stable": True, "notes": [],
        "started_s": start, "ended_s": end,
    }  # fmt: skip


def test_report_has_one_table_per_endpoint_and_the_sum() -> None:
    from rollflow.tasks.tuning.per_endpoint import Timed, combine_tunings

    parts = [_tuning("http://127.0.0.1:1", 9, 0.0, 4.0), _tuning("http://127.0.0.1:2", 33, 0.1, 6.0)]
    tuning = combine_tunings(
        [Timed(p["url"], {k: v for k, v in p.items() if k not in ("url",)}, p["started_s"], p["ended_s"])
         for p in parts]
    )  # fmt: skip
    tuning.update(adopted=1000, discarded=0)
    md = tuning_markdown(tuning)
    assert md.count("| phase | parallelism |") == 2
    for p in parts:
        assert f"### {p['url']}" in md
        assert f"| {p['url']} | {p['knee']} | {p['chosen_parallelism']} |" in md
    assert f"| **sum** | {9 + 33} | **{9 + 33}** |" in md
    assert tuning["wall_s"] == 6.0 and tuning["limits"] == {"http://127.0.0.1:1": 9, "http://127.0.0.1:2": 33}
    one = throughput_png(parts[0])
    both = throughput_png(tuning)
    assert one[:4] == both[:4] == b"\x89PNG" and one != both


async def test_a_replica_down_at_the_start_is_left_untuned(fast_sim: Service) -> None:
    """Only the reachable replicas are tuned; the one that was down starts at the smallest tuned limit."""
    from rollflow.tasks.backends.preflight import check_reachable
    from rollflow.tasks.tuning.per_endpoint import Timed, combine_endpoints, split_reachable

    down = f"http://127.0.0.1:{free_port()}"
    live, out = await split_reachable([fast_sim.url, down], lambda url: check_reachable(url, 2.0))
    assert (live, out) == ([fast_sim.url], [down])
    with pytest.raises(BackendUnreachable):
        await split_reachable([down], lambda url: check_reachable(url, 2.0))
    runs = [
        Timed(url, {"diagnosis": _diagnosis(), "tuning": _tuning(url, n, 0.0, 1.0), "chosen": n}, 0.0, 1.0)
        for url, n in (("http://127.0.0.1:1", 12), ("http://127.0.0.1:2", 40))
    ]
    chosen, found = combine_endpoints(runs, [down])
    assert found["tuning"]["limits"] == {"http://127.0.0.1:1": 12, "http://127.0.0.1:2": 40, down: 12}
    assert chosen == found["tuning"]["chosen_parallelism"] == 64
    assert found["tuning"]["unreachable"] == found["diagnosis"]["unreachable"] == [down]
    found["tuning"].update(adopted=0, discarded=0)
    assert f"| {down} | - | 12 | - | unreachable at the start" in tuning_markdown(found["tuning"])


async def test_one_endpoint_failing_to_tune_names_it_and_stops_the_others() -> None:
    from rollflow.tasks.tuning.diagnose import TuningError
    from rollflow.tasks.tuning.per_endpoint import for_each_endpoint

    cancelled: list[str] = []

    async def work(url: str) -> int:
        if url.endswith(":1"):
            await asyncio.sleep(0.01)
            raise TuningError("too few rows")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(url)
            raise
        return 0

    with pytest.raises(TuningError, match=r"Endpoint http://127\.0\.0\.1:1: too few rows"):
        await asyncio.wait_for(for_each_endpoint(["http://127.0.0.1:1", "http://127.0.0.1:2"], work), 10)
    assert cancelled == ["http://127.0.0.1:2"]


class GatedFeed(SharedFeed):
    """A SharedFeed whose input read blocks until `gate` opens: a slow read (S3, a big chunk) under way."""

    def __init__(self, ctx: CollectContext, plan: RunPlan) -> None:
        self.reading, self.gate = threading.Event(), threading.Event()
        super().__init__(ctx, plan)

    def _generate(self) -> Iterator[WorkItem]:
        self.reading.set()
        self.gate.wait(30)
        yield from super()._generate()


async def _tune_two(feed: GatedFeed, error: BaseException | None) -> None:
    """flows/tuning.py's shape: :1 reads the feed, :2 fails (or the stage is cancelled), then close."""

    async def work(url: str) -> object:
        if url.endswith(":1"):
            return await feed.next(5)
        await asyncio.to_thread(feed.reading.wait, 10)
        if error is not None:
            raise error
        return await asyncio.sleep(30)

    try:
        await for_each_endpoint(["http://127.0.0.1:1", "http://127.0.0.1:2"], work)
    finally:
        try:
            feed.close()
        finally:
            feed.gate.set()


@pytest.mark.parametrize("how", ["tuning_error", "ctrl_c"])
async def test_closing_the_feed_keeps_the_error_that_stopped_tuning(tmp_path: Path, how: str) -> None:
    """close() during a cancelled read raised "generator already executing" over the real error."""
    s = setup_run(tmp_path, "http://127.0.0.1:1", rows=20, chunk_size=10)
    feed = GatedFeed(s.ctx, s.plan)
    if how == "tuning_error":
        with pytest.raises(TuningError, match="too few rows"):
            await _tune_two(feed, TuningError("too few rows"))
    else:
        stage = asyncio.create_task(_tune_two(feed, None))
        await asyncio.to_thread(feed.reading.wait, 10)
        stage.cancel()  # what Ctrl-C does to the flow's task
        with pytest.raises(asyncio.CancelledError):
            await stage
    assert await feed.next(5) == []  # the read under way closed the input when it ended


def _diagnosis() -> dict[str, Any]:
    return {"verdict": "parallelism-bound", "next_step": "tune", "reason": "x2", "probe_rollouts": 200}
