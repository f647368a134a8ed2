"""Loopback helpers shared by every fixture that starts a server."""

from __future__ import annotations

import socket
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    """Poll `url` until it answers at all (any status), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError as exc:
            last = exc
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s: {last}")
