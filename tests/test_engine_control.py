"""The engine-aware controller: its rules, and runs over the simulator's paged KV cache whose capacity
changes under it (the limit follows within a stated bound, nothing is lost, no preemption storm)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from rollout_data import assert_complete, write_rows
from tuning_support import configure_sim, setup_run, sim_metrics

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.endpoints import EndpointPool
from rollflow.tasks.backends.engine_metrics import EngineSample, parse_engine_metrics, sample_endpoints
from rollflow.tasks.backends.http import auth_headers, close_loop_session
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.collect.chunk import collect_chunk
from rollflow.tasks.tuning.engine_control import (
    EngineOptions,
    EngineState,
    Reading,
    decide,
    engine_control,
    footprint,
    reading,
    start_limit,
)

OPTS = EngineOptions()


def r(running: float, waiting: float, kv: float, in_flight: int, preempted: int = 0) -> Reading:
    """One interval in which as many requests ended as were in flight (a turnover), its one sample a batch."""
    share = kv / running if running else None
    return Reading(1, running, waiting, kv, preempted, in_flight, ended=in_flight, kv_share=share)


def twice(state: EngineState, reading: Reading) -> tuple[int, str]:
    """Growth needs room in two intervals in a row: the first holds."""
    limit, why = decide(state, reading, OPTS)
    assert limit == state.limit and why == "room in the engine: grow if it stays", why
    return decide(state, reading, OPTS)


def test_preemptions_cut_and_set_a_ceiling_growth_respects_until_calm() -> None:
    state = EngineState(limit=64)
    limit, why = decide(state, r(60, 4, 1.0, 64, preempted=12), OPTS)
    assert limit == 48 and "12 preemptions" in why and state.ceiling == 48  # 0.8 of the 60 that ran
    for _ in range(OPTS.calm_intervals - 1):  # room in the engine, but below the ceiling's calm spell
        limit, why = decide(state, r(48, 0, 0.5, 48), OPTS)
        assert limit == 48, why
    limit, why = decide(state, r(48, 0, 0.5, 48), OPTS)  # the 20th calm interval, the 2nd with room
    assert limit == 53 and "probe up to 53" in why  # after the calm spell: a careful step above


def test_a_queue_beyond_a_small_share_gives_back_the_excess() -> None:
    state = EngineState(limit=160)
    limit, why = decide(state, r(128, 32, 0.1, 160), OPTS)
    assert limit == 140 and "full" in why  # gives back 32 - 12.8 (10% of running stays waiting)
    assert decide(state, r(128, 12, 0.1, limit), OPTS)[0] == limit  # at the knee: holds


def test_growth_doubles_far_from_limits_and_stops_at_the_kv_projection() -> None:
    state = EngineState(limit=8)
    assert twice(state, r(8, 0, 0.05, 8))[0] == 16
    state = EngineState(limit=40)
    limit, why = twice(state, r(40, 0, 0.5, 40))
    assert limit == 50 and "grow" in why  # x1.25; the projection (40 * 0.9 / 0.5 = 72) is higher
    state = EngineState(limit=40)
    limit, why = twice(state, r(40, 0, 0.7, 40))
    assert limit == 50 and "KV" not in why  # x1.25 = 50 < 40 * 0.9 / 0.7 = 51
    state = EngineState(limit=40)
    limit, why = twice(state, r(40, 0, 0.74, 40))
    assert limit == 48 and "what the KV cache holds" in why  # the projection: 40 * 0.9 / 0.74 = 48.6
    state = EngineState(limit=40)
    assert decide(state, r(40, 0, 0.8, 40), OPTS)[0] == 40  # in the band: holds
    assert decide(state, r(40, 0, 0.2, 40), OPTS)[0] == 40  # room once, after a hold: not yet
    assert decide(state, r(40, 0, 0.92, 40), OPTS)[0] == 36  # above kv_high: trims


def test_growth_from_below_a_knee_stops_at_it_until_the_engine_runs_more() -> None:
    """A queue formed at 12 running (another tenant took the engine): the limit, cut to 11, climbs back to
    12 plus the small queue, not to 22 and back; once the engine runs more than 12, x2 again."""
    state = EngineState(limit=40)
    full = Reading(1, 12.0, 28.0, 0.1, 0, 40, running_peak=12.0)
    assert decide(state, full, OPTS) == (14, "28 waiting for capacity at 12 running: full")
    state.limit = 11
    limit, why = twice(state, Reading(1, 11.0, 0.0, 0.1, 0, 11, running_peak=11.0, ended=11))
    assert limit == 14 and "knee" in why, why  # 12 + OPTS.min_queue, not 22
    limit, why = twice(state, Reading(1, 14.0, 0.0, 0.1, 0, 14, running_peak=14.0, ended=14))
    assert limit == 28, why  # it ran 14, more than the knee: its capacity came back


def test_growth_stops_at_the_requests_the_kv_cache_holds_at_their_finished_size() -> None:
    """vLLM states 8 requests of full length (16,384 tokens). Before one has finished, the limit stays at
    8, however empty the cache looks (each request's use grows as it writes); then it grows to the
    requests of the size finished ones held: 11 of 1,280 tokens at 90%, 115 of one 128-token block."""

    def room(footprint: float | None) -> Reading:
        return Reading(1, 8.0, 0.0, 0.1, 0, 8, running_peak=8.0, footprint=footprint, cache_tokens=16384,
                       stated=8.0, ended=8)  # fmt: skip

    state = EngineState(limit=8)
    limit, why = twice(state, room(None))
    assert limit == 8 and "none has ended yet" in why, why
    assert twice(state, room(1280.0))[0] == 11
    state = EngineState(limit=8)
    assert twice(state, room(128.0))[0] == 16  # x2: far below the 115 it holds
    # an engine that does not count finished requests (no cache_tokens) grows as before
    assert twice(EngineState(limit=8), r(8, 0, 0.1, 8))[0] == 16


def test_growth_waits_for_a_turnover_and_is_judged_by_its_peak_kv_use() -> None:
    """8 long replies began together; 2 ended early (short ones end first). The cache looks nearly empty
    while they are young, but the limit grows only once 8 have ended since it last moved, and then by
    the cache's peak use over that turnover (60% at 8 running: 8 * 0.9 / 0.6 = 12; x1.25 = 10), not x2
    to 16, which would overflow it once all of them write at once."""
    state = EngineState(limit=8)

    def room(kv: float, ended: int) -> Reading:
        return Reading(1, 8.0, 0.0, kv, 0, 8, running_peak=8.0, ended=ended, kv_share=kv / 8)

    assert decide(state, room(0.05, 2), OPTS)[0] == 8
    limit, why = decide(state, room(0.1, 0), OPTS)
    assert limit == 8 and "turn over (2 of 8 ended" in why, why
    assert decide(state, room(0.6, 0), OPTS)[0] == 8
    assert decide(state, Reading(0, None, None, None, 0, 8, ended=1), OPTS)[0] == 8  # no sample: still ended
    limit, why = decide(state, room(0.1, 5), OPTS)  # the long ones end: the turnover is whole
    assert limit == 10 and "grow" in why, why
    assert state.ended == 0 and state.kv_peak is None  # the next turnover is one at 10
    # the share is read with the requests running in its own sample: a wave that ended within the interval
    # (8 running at 60%, then 2 at 10%) is 8 at 7.5% each, not 60% over its median of 2 running
    wave = [EngineSample(8, 0, 0.6, 0.0), EngineSample(2, 0, 0.1, 0.5), EngineSample(2, 0, 0.1, 1.0)]
    got = reading(wave, None, 8, ended=6)
    assert (got.kv, got.kv_share, got.running, got.ended) == (0.6, 0.075, 2, 6)


def test_growth_is_judged_by_the_most_one_request_held_not_by_the_fullest_sample() -> None:
    """9 requests of random length: the fullest sample (67% at 9 running) projects 12 at 90%, but another
    showed 8 running at 64% (8% each): 12 of those would overflow the cache, so it grows to 11 at most.
    A sample of few running (2 of 9 in flight, a long one left) is no batch and is not judged."""
    samples = [EngineSample(9, 0, 0.667, 0.0), EngineSample(8, 0, 0.64, 0.5), EngineSample(2, 0, 0.3, 0.9)]
    got = reading(samples, None, 9, ended=9)
    assert got.kv == 0.667 and got.kv_share == 0.08
    state = EngineState(limit=9)
    state.room = OPTS.room_intervals - 1
    limit, why = decide(state, got, OPTS)
    assert limit == 11 and "by its peak use" in why, why  # floor(0.9 / 0.08); 9 * 0.9 / 0.667 = 12.1
    # an interval with no batch (2 of 9 running, long ones left) still bounds growth, cautiously: 0.3
    # over 2 is 15% each, 6 at 90%, so the limit holds rather than growing unbounded
    state = EngineState(limit=9)
    state.turn(reading([EngineSample(2, 0, 0.3, 0.0), EngineSample(2, 0, 0.3, 0.5)], None, 9))
    state.room = OPTS.room_intervals - 1
    batch = [EngineSample(9, 0, 0.5, 0.0), EngineSample(9, 0, 0.5, 0.5)]
    limit, why = decide(state, reading(batch, None, 9, ended=9), OPTS)
    assert limit == 9 and "held" in why and "by its peak use" in why, why


def test_growth_is_bounded_by_the_cache_when_the_engine_runs_under_half_of_those_in_flight() -> None:
    """20 in flight, 9 running at 3% of the cache each (its API server holds the rest): no sample is a
    batch, yet growth stops at what the cache holds at 90% (30), not x2 to 40."""
    samples = [EngineSample(9, 0, 0.27, 0.0), EngineSample(9, 0, 0.27, 0.5)]
    state = EngineState(limit=20)
    state.room = OPTS.room_intervals - 1
    limit, why = decide(state, reading(samples, None, 20, ended=20, left=0), OPTS)
    assert limit == 30 and "by its peak use" in why, why


def test_growth_waits_until_the_requests_in_flight_at_the_last_move_have_ended() -> None:
    """Short replies end and are replaced many times while the long ones still write: ends alone (16 of
    a limit of 8) are no turnover while 4 requests in flight when the limit was set still run."""
    state = EngineState(limit=8)

    def room(kv: float, left: int) -> Reading:
        return Reading(1, 8.0, 0.0, kv, 0, 8, running_peak=8.0, ended=8, left=left, kv_share=kv / 8)

    assert decide(state, room(0.05, 4), OPTS)[0] == 8
    limit, why = decide(state, room(0.08, 4), OPTS)
    assert limit == 8 and "4 of them still running" in why, why
    limit, why = decide(state, room(0.1, 0), OPTS)  # the long ones ended: judged by the peak, 10%
    assert limit == 16 and "grow" in why, why


def test_a_turnover_counts_down_the_requests_in_flight_when_the_limit_was_set() -> None:
    """The endpoint counts down the attempts in flight at a mark (every move of the limit, by whichever
    rule, marks it): one begun after the mark is not one of them; a cancelled one has ended too."""
    pool = EndpointPool(["http://e"], {"http://e": 64}, ConcurrencyLimit(64))
    ep = pool.endpoint("http://e")
    for _ in range(3):
        pool.begin(ep)
    ep.mark()
    assert ep.left == 3
    started = ep.marked_at - 1.0
    pool.end(ep, started=ep.marked_at + 1.0)  # began after the mark: not one of the turnover
    assert ep.left == 3
    pool.end(ep, started=started)
    pool.end(ep, abandoned=True, started=started)  # cancelled: it ended too
    assert ep.left == 1


def test_trims_and_cuts_do_not_compound_while_the_excess_drains() -> None:
    """While the requests of a cut drain, the cache stays full and preemptions go on: the limit is cut
    from what ran, once, not again every interval."""
    state = EngineState(limit=40)
    limits = [decide(state, r(38, 0, 0.99, 40, preempted=2), OPTS)[0] for _ in range(4)]
    assert limits == [30, 30, 30, 30], limits  # 0.8 of the 38 that ran
    state = EngineState(limit=40)
    full = Reading(1, 40.0, 0.0, 0.92, 0, 40, running_peak=40.0, ended=2, left=30)
    limits = [decide(state, full, OPTS)[0] for _ in range(3)]
    assert limits == [36, 36, 36], limits  # the 40 in flight before the trim still run: one trim
    assert decide(state, Reading(1, 36.0, 0.0, 0.92, 0, 36, ended=30, left=0), OPTS)[0] == 32  # full at 36
    state = EngineState(limit=1)
    assert decide(state, r(1, 0, 0.95, 1), OPTS)[0] == 1 and state.ceiling == 1
    # after a growth, a cache that fills is trimmed though requests from before the growth still run
    state = EngineState(limit=32)
    state.down = False
    limit, why = decide(state, Reading(1, 36.0, 0.0, 0.97, 0, 36, running_peak=36.0, ended=2, left=20), OPTS)
    assert limit == 28 and "trim" in why, why


def test_a_ceiling_is_lifted_by_the_turnovers_peak_not_one_quiet_interval() -> None:
    state = EngineState(limit=64)
    assert decide(state, r(60, 0, 0.95, 64, preempted=5), OPTS)[0] == 48
    for _ in range(OPTS.calm_intervals - 1):
        decide(state, Reading(1, 48.0, 0.0, 0.7, 0, 48, running_peak=48.0, ended=3), OPTS)
    limit, why = decide(state, Reading(1, 48.0, 0.0, 0.2, 0, 48, running_peak=48.0, ended=60), OPTS)
    assert "the ceiling is lifted" not in why and state.ceiling is not None, why  # the peak was 70%
    assert limit <= 53, (limit, why)


def test_the_footprint_is_counted_since_the_run_began_in_whole_blocks() -> None:
    def at(finished: int, tokens: int) -> EngineSample:
        return EngineSample(8, 0, 0.1, 0.0, finished=finished, finished_tokens=tokens, kv_block_tokens=128)

    assert footprint(at(100, 5000), at(100, 5000)) is None  # none finished in the run
    assert footprint(at(100, 5000), at(108, 5000 + 8 * 1230)) == 1280.0  # 1,230 tokens: ten blocks
    assert footprint(None, at(8, 100)) is None


def test_draining_and_client_bound_intervals_hold() -> None:
    state = EngineState(limit=20)
    assert "draining" in decide(state, r(30, 30, 0.1, 40), OPTS)[1]
    assert "the run, not the engine" in decide(state, r(5, 0, 0.05, 5), OPTS)[1]
    state.held_at_growth = 0.05  # at the last growth nearly all of it reached the engine; now 30% waits
    assert "its API server or the network holds more" in decide(state, r(14, 0, 0.05, 20), OPTS)[1]
    assert decide(state, Reading(0, None, None, None, 0, 20), OPTS)[0] == 20


def test_a_steady_share_held_before_the_engine_does_not_stop_growth() -> None:
    """A CPU-bound API server holds a steady third of what is in flight (time each request spends there):
    the limit keeps growing while the engine has room; once growth makes the held share rise, it holds."""
    state, limit = EngineState(limit=16), 16
    for _ in range(8):  # a third held at every level: x2 per two intervals of room
        limit = decide(state, r(limit * 2 / 3, 0, 0.1, limit), OPTS)[0]
    assert limit >= 64, (limit, state)
    held_before = state.held_at_growth
    limit2, why = decide(state, r(limit * 0.3, 0, 0.1, limit), OPTS)  # now 70% wait before the engine
    assert limit2 == limit and "holds more of them since the limit last grew" in why, (why, held_before)


def test_the_preemption_counter_counts_growth_only() -> None:
    def s(p: int) -> EngineSample:
        return EngineSample(1, 0, 0.5, 0.0, preemptions=p)

    assert reading([s(5), s(9)], s(3), 4).preempted == 6
    assert reading([s(2)], s(90), 4).preempted == 0  # a restarted engine counts from 0 again


def test_vllm_cache_config_info_gives_the_start() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3.0\n'
        '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="128",num_gpu_blocks="8192",'
        'kv_cache_size_tokens="1048576",kv_cache_max_concurrency="512.0",num_cpu_blocks="None"} 1.0\n'
    )
    sample = parse_engine_metrics(text)
    assert sample is not None and sample.kv_capacity_tokens == 1048576 and sample.kv_max_concurrency == 512
    assert start_limit(sample, 5, OPTS)[0] == 512
    assert start_limit(parse_engine_metrics(text.split("# TYPE vllm:cache")[0]), 5, OPTS)[0] == 5


async def _controlled_run(
    tmp_path: Path, urls: list[str], rows: int, during: Any, options: EngineOptions | None = None
) -> tuple[Any, list[Any]]:
    """Collect every chunk with each endpoint's limit under engine control while `during(group)` runs."""
    s = setup_run(tmp_path, ",".join(urls), rows=rows, chunk_size=250)
    try:
        async with (
            sample_endpoints(s.ctx.pool, auth_headers(s.ctx.backend)) as samplers,
            engine_control(s.ctx.pool, samplers, options) as group,
        ):
            watcher = asyncio.create_task(during(group))
            outcomes = await asyncio.gather(*(collect_chunk(s.ctx, c) for c in s.plan.scan.chunks))
            await watcher
    finally:
        await close_loop_session()
    return group, outcomes


async def _change_after(delay_s: float, url: str, **settings: Any) -> float:
    """Change the simulator's live settings `delay_s` from now; when it took effect (epoch seconds, the
    clock of the controller's `at`)."""
    await asyncio.sleep(delay_s)
    await configure_sim(url, **settings)
    return time.time()


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_the_limit_follows_a_capacity_change_and_loses_nothing(tmp_path: Path) -> None:
    """Another tenant takes most of the engine (max_num_seqs 256 -> 12) and leaves: within 4 intervals the
    limit is at most 12 + the small queue it keeps; within 6 after the engine is back it is above 24."""
    sim = spawn_simulator("--profile", "paged", "--seed", "3")
    marks: dict[str, float] = {}

    async def tenant(group: Any) -> None:
        marks["taken"] = await _change_after(3, sim.url, max_num_seqs=12)
        marks["back"] = await _change_after(6, sim.url, max_num_seqs=256)

    try:
        group, outcomes = await _controlled_run(tmp_path, [sim.url], 5000, tenant)
        stats = await sim_metrics(sim.url)
    finally:
        sim.stop()
    history = next(iter(group.controllers.values())).history
    shown = [(h["t_s"], h["limit"], h["why"]) for h in history]
    assert sum(o.manifest.rows for o in outcomes) == 5000 and sum(o.manifest.failed for o in outcomes) == 0
    assert history[0]["limit"] >= 30, shown  # started from the engine's stated capacity, not from 5
    taken = [h for h in history if marks["taken"] < h["at"] < marks["back"]]
    assert min(h["limit"] for h in taken[:4]) <= 12 + OPTS.min_queue + 1, shown
    assert max(h["limit"] for h in taken[4:]) <= 12 + OPTS.min_queue + 1, shown  # and stays there
    back = [h["limit"] for h in history if h["at"] > marks["back"]]
    assert max(back[:6]) > 24, shown
    assert stats["preemptions"] <= 0.01 * stats["requests"], stats


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_a_cache_too_small_for_the_limit_brings_no_preemption_storm(tmp_path: Path) -> None:
    """The cache shrinks to a quarter mid-run: a few preemptions, the limit cut below what the cache holds,
    then none; a fixed limit at the old level on the same cache preempts over and over."""
    sim = spawn_simulator("--profile", "paged", "--seed", "4")
    marks: dict[str, float] = {}

    async def shrink(group: Any) -> None:
        marks["shrunk"] = await _change_after(2, sim.url, kv_blocks=64)
        marks["preempted_at_shrink"] = (await sim_metrics(sim.url))["preemptions"]

    try:
        group, outcomes = await _controlled_run(tmp_path, [sim.url], 3000, shrink)
        controlled = await sim_metrics(sim.url)
        history = next(iter(group.controllers.values())).history
        await configure_sim(sim.url, kv_blocks=64)
        fixed = await _fixed_preemptions(sim.url, history[0]["limit"], controlled["completed"])
    finally:
        sim.stop()
    shown = [(h["t_s"], h["limit"], h.get("preempted"), h["why"]) for h in history]
    assert sum(o.manifest.rows for o in outcomes) == 3000 and sum(o.manifest.failed for o in outcomes) == 0
    after = [h for h in history if h["at"] > marks["shrunk"]]
    assert after and max(h["limit"] for h in after[3:]) <= 12, shown  # the small cache holds about 9
    late = sum(h.get("preempted") or 0 for h in after[5:])
    assert late <= 2, shown  # no storm: preemption stops once the limit is cut
    # the same cache at the starting limit, held: a storm of at least one preemption per 10 requests
    assert fixed >= 0.1 * controlled["completed"], (fixed, controlled)


async def _fixed_preemptions(url: str, limit: int, requests: int) -> int:
    """Preemptions `requests` chat requests at a fixed `limit` in flight cause on the simulator now."""
    import aiohttp

    before = (await sim_metrics(url))["preemptions"]
    gate = asyncio.Semaphore(limit)
    body = {"model": "sim", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}

    async def one(session: aiohttp.ClientSession) -> None:
        async with gate, session.post(f"{url}/v1/chat/completions", json=body) as resp:
            await resp.read()

    async with aiohttp.ClientSession() as session:
        await asyncio.wait_for(asyncio.gather(*(one(session) for _ in range(requests))), 120)
    return (await sim_metrics(url))["preemptions"] - before


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_replicas_of_unequal_kv_capacity_get_their_own_limits(tmp_path: Path) -> None:
    big = spawn_simulator("--profile", "paged", "--kv-blocks", "256")
    small = spawn_simulator("--profile", "paged", "--kv-blocks", "64")

    async def idle(group: Any) -> None:
        return None

    try:
        group, outcomes = await _controlled_run(tmp_path, [big.url, small.url], 3000, idle)
        preempted = [(await sim_metrics(u))["preemptions"] for u in (big.url, small.url)]
    finally:
        big.stop()
        small.stop()
    report = group.report()
    final = {ep["url"]: ep["final_limit"] for ep in report["endpoints"]}
    assert final[big.url] >= 3 * final[small.url], report["started"]
    assert report["final_parallelism"] == sum(final.values())
    assert sum(o.manifest.rows for o in outcomes) == 3000
    assert sum(preempted) <= 10, preempted
    assert {h["endpoint"] for h in report["history"]} == {big.url, small.url}


async def test_a_server_without_gauges_falls_back_to_latency_and_429s(tmp_path: Path) -> None:
    sim = spawn_simulator("--profile", "paged", "--metrics-format", "none")

    async def idle(group: Any) -> None:
        return None

    try:
        group, outcomes = await _controlled_run(tmp_path, [sim.url], 2000, idle)
    finally:
        sim.stop()
    report = group.report()
    assert "no engine gauges read at the start" in next(iter(report["started"].values()))
    steered = report["history"][:-1]  # the last entry: "the run ended"
    assert steered and all(h["why"].startswith("no engine gauges: ") for h in steered), report["history"]
    assert report["history"][-1]["why"] == "the run ended"
    assert all("kv_cache_usage" not in h for h in report["history"])
    assert sum(o.manifest.rows for o in outcomes) == 2000


@pytest.mark.alone  # times the engine, the controller or the checks
def test_auto_on_a_long_run_follows_the_engine_without_tuning(run_cli, tmp_path: Path) -> None:
    """`run --parallelism auto` of 5,000 rollouts over an engine with gauges: no probing, the limit from
    the engine's capacity, the decisions in report.json, report.md and control.png."""
    sim = spawn_simulator("--profile", "paged")
    inp, out = write_rows(tmp_path / "rows.jsonl", 2500), tmp_path / "out"
    try:
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url",
            sim.url, "--num-repeats", "2", "--parallelism", "auto", "--no-progress",
        )  # fmt: skip
        preempted = asyncio.run(sim_metrics(sim.url))["preemptions"]
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert "tuning" not in report and "diagnosis" not in report
    control = report["adaptive"]
    assert control["mode"] == "engine" and "KV cache holds" in next(iter(control["started"].values()))
    assert report["stages"]["tune"] == 0.0
    assert preempted <= 50, preempted  # 5,000 rollouts
    md = (out / "report.md").read_text()
    assert "## Concurrency control" in md and "![concurrency control](control.png)" in md
    assert (out / "control.png").read_bytes()[:4] == b"\x89PNG"
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 2500, 2)


def test_implausible_gauges_are_no_reading() -> None:
    """NaN, infinities, negative counts and a KV cache more than full are dropped, not steered by."""
    text = (
        'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting{engine="0"} -3\n'
        'vllm:kv_cache_usage_perc{engine="0"} 1.7\nvllm:num_preemptions_total{engine="0"} +Inf\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 4\n'
    )
    sample = parse_engine_metrics(text)
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_cache_usage, sample.preemptions) == (
        None,
        None,
        None,
        None,
    )
    assert sample.waiting_for_capacity == 4
    assert parse_engine_metrics('vllm:num_requests_running{engine="0"} NaN\n') is None


def test_a_stated_capacity_beyond_belief_is_bounded() -> None:
    sample = EngineSample(0, 0, 0.0, 0.0, kv_capacity_tokens=4096, kv_max_concurrency=1e9)
    limit, why = start_limit(sample, 5, OPTS)
    assert limit == OPTS.max_start and "started at 1024" in why
    small = EngineSample(0, 0, 0.0, 0.0, kv_capacity_tokens=300, kv_max_concurrency=1e9)
    assert start_limit(small, 5, OPTS)[0] == 300  # a request holds a token at least


def test_far_below_a_ceiling_growth_doubles_up_to_it() -> None:
    """A trim set a ceiling of 40, then a tenant took the engine (limit 14); once it leaves, the limit
    doubles to the ceiling and steps by quarters only near it."""
    state = EngineState(limit=14, ceiling=40)
    assert twice(state, r(14, 0, 0.1, 14))[0] == 28
    assert twice(state, r(28, 0, 0.1, 28))[0] == 35  # x2 would pass 40: x1.25
    assert twice(state, r(35, 0, 0.1, 35))[0] == 40  # capped by the ceiling


def test_a_ceiling_is_lifted_once_the_cache_has_room_again() -> None:
    """After a preemption cut, a calm spell with the cache mostly empty lifts the ceiling at once (a
    capacity that came back is found in seconds, not by 10% steps)."""
    state = EngineState(limit=40)
    decide(state, r(40, 0, 1.0, 40, preempted=5), OPTS)
    assert state.ceiling == 32
    for _ in range(OPTS.calm_intervals):
        decide(state, r(32, 0, 0.1, 32), OPTS)
    assert state.ceiling is None and state.limit > 32, state
    limits = [decide(state, r(state.limit, 0, 0.1, state.limit), OPTS)[0] for _ in range(4)]
    assert limits[-1] >= 128, limits  # x2 per two intervals of room, far from every limit


def test_a_long_record_is_thinned_but_keeps_every_move() -> None:
    from rollflow.tasks.tuning.engine_control import thinned

    history = [{"t_s": i, "limit": 10 + (i // 100), "why": "x"} for i in range(1000)]
    kept = thinned(history)
    assert len(kept) < 800 and kept[-500:] == history[-500:]
    moves = [h["t_s"] for i, h in enumerate(history) if i and h["limit"] != history[i - 1]["limit"]]
    assert {h["t_s"] for h in kept} >= set(moves)


def test_report_md_lists_each_endpoints_own_moves() -> None:
    from rollflow.tasks.publish.control_plot import control_markdown

    def hist(limits: list[int]) -> list[dict[str, Any]]:
        return [{"t_s": float(i), "limit": n, "why": f"why {i}"} for i, n in enumerate(limits)]

    a, b = hist([8] * 50 + [16]), hist([4, 4, 6] + [6] * 48)
    merged = sorted(
        [{"endpoint": "A", **h} for h in a] + [{"endpoint": "B", **h} for h in b], key=lambda h: h["t_s"]
    )
    md = control_markdown({
        "final_parallelism": 22, "history": merged,
        "endpoints": [{"url": "A", "history": a}, {"url": "B", "history": b}],
    })  # fmt: skip
    rows = [
        line for line in md.splitlines() if line.startswith("| ") and "why" in line and "t (s)" not in line
    ]
    assert rows == ["| 0.0 | A | 8 | why 0 |", "| 0.0 | B | 4 | why 0 |", "| 2.0 | B | 6 | why 2 |",
                    "| 50.0 | A | 16 | why 50 |"]  # fmt: skip


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_gauges_lost_mid_run_hand_over_to_the_latency_rules(tmp_path: Path) -> None:
    """/metrics stops answering mid-run: after 3 intervals without a sample the latency and 429 rules
    steer, and say so; the run completes."""
    sim = spawn_simulator("--profile", "paged", "--seed", "5")

    async def lose(group: Any) -> None:
        await _change_after(3, sim.url, metrics_format="none")

    try:
        group, outcomes = await _controlled_run(tmp_path, [sim.url], 3000, lose)
    finally:
        sim.stop()
    history = next(iter(group.controllers.values())).history
    assert any(h["why"].startswith("no engine sample for 3 intervals: ") for h in history), history
    assert sum(o.manifest.rows for o in outcomes) == 3000


async def test_a_failing_controller_never_fails_the_collection() -> None:
    """A controller that raises leaves its limit where it was; the report names the error."""
    from dataclasses import dataclass, field

    from rollflow.tasks.backends.endpoints import EndpointPool
    from rollflow.tasks.backends.limiter import ConcurrencyLimit
    from rollflow.tasks.backends.observe import AttemptLog
    from rollflow.tasks.tuning.adaptive import AdaptiveGroup, EndpointLimit

    pool = EndpointPool(["http://a"], {"http://a": 7}, ConcurrencyLimit(7))

    @dataclass
    class Broken:
        limit: EndpointLimit
        log: AttemptLog = field(default_factory=AttemptLog)
        history: list[dict[str, Any]] = field(default_factory=list)

        async def run(self, stop: asyncio.Event) -> None:
            raise ValueError("cannot convert float NaN to integer")

    broken = Broken(EndpointLimit(pool, "http://a"))
    pool.observe("http://a", broken.log)
    group = AdaptiveGroup(pool, {"http://a": broken})
    async with group.running():
        await asyncio.sleep(0.01)
    assert pool.endpoint("http://a").limit == 7 and pool.endpoint("http://a").observers == []
    assert group.report()["errors"] == ["http://a: ValueError: cannot convert float NaN to integer"]


def test_a_kv_gauge_stuck_at_zero_costs_ever_rarer_preemption_bursts() -> None:
    """An engine that preempts above 40 in flight while its KV gauge reads 0: each probe above the
    ceiling that meets preemption doubles the wait before the next, so 600 intervals see a handful of
    bursts, not one every calm spell (a KV use of 0 with requests running never lifts a ceiling)."""
    state, bursts = EngineState(limit=48), 0
    for _ in range(600):
        preempted = 5 if state.limit > 40 else 0
        bursts += preempted > 0
        decide(state, r(min(state.limit, 40), 0, 0.0, state.limit, preempted=preempted), OPTS)
    assert bursts <= 5, bursts  # waits of 20, 40, 80, 160, 320 intervals
    assert state.limit >= 32, state  # and it runs near what the engine holds meanwhile
