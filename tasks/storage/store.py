"""Whole-object storage rooted at an output URL (local disk or any fsspec store such as S3)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import re
import secrets
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.compression import compr
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import infer_compression

TMP_MARK = ".tmp-"
READ_BLOCK = 4 * 1024 * 1024
S3_CONFIG = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 60}


class StorageError(Exception):
    """The output or input store cannot be used; the message says which and what to do."""


class StorageFull(StorageError):
    """The output's disk or quota is full, or read-only: every chunk would fail alike, so the run stops."""


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def storage_full(exc: BaseException) -> OSError | None:
    """A full disk or quota, or a read-only file system, anywhere in `exc` (its causes, its groups)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_ERRNOS:
            return current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


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


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


LOCAL_ERRORS = {
    errno.ENOSPC: "no space left on device (ENOSPC): free space there or {elsewhere}",
    errno.EDQUOT: "disk quota exceeded (EDQUOT): free space within the quota or {elsewhere}",
    errno.EROFS: "it is on a read-only file system (EROFS): {elsewhere}",
    errno.EACCES: "permission denied (EACCES): this user ({user}) may not write there; check the "
    "directory's owner and mode (ls -ld), fix them (chmod, chown), or {elsewhere}",
    errno.EPERM: "operation not permitted (EPERM): this user ({user}) may not write there (owner, mode or "
    "an immutable attribute); fix that, or {elsewhere}",
}


def _local_reason(exc: BaseException, elsewhere: str) -> str | None:
    """Advice for a local path's OSError, by errno (never the S3 credentials advice)."""
    if not isinstance(exc, OSError) or exc.errno not in LOCAL_ERRORS:
        return None
    where = f" ({exc.filename})" if exc.filename else ""
    try:
        user = os.environ.get("USER") or str(os.getuid())
    except AttributeError:  # pragma: no cover - no getuid on this platform
        user = "this user"
    return LOCAL_ERRORS[exc.errno].format(elsewhere=elsewhere, user=user) + where


def describe_error(url: str, exc: BaseException, elsewhere: str = "choose another location") -> str:
    """A plain-words reason for a storage failure, never including credentials."""
    text = f"{type(exc).__name__}: {exc}"
    local = _local_reason(exc, elsewhere) if is_local(url) else None
    if local is not None:
        return local
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
        self.options = dict(storage_options or {})
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

    def remove_stale_copies(self, rel: str) -> list[str]:
        """Partial copies of `rel` left by a process that is gone (killed while writing it), removed;
        a live writer's copy is left alone. Only local disks leave such copies (S3 aborts the upload)."""
        if not self.local:
            return []
        folder, name = os.path.split(self.path(rel))
        prefix, removed = f"{name}{TMP_MARK}", []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.listdir(folder or "."):
                pid = entry[len(prefix) :].split("-", 1)[0] if entry.startswith(prefix) else ""
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(folder, entry))
                        removed.append(entry)
        return removed

    def open_read(self, rel: str) -> IO[bytes]:
        """Buffered so line iteration is fast: fsspec's own readline re-reads a whole block per line."""
        return _buffered(self.fs.open(self.path(rel), "rb", block_size=READ_BLOCK), self.local)

    def remove_stale_in(self, rel_dir: str, pattern: re.Pattern[str]) -> list[str]:
        """Dead partial copies in `rel_dir` of any object whose name matches `pattern` (see
        remove_stale_copies), also of an object that never appeared whole."""
        if not self.local:
            return []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            names = {e.split(TMP_MARK, 1)[0] for e in os.listdir(self.path(rel_dir)) if TMP_MARK in e}
            return [
                gone
                for name in sorted(names)
                if pattern.match(name)
                for gone in self.remove_stale_copies(posixpath.join(rel_dir, name))
            ]
        return []

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


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def open_input(url: str, storage_options: dict[str, Any] | None = None, offset: int = 0) -> IO[bytes]:
    """The input file as a binary stream (local path or fsspec URL) from `offset`, read in large blocks.

    Compressed inputs (by extension: .gz, .bz2, .xz, .zst, ...) are read decompressed, and `offset` counts
    decompressed bytes; they cannot seek, so the bytes before `offset` are read and dropped. So are they
    on an HTTP server that ignores Range requests (python -m http.server): it is read as one stream.
    """
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options, fresh=False))
    compression = infer_compression(path)
    local = isinstance(fs, LocalFileSystem)
    stream = _is_http(fs) and not _serves_ranges(fs, path)
    raw = fs.open(path, "rb", block_size=0 if stream else READ_BLOCK)
    if compression is None:
        fh = _buffered(raw, local)
        if stream:
            _skip(fh, offset)
        else:
            fh.seek(offset)
        return fh
    fh = compr[compression](raw, mode="rb")
    close = fh.close

    def close_both() -> None:  # as fsspec's OpenFile does: the decompressor, then the file under it
        close()
        raw.close()

    fh.close = close_both
    _skip(fh, offset)
    return fh


def _is_http(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in ("http", "https") for p in protocols)


def _serves_ranges(fs: Any, path: str) -> bool:
    """Whether the HTTP server answers a Range request with that range (a 2-byte probe at byte 1)."""
    try:
        with fs.open(path, "rb", block_size=2) as probe:
            if not getattr(probe, "seekable", lambda: False)() or (probe.size or 0) < 3:
                return False
            probe.seek(1)
            probe.read(1)
    except ValueError:  # fsspec: "The HTTP server doesn't appear to support range requests"
        return False
    return True


def _skip(fh: IO[bytes], count: int) -> None:
    while count > 0:
        data = fh.read(min(count, READ_BLOCK))
        if not data:
            return
        count -= len(data)


def _buffered(fh: IO[bytes], local: bool) -> IO[bytes]:
    """Local files are already buffered; remote ones get a C-level buffer for readline and iteration."""
    if local:
        return fh
    return io.BufferedReader(fh, buffer_size=READ_BLOCK)  # type: ignore[arg-type]
