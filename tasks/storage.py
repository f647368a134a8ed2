"""Whole-object storage rooted at an output URL (local disk or any fsspec store such as S3)."""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

TMP_MARK = ".tmp-"
S3_CONFIG = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 60}


class StorageError(Exception):
    """The output or input store cannot be used; the message says which and what to do."""


def storage_options_for(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """Fail fast on an unreachable S3 endpoint: few retries and short timeouts unless the caller set them."""
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        opts.setdefault("config_kwargs", S3_CONFIG)
        opts.setdefault("skip_instance_cache", True)
    return opts


def describe_error(url: str, exc: BaseException) -> str:
    """A plain-words reason for a storage failure, never including credentials."""
    text = f"{type(exc).__name__}: {exc}"
    if (isinstance(exc, FileNotFoundError) and "bucket" in text.lower()) or "NoSuchBucket" in text:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return (
            f"bucket '{bucket}' does not exist (NoSuchBucket). Create it (aws s3 mb s3://{bucket}) or "
            f"choose another location"
        )
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return "access denied: check the credentials (AWS_* or ROLLFLOW_STORAGE__*) and the bucket policy"
    if "Could not connect" in text or "EndpointConnectionError" in text or isinstance(exc, ConnectionError):
        return "the storage endpoint is unreachable: check AWS_ENDPOINT_URL / ROLLFLOW_STORAGE__ENDPOINT_URL"
    return text[:300]


class Store:
    """Objects under one root URL, each written whole: temp + rename on disk, a single PUT elsewhere."""

    def __init__(self, root_url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root_url = root_url.rstrip("/") or root_url
        self.fs, root = fsspec.core.url_to_fs(root_url, **storage_options_for(root_url, storage_options))
        self.root = root.rstrip("/") if root != "/" else root
        self.local = isinstance(self.fs, LocalFileSystem)

    def url(self, rel: str) -> str:
        return f"{self.root_url}/{rel}"

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        with self.open_write(rel) as fh:
            fh.write(data)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A large object that appears whole on success and not at all on failure."""
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                with open(tmp, "wb") as fh:
                    yield fh
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return
        fh = self.fs.open(path, "wb")
        try:
            yield fh
        except BaseException:
            discard = getattr(fh, "discard", None)
            if discard is not None:
                discard()
            else:
                with contextlib.suppress(Exception):
                    fh.close()
            raise
        fh.close()

    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self.path(rel), "rb", block_size=4 * 1024 * 1024)

    def list(self, rel_dir: str) -> list[str]:
        path = self.path(rel_dir)
        try:
            entries = self.fs.ls(path, detail=False, refresh=True) if not self.local else os.listdir(path)
        except FileNotFoundError:
            return []
        names = [posixpath.basename(str(e).rstrip("/")) for e in entries]
        return sorted(n for n in names if TMP_MARK not in n and n)

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))

    def delete_tree(self, rel_dir: str) -> None:
        path = self.path(rel_dir)
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)
            return
        for name in self.list(rel_dir):
            self.delete(f"{rel_dir}/{name}")

    def check_writable(self) -> None:
        """Write and delete a probe object, turning any failure into one clear StorageError."""
        probe = f".rollflow-probe-{secrets.token_hex(4)}"
        try:
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except Exception as exc:
            raise StorageError(
                f"Cannot write to the output {self.root_url}: {describe_error(self.root_url, exc)}. "
                f"Nothing was written and no request was sent."
            ) from exc


def open_input(url: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
    """The input file as a binary stream (local path or fsspec URL), read in large blocks."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    return fs.open(path, "rb", block_size=4 * 1024 * 1024)
