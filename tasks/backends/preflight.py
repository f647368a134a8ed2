"""Checks that fail a run in seconds, before any chunk starts, when the backend cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class BackendUnreachable(Exception):
    """The backend's host does not accept connections; nothing was sent."""


async def check_reachable(url: str, timeout_s: float, what: str = "backend") -> None:
    """Open (and close) one TCP connection to `url`'s host and port; of a comma list, to any of them.

    One replica up is enough to start: the others leave rotation at their first refused request.
    """
    urls = [u.strip() for u in url.split(",")] if "," in url else [url]
    if len(urls) == 1:
        return await _check_one(url, timeout_s, what)
    checks = [_check_one(u, timeout_s, what) for u in urls]
    results = await asyncio.gather(*checks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if len(errors) < len(urls):
        return None
    reasons = " ".join(str(e).split(". Start it")[0] + "." for e in errors)
    raise BackendUnreachable(
        f"All {len(urls)} {what} endpoints are unreachable: {reasons} Start them, or point rollflow at "
        f"running ones with --backend-url. No request was sent and every chunk already committed under "
        f"the output is kept; run the same command again once they are up."
    )


async def _check_one(url: str, timeout_s: float, what: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BackendUnreachable(
            f"The {what} URL {url!r} is not an http(s) URL. Pass e.g. --backend-url http://127.0.0.1:8000."
        )
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except (OSError, TimeoutError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise BackendUnreachable(
            f"The {what} at {parts.scheme}://{parts.hostname}:{port} is unreachable ({reason}). "
            f"Start it, or point rollflow at a running one with --backend-url. No request was sent and "
            f"every chunk already committed under the output is kept; run the same command again once "
            f"it is up."
        ) from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
