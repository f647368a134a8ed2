"""The endpoint pool: least-loaded choice, limits that sum to the shared one, rotation and its backoff."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from rollflow.settings import BackendParams, BackendSettings
from rollflow.tasks.backends import endpoints as ep_module
from rollflow.tasks.backends.endpoints import EndpointPool, split_limit
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.backends.observe import AttemptLog
from rollflow.tasks.publish.endpoints import merge_rows

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


def _pool(limits: dict[str, int]) -> EndpointPool:
    return EndpointPool(list(limits), limits, ConcurrencyLimit(1))


def test_urls_parse_a_comma_list_and_name_a_bad_item():
    assert BackendParams(url=f" {A} ,{B}/").urls == [A, f"{B}/"]
    assert BackendParams(url=A).urls == [A]
    for bad, needle in ((f"{A},,{B}", "item 2"), (f"{A},ftp://x", "item 2"), (f"{A},{A}/", "twice")):
        with pytest.raises(ValidationError, match=needle):
            BackendParams(url=bad)


def test_for_url_keeps_the_key_and_points_at_one_endpoint():
    settings = BackendSettings(url=f"{A},{B}", api_key="sk-test")
    one = settings.for_url(B)
    assert one.url == B and one.urls == [B]
    assert one.api_key is not None and one.api_key.get_secret_value() == "sk-test"
    with pytest.raises(ValueError, match="one endpoint"):
        settings.for_url(f"{A},{B}")


def test_split_limit_gives_the_remainder_to_the_first():
    assert split_limit(10, [A, B, C]) == {A: 4, B: 3, C: 3}
    assert sum(split_limit(64, [A, B, C]).values()) == 64


def test_fewer_slots_than_endpoints_keep_the_total_and_use_every_endpoint():
    """--parallelism 2 with 3 URLs gave each URL 1 slot, so 3 went out; every URL must still serve."""
    assert split_limit(2, [A, B, C]) == {A: 1, B: 1, C: 0}
    pool = EndpointPool([A, B, C], split_limit(2, [A, B, C]), ConcurrencyLimit(2))
    assert pool.total.limit == 2
    used = []
    for _ in range(6):  # two in flight at a time, the older one finishing first
        ep = pool.choose()
        pool.begin(ep)
        used.append(ep.url)
        if len(used) >= 2:
            pool.end(pool.endpoint(used[-2]))
    assert set(used) == {A, B, C}
    pool.failed(pool.endpoint(A), "connection", refused=True)
    assert pool.total.limit == 2  # B and C can still carry the two slots


def test_choice_follows_free_capacity_in_proportion_to_limits():
    pool = _pool({A: 8, B: 16, C: 32})
    assert pool.total.limit == 56
    for _ in range(56):
        pool.begin(pool.choose())
    assert [e.outstanding for e in pool.endpoints] == [8, 16, 32]
    pool.end(pool.endpoint(B))
    assert pool.choose().url == B
    assert pool.choose(exclude=(B,)).url != B


def test_set_limit_keeps_the_total_the_sum():
    pool = _pool({A: 8, B: 16})
    pool.set_limit(A, 20)
    assert pool.total.limit == 36 and pool.limits() == {A: 20, B: 16}


@pytest.mark.alone  # a 50 ms backoff must not pass mid-test
def test_refused_connection_takes_an_endpoint_out_and_a_trial_brings_it_back(monkeypatch):
    monkeypatch.setattr(ep_module, "BACKOFF_BASE_S", 0.05)
    pool = _pool({A: 8, B: 8})
    a = pool.endpoint(A)
    token = pool.begin(a)
    pool.end(a)
    pool.failed(a, "connection", refused=True)
    assert not a.in_rotation and pool.total.limit == 8
    assert pool.caused_by_rotation(a, token)
    assert all(pool.choose().url == B for _ in range(20))
    time.sleep(0.06)
    trial = pool.choose()
    assert trial is a and a.trial
    assert pool.choose().url == B  # one trial at a time
    pool.begin(a)
    pool.end(a)
    pool.failed(a, "connection", refused=True)
    assert not a.in_rotation and a.backoff_s == pytest.approx(0.1)
    time.sleep(0.11)
    assert pool.choose() is a
    pool.begin(a)
    pool.end(a)
    pool.succeeded(a, 0.01)
    assert a.in_rotation and pool.total.limit == 16
    assert [kind for kind, _ in a.events] == ["out", "in"]
    assert a.out_of_rotation_s >= 0.16


def test_backoff_is_capped_so_a_returning_replica_is_tried_soon():
    pool = _pool({A: 4, B: 4})
    a = pool.endpoint(A)
    pool.failed(a, "connection", refused=True)
    for _ in range(12):
        a.retry_at = 0.0
        assert pool.choose() is a
        pool.failed(a, "connection", refused=True)
    assert a.backoff_s == ep_module.BACKOFF_MAX_S
    assert a.retry_at - time.monotonic() <= ep_module.BACKOFF_MAX_S


def test_a_streak_of_five_5xx_takes_an_endpoint_out_and_other_errors_break_it():
    pool = _pool({A: 4, B: 4})
    a = pool.endpoint(A)
    for _ in range(4):
        pool.failed(a, "http_503")
    pool.failed(a, "http_429")
    for _ in range(4):
        pool.failed(a, "http_500")
    assert a.in_rotation
    pool.failed(a, "http_502")
    assert not a.in_rotation and a.errors == 10


def test_all_out_still_dispatches_and_failures_count():
    pool = _pool({A: 4, B: 4})
    tokens = {}
    for url in (A, B):
        tokens[url] = pool.begin(pool.endpoint(url))
        pool.end(pool.endpoint(url))
        pool.failed(pool.endpoint(url), "connection", refused=True)
    assert pool.total.limit == 8
    assert pool.choose().url in (A, B)
    assert not pool.caused_by_rotation(pool.endpoint(A), tokens[A])


def test_per_endpoint_observers_and_rows():
    pool = _pool({A: 4, B: 12})
    log = AttemptLog()
    pool.observe(A, log)
    a, b = pool.endpoint(A), pool.endpoint(B)
    pool.choose()
    pool.succeeded(a, 0.5)
    pool.failed(a, "http_429")
    pool.succeeded(b, 0.25)
    assert log.ok == 1 and log.errors == {"http_429": 1}
    b.engine = lambda: {"running_max": 3, "waiting_max": 0, "kv_cache_usage_max": 0.5}
    rows = {row["url"]: row for row in pool.rows()}
    assert set(rows[A]) == {
        "url", "rollouts", "rollouts_per_s", "errors", "limit", "out_of_rotation_s", "engine",
    }  # fmt: skip
    assert (rows[A]["rollouts"], rows[A]["errors"], rows[A]["limit"], rows[A]["engine"]) == (1, 1, 4, None)
    assert rows[B]["engine"] == {"running_max": 3, "waiting_max": 0, "kv_cache_usage_max": 0.5}
    assert rows[B]["rollouts_per_s"] is not None and rows[B]["rollouts_per_s"] > 0


def test_a_worker_share_spreads_over_the_endpoints_and_can_be_zero():
    limit = ConcurrencyLimit(0, minimum=0)
    pool = EndpointPool([A, B], {A: 32, B: 8}, limit)
    pool.set_share(10, {A: 32, B: 8})
    assert pool.limits() == {A: 8, B: 2} and limit.limit == 10
    pool.set_share(0, {A: 32, B: 8})
    assert limit.limit == 0  # a worker with no share sends nothing
    assert split_limit(7, {A: 8, B: 16, C: 32}) == {A: 1, B: 2, C: 4}


def test_a_replica_another_worker_took_out_leaves_this_pool_without_a_trial_soon():
    pool = EndpointPool([A, B], {A: 4, B: 4}, ConcurrencyLimit(8))
    pool.follow(B, "out", 1)
    assert not pool.endpoint(B).in_rotation and pool.total.limit == 4
    assert all(pool.choose() is pool.endpoint(A) for _ in range(20))
    pool.follow(B, "in", 2)
    assert pool.endpoint(B).in_rotation and pool.total.limit == 8
    pool.follow(B, "out", 1)  # an event this pool applied already: ignored
    assert pool.endpoint(B).in_rotation and pool.rotation() == {}  # followed, not found here


def test_dask_rows_are_summed_over_the_workers_pools():
    part = {"url": A, "rollouts": 10, "errors": 1, "out_of_rotation_s": 0.5}
    rows = merge_rows([[part], [{**part, "out_of_rotation_s": 1.5}]], {A: 8, B: 4}, 4.0)
    assert rows[0] == {
        "url": A, "rollouts": 20, "errors": 2, "out_of_rotation_s": 1.5, "rollouts_per_s": 5.0, "limit": 8,
        "engine": None,
    }  # fmt: skip
    assert rows[1]["url"] == B and rows[1]["rollouts"] == 0 and rows[1]["limit"] == 4


def test_a_pool_opened_later_numbers_its_findings_after_an_earlier_ones():
    """The share book keeps each worker's newest finding number: a run's pool reopened in the same worker
    process (after an idle spell) must not report numbers the book takes for old news."""
    first = EndpointPool([A, B], {A: 4, B: 4}, ConcurrencyLimit(8))
    first.failed(first.endpoint(B), "connection", refused=True)
    second = EndpointPool([A, B], {A: 4, B: 4}, ConcurrencyLimit(8))
    second.failed(second.endpoint(B), "connection", refused=True)
    assert first.rotation()[B][0] == second.rotation()[B][0] == "out"
    assert second.rotation()[B][1] > first.rotation()[B][1]


def test_a_workers_share_goes_to_the_replicas_in_rotation_once_the_book_counts_them():
    """Share 8 of a run over A and B (4 + 4). This worker takes B out: until the book knows, the share is
    of both, so A keeps its 4 (all 8 on A would be twice A's part of the run's limit). Once the book's
    rotation says B is out, the share is of A alone: all of it goes to A, none is lost to B."""
    limit = ConcurrencyLimit(0, minimum=0)
    pool = EndpointPool([A, B], {A: 4, B: 4}, limit)
    pool.set_share(8, {A: 4, B: 4})
    assert pool.limits() == {A: 4, B: 4} and limit.limit == 8
    pool.failed(pool.endpoint(B), "connection", refused=True)
    assert pool.limits() == {A: 4, B: 0} and limit.limit == 4
    pool.follow(B, "out", 1)
    assert pool.limits() == {A: 8, B: 0} and limit.limit == 8
    pool.set_share(3, {A: 4, B: 4})
    assert limit.limit == 3
    pool.follow(B, "in", 2)
    assert pool.endpoint(B).in_rotation and pool.limits() == {A: 2, B: 1} and limit.limit == 3
