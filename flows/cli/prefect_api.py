"""Which Prefect API a command's runs go to, found and started before the flows are imported.

Prefect's own order stands: a configured `PREFECT_API_URL` (env, .env or profile) wins. Without one,
a `prefect server` already answering at the profile's server address (`PREFECT_SERVER_API_HOST`/`PORT`,
where `prefect server start [--background]` listens) is used, so its UI shows the run; otherwise
Prefect's ephemeral server is started in a thread while the rest of the command loads.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

HEALTH_TIMEOUT_S = 0.3


@dataclass
class PrefectApi:
    """Where this command's runs go: `url` (None until the ephemeral server is up) and how it was chosen."""

    url: str | None
    source: str  # "configured", "local server", "ephemeral"
    _starting: threading.Thread | None = None
    _error: list[BaseException] = field(default_factory=list)
    stopped_at: float | None = None
    began_s: float = 0.0  # seconds from the command's start to its first Prefect import

    def wait(self) -> None:
        """Block until the ephemeral server answers (it was started in a thread); re-raise its failure."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._error:
            raise self._error[0]

    def stop_ephemeral(self) -> None:
        """Stop Prefect's ephemeral server now rather than at exit, so the command's end can be timed."""
        if self.source == "ephemeral":
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().stop()
        self.stopped_at = time.time()


def answers(api_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when a Prefect API answers its health check at `api_url` (loopback, so quickly either way)."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def choose_api(started_at: float) -> PrefectApi:
    """Configured URL, else a running local server at the profile's server address, else ephemeral."""
    began_s = max(0.0, time.time() - started_at)
    api = _choose()
    api.began_s = began_s
    return api


def _choose() -> PrefectApi:
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return PrefectApi(str(settings.api.url), "configured")
    host = settings.server.api.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    local = f"http://{host}:{settings.server.api.port}/api"
    if answers(local):
        return PrefectApi(local, "local server")
    api = PrefectApi(None, "ephemeral")
    if settings.server.ephemeral.enabled:
        api._starting = threading.Thread(target=_start_ephemeral, args=(api,), daemon=True)
        api._starting.start()
    return api


def _start_ephemeral(api: PrefectApi) -> None:
    """The same server Prefect's client would start on first use; started earlier, it is simply reused."""
    try:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        server.start()
        api.url = server.api_url
    except BaseException as exc:  # re-raised by wait() in the main thread
        api._error.append(exc)


@contextmanager
def using(api: PrefectApi) -> Iterator[None]:
    """Run the enclosed flows against `api` (Prefect's own temporary_settings, nothing patched)."""
    api.wait()
    if api.source != "local server":
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api.url}):
        yield
