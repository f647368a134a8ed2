"""Secrets kept out of every text a run writes: one process-wide set of values, one replacement.

Error texts reach failures files, reports, the console and Prefect's logs from many places and classes
of error; registering the secrets once per process and redacting at those few exits (and in every log
record) covers them all, instead of each error site remembering which key it might echo.
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
import traceback
from typing import Any

from pydantic import BaseModel, SecretStr

MASK = "***"
# Credentials the storage and HTTP clients read from the environment themselves.
ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "OPENAI_API_KEY")
# user:password@ in any URL (an engine's address, a backend's, a store's): masked without registering it
USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
# the same with no scheme (`alice:pw@host:10001`, as Ray and Dask addresses may be written)
BARE_USERINFO = re.compile(r"(?<![\w.%+:/-])[\w.%+-]+:(?!//)[^\s@'\"]+@")
# A secret shorter than this is masked only where it stands alone (not inside a longer word)
WHOLE_BELOW = 8
_lock = threading.Lock()
_installed = False


class _Secrets:
    """The process's secrets and their replacement. Log records hold this object rather than reading the
    module's globals, which the interpreter clears at exit while a thread or a finalizer may still log."""

    mask = MASK
    format_exception = staticmethod(traceback.format_exception)

    def __init__(self) -> None:
        self.values: frozenset[str] = frozenset()

    def redact(self, text: str) -> str:
        if "@" in text:
            text = BARE_USERINFO.sub(f"{self.mask}@", USERINFO.sub(rf"\1{self.mask}@", text))
        for secret in sorted(self.values, key=len, reverse=True):
            if secret not in text:
                continue
            if len(secret) < WHOLE_BELOW:  # `s` masked inside every word left nothing readable; `1`
                # masked inside 127.0.0.1:8000 broke the address a report names (a short key is alone
                # where it stands between spaces, quotes, `=` or `,`, not inside a number or a URL)
                text = re.sub(rf"(?<![\w.:/@-]){re.escape(secret)}(?![\w.:/@-])", self.mask, text)
            else:
                text = text.replace(secret, self.mask)
        return text

    def redact_traceback(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            record.exc_text = self.redact("".join(self.format_exception(*record.exc_info)).rstrip("\n"))


_SECRETS = _Secrets()


def _secret_values(model: BaseModel) -> set[str]:
    found: set[str] = set()
    for name in type(model).model_fields:
        value: Any = getattr(model, name, None)
        if isinstance(value, SecretStr):
            found.add(value.get_secret_value())
        elif isinstance(value, BaseModel):
            found |= _secret_values(value)
    return found


def register(settings: BaseModel | None = None, *values: str) -> None:
    """Add every SecretStr of `settings`, the environment's credentials and `values` to the redacted set."""
    found = set(values) | {os.environ.get(name, "") for name in ENV_SECRETS}
    if settings is not None:
        found |= _secret_values(settings)
    with _lock:
        _SECRETS.values = _SECRETS.values | {s for s in found if s and s.strip()}
    install_log_redaction()


def registered() -> frozenset[str]:
    """The secrets of this process, to hand to a helper process it starts (never through argv or env)."""
    return _SECRETS.values


class RedactedStream(io.TextIOBase):
    """A text stream that redacts what is written to it (a helper process's stdout and stderr)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def redact(text: str) -> str:
    """`text` with every registered secret replaced by ***, longest first (a key inside another), and every
    URL's user:password@ by ***@."""
    return _SECRETS.redact(text)


def redact_value(value: Any) -> Any:
    """A JSON-ready value with every string in it (keys too) redacted, and nothing else touched: a
    number, a boolean or null is never text, so no mask can change it or break the JSON around it."""
    if isinstance(value, str):
        return _SECRETS.redact(value)
    if isinstance(value, dict):
        return {redact_value(k) if isinstance(k, str) else k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


class _RedactedRecord(logging.LogRecord):
    """A log record whose message and traceback text never carry a registered secret."""

    secrets = _SECRETS

    def getMessage(self) -> str:
        return self.secrets.redact(super().getMessage())


def _wrap_factory(make: Any) -> Any:
    # Bound now: a thread or finalizer that logs while the interpreter exits finds the globals cleared.
    plain, redacted, secrets = logging.LogRecord, _RedactedRecord, _SECRETS

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if type(record) is plain:
            record.__class__ = redacted
        else:
            record.msg, record.args = record.getMessage(), None
            record.msg = secrets.redact(record.msg)
        secrets.redact_traceback(record)
        return record

    return factory


def install_log_redaction() -> None:
    """Every log record created from now on in this process is redacted (console, files, Prefect's API)."""
    global _installed
    with _lock:
        if _installed:
            return
        logging.setLogRecordFactory(_wrap_factory(logging.getLogRecordFactory()))
        _installed = True


def redacted_error(exc: BaseException) -> BaseException:
    """`exc` itself if its text holds no secret; else a RedactedError carrying its class and redacted text."""
    text = str(exc)
    clean = redact(text)
    if clean == text:
        return exc
    return RedactedError(f"{type(exc).__name__}: {clean}")


class RedactedError(Exception):
    """An error whose original text held a secret; the original is dropped so nothing can print it."""
