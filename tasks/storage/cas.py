"""Compare-and-swap on one small object: conditional writes on S3 (If-None-Match / If-Match on the
ETag), flock on a local disk, write-then-read-back elsewhere (a documented best effort)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator

from rollflow.tasks.storage.store import Store


class ObjectCas:
    """Compare-and-swap on one object: read gives (bytes, token); writes succeed only if unchanged."""

    def __init__(self, store: Store, rel: str) -> None:
        self.store = store
        self.rel = rel
        protocols = store.fs.protocol if isinstance(store.fs.protocol, tuple) else (store.fs.protocol,)
        self.s3 = "s3" in protocols

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not self.store.local:
            yield
            return
        os.makedirs(self.store.root, exist_ok=True)
        with open(os.path.join(self.store.root, ".lease.lock"), "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _bucket_key(self) -> tuple[str, str]:
        bucket, _, key = self.store.path(self.rel).partition("/")
        return bucket, key

    def read(self) -> tuple[bytes | None, str | None]:
        if self.s3:
            bucket, key = self._bucket_key()
            try:
                obj = self.store.fs.call_s3("get_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None, None
            return _read_body(self.store, obj["Body"]), obj["ETag"]
        try:
            data = self.store.read_bytes(self.rel)
        except FileNotFoundError:
            return None, None
        return data, data.decode("utf-8", "replace")

    def write(self, data: bytes, token: str | None) -> bool:
        """Create (token None) or replace the object we read as `token`; False if someone beat us."""
        if self.s3:
            cond = {"IfNoneMatch": "*"} if token is None else {"IfMatch": token}
            return self._s3_conditional("put_object", Body=data, **cond)
        if not self._if_unchanged(token, lambda: self.store.write_bytes(self.rel, data)):
            return False
        if not self.store.local:
            return self.read()[0] == data
        return True

    def delete(self, token: str | None) -> bool:
        """Delete the object only if it is still the version we read as `token`; False if it changed."""
        if self.s3:
            return self._s3_conditional("delete_object", IfMatch=token)
        return self._if_unchanged(token, lambda: self.store.delete(self.rel))

    def _s3_conditional(self, operation: str, **params: object) -> bool:
        """One conditional S3 request; False when its precondition failed (someone changed the object)."""
        bucket, key = self._bucket_key()
        try:
            self.store.fs.call_s3(operation, Bucket=bucket, Key=key, **params)
        except (FileExistsError, OSError) as exc:
            if _precondition_failed(exc):
                return False
            raise
        return True

    def _if_unchanged(self, token: str | None, change: Callable[[], None]) -> bool:
        with self._locked():
            if self.read()[1] != token:
                return False
            change()
        return True


def _precondition_failed(exc: BaseException) -> bool:
    text = str(exc)
    return "pre-condition" in text or "PreconditionFailed" in text or isinstance(exc, FileExistsError)


def _read_body(store: Store, body: object) -> bytes:
    """s3fs hands back an aiobotocore stream; read it on s3fs's own loop."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        async with body:  # type: ignore[attr-defined]
            return await body.read()  # type: ignore[attr-defined]

    return sync(store.fs.loop, read)
