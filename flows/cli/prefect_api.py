"""Which Prefect API a command's runs go to, found (or started) before the flows are imported.

Prefect's own order stands: a configured `PREFECT_API_URL` (env, .env or profile) wins. Without one, a
server answering at the profile's server address (`PREFECT_SERVER_API_HOST`/`PORT`, where `prefect server
start` listens) is used, so its UI shows the run. Otherwise, by `ROLLFLOW_PREFECT__LOCAL_SERVER`: `keep`
starts a lasting server there (flows/cli/local_server.py) for this run and the next ones; `ephemeral`
starts Prefect's temporary server in a thread. Either way the command loads its flows meanwhile.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollflow.flows.cli.errors import UsageError, load_settings
from rollflow.flows.cli.idle_stop import start_watcher
from rollflow.flows.cli.local_server import (
    LocalServer,
    LocalServerError,
    answers,
    free_port,
    owned_port,
    port_busy,
    serves_home,
)

Source = Literal["configured", "local server", "local server, started", "ephemeral"]


@dataclass
class PrefectApi:
    """Where this command's runs go: `url` (None until an ephemeral server is up) and how it was chosen."""

    url: str | None
    source: Source
    _starting: threading.Thread | None = None
    _error: list[BaseException] = field(default_factory=list)
    _local: LocalServer | None = None
    start_timeout_s: float = 180.0
    stopped_at: float | None = None
    began_s: float = 0.0  # seconds from the command's start to its first Prefect import

    def wait(self) -> None:
        """Block until the server being started answers; re-raise its failure."""
        if self._local is not None:
            self._local.wait(self.start_timeout_s)
            self._local = None
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


def command_api(started_at: float) -> PrefectApi:
    """The API of a command's runs, chosen as ROLLFLOW_PREFECT__* say (a bad setting is a UsageError)."""
    prefect = load_settings().prefect
    return choose_api(started_at, prefect.local_server, prefect.start_timeout_s, prefect.idle_stop_s)


def choose_api(
    started_at: float, local_server: str = "keep", start_timeout_s: float = 180.0, idle_stop_s: float = 0.0
) -> PrefectApi:
    """Configured URL, else a server at the profile's address, else one started per `local_server`."""
    began_s = max(0.0, time.time() - started_at)
    api = _choose(local_server, start_timeout_s, idle_stop_s)
    api.began_s, api.start_timeout_s = began_s, start_timeout_s
    return api


def _choose(local_server: str, start_timeout_s: float, idle_stop_s: float) -> PrefectApi:
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return PrefectApi(str(settings.api.url), "configured")
    home = Path(settings.home)
    port = owned_port(home, settings.server.api.port)
    if port is not None:  # this PREFECT_HOME's own kept server, up or starting
        local = f"http://127.0.0.1:{port}/api"
        if answers(local):
            return PrefectApi(local, "local server")
        return _start_local(LocalServer(home, port), idle_stop_s)
    local = f"http://127.0.0.1:{settings.server.api.port}/api"
    if answers(local) and serves_home(local, home):  # started by hand with this home
        return PrefectApi(local, "local server")
    if local_server == "keep":
        port = settings.server.api.port
        if port_busy(port):
            taken, port = port, free_port()
            _say(f"127.0.0.1:{taken} is taken by a server of another PREFECT_HOME (or another program); "
                 f"this PREFECT_HOME ({home}) gets its own kept server on port {port}")  # fmt: skip
        return _start_local(LocalServer(home, port), idle_stop_s)
    api = PrefectApi(None, "ephemeral")
    if settings.server.ephemeral.enabled:
        api._starting = threading.Thread(target=_start_ephemeral, args=(api, start_timeout_s), daemon=True)
        api._starting.start()
    return api


def _start_local(server: LocalServer, idle_stop_s: float) -> PrefectApi:
    try:
        started = server.start()
    except LocalServerError as exc:  # its home cannot hold it: said before any work, as a usage error
        raise UsageError(str(exc)) from None
    if started:
        start_watcher(server.home, server.api_url, idle_stop_s)
        idle = f"it stops after {idle_stop_s:g} s idle, " if idle_stop_s > 0 else ""
        _say(
            f"no Prefect API configured: started a Prefect server that stays for later runs, UI "
            f"{server.ui_url} ({idle}ROLLFLOW_PREFECT__IDLE_STOP_S sets when; `prefect server stop` "
            f"stops it; ROLLFLOW_PREFECT__LOCAL_SERVER=ephemeral to not keep one); waiting for it to answer "
            f"(its first start creates its database; ROLLFLOW_PREFECT__START_TIMEOUT_S bounds the wait)"
        )
        return PrefectApi(server.api_url, "local server, started", _local=server)
    _say(f"waiting for the Prefect server starting at {server.ui_url}")
    return PrefectApi(server.api_url, "local server", _local=server)


def _say(text: str) -> None:
    sys.stderr.write(f"rollflow: {text}\n")
    sys.stderr.flush()


def _start_ephemeral(api: PrefectApi, timeout_s: float) -> None:
    """The same server Prefect's client would start on first use; started earlier, it is simply reused."""
    try:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        server.start(timeout=max(1, round(timeout_s)))
        api.url = server.api_url
    except BaseException as exc:  # re-raised by wait() in the main thread
        api._error.append(exc)


@contextmanager
def using(api: PrefectApi) -> Iterator[None]:
    """Run the enclosed flows against `api` (Prefect's own temporary_settings, nothing patched)."""
    api.wait()
    if api.source in ("configured", "ephemeral"):
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api.url}):
        yield
