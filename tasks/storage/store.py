"""Whole-object storage rooted at an output URL (local disk or any fsspec store such as S3)."""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import secrets
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

TMP_MARK = ".tmp-"
READ_BLOCK = 4 * 1024 * 1024
S3_CONFIG = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 60}


class StorageError(Exception):
    """The output or input store cannot be used; the message says which and what to do."""


def storage_options_for(url: str, options: dict[str, Any] | None, fresh: bool = True) -> dict[str, Any]:
    """Fail fast on an unreachable S3 endpoint: few retries and short timeouts unless the caller set them.

    `fresh` skips fsspec's instance cache (and so its listing cache) for output stores that other
    processes write to; read-only input reuses the cached client, which saves ~0.2 s per open.
    """
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        opts.setdefault("config_kwargs", S3_CONFIG)
        if fresh:
            opts.setdefault("skip_instance_cache", True)
    return opts


def describe_error(url: str, exc: BaseException, elsewhere: str = "choose another location") -> str:
    """A plain-words reason for a storage failure, never including credentials."""
    text = f"{type(exc).__name__}: {exc}"
    if (isinstance(exc, FileNotFoundError) and "bucket" in text.lower()) or "NoSuchBucket" in text:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return (
            f"bucket '{bucket}' does not exist (NoSuchBucket). "
            f"Create it (aws s3 mb s3://{bucket}) or {elsewhere}"
        )
    if any(k in text for k in ("NoCredentials", "PartialCredentials", "InvalidAccessKeyId", "SignatureDoes")):
        return (
            f"the credentials were refused or incomplete ({type(exc).__name__}): set both the access key "
            f"and the secret (AWS_* or ROLLFLOW_STORAGE__*)"
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
        return f"{self.root_url}/{rel}" if rel else self.root_url

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def exists(self, rel: str) -> bool:
        """Asks the store, not s3fs's listing cache: another process may have written since."""
        path = self.path(rel)
        if not self.local:
            self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def stamp(self, rel: str) -> str:
        """What changes whenever the object is rewritten: size and mtime_ns on disk, size and ETag on S3."""
        path = self.path(rel)
        if self.local:
            st = os.stat(path)
            return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        self.fs.invalidate_cache(path)
        info = self.fs.info(path)
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        return f"{info.get('size')}:{tag}"

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def read_many(self, rels: list[str]) -> dict[str, bytes]:
        """Several small objects in one batch (concurrent GETs on S3); missing ones are left out."""
        if not rels:
            return {}
        if self.local:
            found: dict[str, bytes] = {}
            for rel in rels:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    found[rel] = self.read_bytes(rel)
            return found
        by_path = {self.path(rel): rel for rel in rels}
        got = self.fs.cat(list(by_path), on_error="omit")
        return {by_path[self.fs._strip_protocol(p)]: data for p, data in got.items()}

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
        # Not `with fs.open(...)`: fsspec's __exit__ closes, and closing an S3 file completes the upload
        # even when the block raised. On failure abort the multipart upload and mark the file closed, so
        # neither __exit__ nor garbage collection can publish the partial object.
        fh = self.fs.open(path, "wb")
        try:
            yield fh
        except BaseException:
            discard = getattr(fh, "discard", None)
            with contextlib.suppress(Exception):
                if discard is not None:
                    discard()
            fh.closed = True
            raise
        fh.close()

    def open_read(self, rel: str) -> IO[bytes]:
        """Buffered so line iteration is fast: fsspec's own readline re-reads a whole block per line."""
        return _buffered(self.fs.open(self.path(rel), "rb", block_size=READ_BLOCK), self.local)

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
        if not self.local:
            self.fs.invalidate_cache(path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def check_writable(self) -> None:
        """Write and delete a probe object, turning any failure into one clear StorageError."""
        probe = f".rollflow-probe-{secrets.token_hex(4)}"
        try:
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except Exception as exc:
            raise StorageError(
                f"Output {self.root_url}: "
                f"{describe_error(self.root_url, exc, 'choose another --output')}. "
                f"Nothing was written and no request was sent."
            ) from exc


def open_input(url: str, storage_options: dict[str, Any] | None = None) -> IO[bytes]:
    """The input file as a binary stream (local path or fsspec URL), read in large blocks."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options, fresh=False))
    return _buffered(fs.open(path, "rb", block_size=READ_BLOCK), isinstance(fs, LocalFileSystem))


def _buffered(fh: IO[bytes], local: bool) -> IO[bytes]:
    """Local files are already buffered; remote ones get a C-level buffer for readline and iteration."""
    if local:
        return fh
    return io.BufferedReader(fh, buffer_size=READ_BLOCK)  # type: ignore[arg-type]
