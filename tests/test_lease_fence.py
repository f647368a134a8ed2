"""Lease and fence under the failures real storage has: resent PUTs, late releases, shared hostnames,
commits that lose the lease, and writers on other processes (local disk and S3 on moto)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import orjson
import pytest

from rollflow.tasks.storage.cas import ObjectCas
from rollflow.tasks.storage.lease import Lease, LeaseHeld, LeaseLost, owner_fence, process_space
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger
from rollflow.tasks.storage.store import Store


def _root(where: str, tmp_path: Path, moto_s3) -> str:
    return str(tmp_path / "out") if where == "local" else f"s3://{moto_s3.new_bucket()}/run"


class ResentCas(ObjectCas):
    """Each write is sent twice with the same condition, as botocore resends a PUT whose reply was lost:
    the first lands, the second meets the changed ETag (412) and is what the caller sees."""

    def write(self, data: bytes, token: str | None) -> bool:
        super().write(data, token)
        return super().write(data, token)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_renewal_whose_resent_put_meets_412_goes_on(where, tmp_path, moto_s3):
    lease = Lease(Store(_root(where, tmp_path, moto_s3)), 30)
    lease.acquire()
    lease.cas = ResentCas(lease.store, "lease.json")
    for _ in range(3):
        lease.renew()
    assert not lease.lost
    lease.check()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_release_never_deletes_a_successors_lease(where, tmp_path, moto_s3):
    """The successor takes over between the old owner's read and its delete."""
    store = Store(_root(where, tmp_path, moto_s3))
    old, successor = Lease(store, 30), Lease(store, 30)
    old.acquire()
    real_read = old.cas.read

    def read_then_lose_the_race() -> tuple[bytes | None, str | None]:
        old.cas.read = real_read  # type: ignore[method-assign]
        seen = real_read()
        ObjectCas(store, "lease.json").write(successor._body(), seen[1])
        return seen

    old.cas.read = read_then_lose_the_race  # type: ignore[method-assign]
    old.release()
    assert orjson.loads(store.read_bytes("lease.json"))["owner"] == successor.owner


@pytest.mark.parametrize("where", ["local", "s3"])
def test_same_hostname_on_another_machine_is_not_taken_over(where, tmp_path, moto_s3):
    """A dead-looking pid means nothing outside this boot and pid namespace (another VM, a container)."""
    store = Store(_root(where, tmp_path, moto_s3))
    now = time.time()
    lease = {
        "owner": "twin:999999:ab", "host": socket.gethostname(), "pid": 999_999, "acquired_at": now,
        "expires_at": now + 600, "space": "another-boot/pid:[4026531836]",
    }  # fmt: skip
    store.write_bytes("lease.json", orjson.dumps(lease))
    with pytest.raises(LeaseHeld):
        Lease(store, 30).acquire()
    store.write_bytes("lease.json", orjson.dumps({**lease, "space": process_space()}))
    taker = Lease(store, 30)
    taker.acquire()  # same boot and namespace, pid gone: a dead owner here, taken over at once
    assert orjson.loads(store.read_bytes("lease.json"))["owner"] == taker.owner


def _manifest() -> ChunkManifest:
    return ChunkManifest(
        chunk=0, first_task=0, num_tasks=1, rows_expected=1, rows=1, failed=1, sha256="", bytes=0,
        started_at="", committed_at="", wall_s=0.0, attempt=1,
    )  # fmt: skip


def _objects(store: Store) -> list[str]:
    store.fs.invalidate_cache()
    try:
        return sorted(store.fs.find(store.root))
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_fenced_out_commit_writes_no_object_at_all(where, tmp_path, moto_s3):
    store = Store(_root(where, tmp_path, moto_s3))
    ledger = Ledger(store)
    ledger._run_id = "r1"
    store.write_bytes("chunks/00000.jsonl", b"old\n")
    store.write_bytes("failures/00000.jsonl", b"old failure\n")
    before = {p: store.fs.cat_file(p) for p in _objects(store)}

    def lost() -> None:
        raise LeaseLost("taken over")

    ledger.fence = lost
    with pytest.raises(LeaseLost):
        ledger.commit(0, b"new\n", b"new failure\n", _manifest())
    assert {p: store.fs.cat_file(p) for p in _objects(store)} == before


@pytest.mark.parametrize("where", ["local", "s3"])
def test_worker_commit_is_fenced_by_the_runs_lease(where, tmp_path, moto_s3):
    """A worker writes for the run whose owner it was given; once another run holds the lease, nothing."""
    store = Store(_root(where, tmp_path, moto_s3))
    run = Lease(store, 30)
    run.acquire()
    worker = Ledger(Store(store.root_url))
    worker._run_id = "r1"
    worker.fence = owner_fence(worker.store, run.owner, run.margin_s)
    worker.commit(0, b"row\n", None, _manifest())
    assert store.exists("chunks/00000.json")
    store.write_bytes(
        "lease.json", orjson.dumps({**orjson.loads(store.read_bytes("lease.json")), "owner": "x"})
    )
    with pytest.raises(LeaseLost):
        worker.commit(1, b"row\n", None, _manifest().model_copy(update={"chunk": 1}))
    assert not store.exists("chunks/00001.jsonl") and not store.exists("chunks/00001.json")
