"""Whole-object storage on local disk and on S3 (moto_server): objects appear whole or not at all."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from fixtures_net import free_port

from rollflow.tasks.storage.store import TMP_MARK, StorageError, Store, open_input

WHERE = ["local", "s3"]
BIG = 12 * 1024 * 1024  # above s3fs's 5 MiB block: a multipart upload


@pytest.fixture(params=WHERE)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "out"))
    s3 = request.getfixturevalue("moto_s3")
    return Store(f"s3://{s3.new_bucket()}/run")


def pending_uploads(store: Store) -> list[dict]:
    bucket = store.root.split("/", 1)[0]
    return store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def test_round_trip(store: Store) -> None:
    assert not store.exists("a/b/c.json")
    store.write_bytes("a/b/c.json", b"first")
    store.write_bytes("a/b/c.json", b"second, longer")  # replaced whole, not appended
    assert store.exists("a/b/c.json")
    assert store.read_bytes("a/b/c.json") == b"second, longer"
    assert store.url("a/b/c.json") == f"{store.root_url}/a/b/c.json"
    store.write_bytes("a/b/a.json", b"")
    assert store.list("a/b") == ["a.json", "c.json"]
    assert store.list("nowhere") == []
    store.delete("a/b/a.json")
    store.delete("a/b/a.json")  # missing is fine
    assert store.list("a/b") == ["c.json"]


def test_delete_tree_keeps_siblings(store: Store) -> None:
    for rel in ("chunks/00000.jsonl", "chunks/00000.json", "chunks/sub/x", "chunks-other/keep"):
        store.write_bytes(rel, b"x")
    store.delete_tree("chunks")
    store.delete_tree("chunks")  # already gone is fine
    assert store.list("chunks") == []
    assert store.read_bytes("chunks-other/keep") == b"x"


def test_read_many_leaves_out_missing(store: Store) -> None:
    store.write_bytes("m/1.json", b"one")
    store.write_bytes("m/2.json", b"two")
    assert store.read_many(["m/1.json", "m/2.json", "m/3.json"]) == {"m/1.json": b"one", "m/2.json": b"two"}
    assert store.read_many([]) == {}


def test_temp_files_are_invisible(store: Store) -> None:
    store.write_bytes("chunks/00000.jsonl", b"data\n")
    if store.local:
        Path(store.path(f"chunks/00001.jsonl{TMP_MARK}123-abcd")).write_bytes(b"half")
    else:
        store.fs.pipe_file(store.path(f"chunks/00001.jsonl{TMP_MARK}123-abcd"), b"half")
    assert store.list("chunks") == ["00000.jsonl"]


def test_local_write_leaves_no_temp(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "out"))
    store.write_bytes("x/y.bin", b"1" * 1000)
    with store.open_write("x/z.bin") as fh:
        fh.write(b"2" * 1000)
    assert sorted(os.listdir(tmp_path / "out" / "x")) == ["y.bin", "z.bin"]


@pytest.mark.parametrize("size", [100, BIG])
def test_open_write_appears_whole_on_success(store: Store, size: int) -> None:
    with store.open_write("big/obj.bin") as fh:
        block = b"0123456789" * 10
        for _ in range(size // len(block)):
            fh.write(block)
        fh.write(block[: size % len(block)])
        if store.local:
            assert store.list("big") == []  # not visible before the block ends
    assert len(store.read_bytes("big/obj.bin")) == size


@pytest.mark.parametrize("size", [100, BIG])
def test_open_write_aborted_leaves_nothing(store: Store, size: int) -> None:
    store.write_bytes("keep.bin", b"old")
    with pytest.raises(RuntimeError, match="killed"), store.open_write("keep.bin") as fh:
        fh.write(b"n" * size)
        raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError, match="killed"), store.open_write("new.bin") as fh:
        fh.write(b"n" * size)
        raise RuntimeError("killed mid-write")
    assert store.read_bytes("keep.bin") == b"old"
    assert not store.exists("new.bin")
    assert store.list("") == ["keep.bin"]
    if not store.local:
        assert pending_uploads(store) == []


def test_open_read_lines_and_seek(store: Store) -> None:
    lines = [f"line {i}\n".encode() for i in range(1000)]
    store.write_bytes("in.jsonl", b"".join(lines))
    with store.open_read("in.jsonl") as fh:
        assert list(fh) == lines
        fh.seek(len(lines[0]) * 2 + 1)  # line 0..9 are 7 bytes
        assert fh.readline() == lines[2][1:]


def test_open_input_local_and_s3(tmp_path: Path, moto_s3) -> None:
    data = b"".join(f"row {i}\n".encode() for i in range(5000))
    local = tmp_path / "in.jsonl"
    local.write_bytes(data)
    bucket = moto_s3.new_bucket()
    moto_s3.fs().pipe_file(f"{bucket}/in.jsonl", data)
    for url in (str(local), f"s3://{bucket}/in.jsonl"):
        with open_input(url, None) as fh:
            assert b"".join(fh) == data
            fh.seek(data.index(b"row 4000\n"))
            assert fh.readline() == b"row 4000\n"


def test_check_writable_ok(store: Store) -> None:
    store.check_writable()
    assert store.list("") == []


def test_missing_bucket_is_one_clear_error(moto_s3) -> None:
    store = Store("s3://nope-rf-missing/run")
    with pytest.raises(StorageError) as info:
        store.check_writable()
    message = str(info.value)
    assert message.startswith("Output s3://nope-rf-missing/run: bucket 'nope-rf-missing' does not exist")
    assert "aws s3 mb s3://nope-rf-missing" in message and "--output" in message
    assert "Nothing was written" in message
    assert "testing" not in message  # no credentials


def test_unreachable_endpoint_fails_fast(moto_s3) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    store = Store(
        "s3://any-bucket/run", {"client_kwargs": {"endpoint_url": dead}, "key": "k", "secret": "s3cr3t-value"}
    )
    started = time.monotonic()
    with pytest.raises(StorageError, match="unreachable") as info:
        store.check_writable()
    assert time.monotonic() - started < 30
    assert "s3cr3t-value" not in str(info.value)


def test_local_output_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match=r"Output .*file/run: .*Nothing was written"):
        Store(str(tmp_path / "file" / "run")).check_writable()
