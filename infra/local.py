"""Start local infrastructure as child processes on loopback: simulator, moto S3, Prefect server.

Shared by the tests, the benchmarks and `infra/local-up.sh`, so each starts servers one way.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int) -> int:
    """The first of `n` consecutive free ports, below Linux's ephemeral range (32768 up), so no
    outgoing connection takes one of them between this check and the server's bind."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000 - n)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no block of {n} free ports found below 32000")


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers at all (any HTTP status), or raise after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError as exc:
            last = exc
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s: {last}")


@dataclass
class Service:
    """A child process serving on `url`; stop() terminates it (and waits), kill() is a crash, and restart()
    starts the same command again on the same port (for replicas that die and come back mid-run)."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    env: dict[str, str] = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    health_path: str = "/health"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL, as a crashed server: open connections are dropped without an answer."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self, timeout_s: float = 30.0) -> None:
        """Stop it if it still runs, then start the same command; returns once it answers again."""
        if not self.cmd:
            raise RuntimeError(f"{self.name} at {self.url} was not started with a command to restart")
        self.stop()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL)
        try:
            wait_http(f"{self.url}{self.health_path}", timeout_s, self.proc)
        except Exception:
            self.proc.kill()
            raise


def _simulator_cmd(port: int, args: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollflow.infra.simulator",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def _await_healthy(services: list[Service]) -> list[Service]:
    """Wait until every started service answers; on any failure all of them are killed."""
    try:
        for service in services:
            wait_http(f"{service.url}{service.health_path}", 30, service.proc)
    except Exception:
        for service in services:
            service.kill()
        raise
    return services


def spawn_simulator(*args: str, port: int | None = None) -> Service:
    """`python -m rollflow.infra.simulator` on 127.0.0.1; returns once it answers /health."""
    port = port or free_port()
    cmd = _simulator_cmd(port, args)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    return _await_healthy([Service("simulator", proc, f"http://127.0.0.1:{port}", cmd=cmd)])[0]


def spawn_replicas(replicas: list[tuple[int, float]], *args: str) -> list[Service]:
    """One simulator process per (slots, latency_ms), each on its own port and restartable on it.

    The processes start together; `args` are further simulator flags shared by all (e.g. the metrics format).
    """
    ports: set[int] = set()
    for _ in range(10 * len(replicas)):
        if len(ports) == len(replicas):
            break
        ports.add(free_port())
    services = []
    for (slots, latency_ms), port in zip(replicas, sorted(ports), strict=True):
        cmd = _simulator_cmd(port, ("--slots", str(slots), "--latency-ms", str(latency_ms), *args))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        services.append(Service("simulator", proc, f"http://127.0.0.1:{port}", cmd=cmd))
    return _await_healthy(services)


def spawn_moto(port: int | None = None) -> Service:
    """An S3-compatible store (moto_server) on 127.0.0.1, with the env vars s3fs needs to reach it."""
    port = port or free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, 30, proc)
    except Exception:
        proc.kill()
        raise
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return Service("s3", proc, url, env)


def spawn_prefect_server(
    port: int | None = None,
    home: str | None = None,
    settings: dict[str, str] | None = None,
    timeout_s: float = 90.0,
) -> Service:
    """`prefect server start` (SQLite) on 127.0.0.1; PREFECT_API_URL for clients is in .env."""
    port = port or free_port()
    home = home or tempfile.mkdtemp(prefix="rollflow-prefect-")
    env = dict(os.environ)
    env.update(
        {
            "PREFECT_HOME": home,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": env.get("PREFECT_UI_ENABLED", "true"),
            "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
            **(settings or {}),
        }
    )
    exe = Path(sys.executable).with_name("prefect")
    proc = subprocess.Popen(
        [str(exe), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/api/health", timeout_s, proc)
    except Exception:
        proc.kill()
        raise
    return Service("prefect", proc, url, {"PREFECT_API_URL": f"{url}/api"})


def up() -> int:
    """Prefect server, moto S3 and the simulator on loopback until Ctrl-C; prints what to export."""
    import signal
    import threading

    stop = threading.Event()
    # A handler, not a blocked signal mask: children inherit a mask, and would then ignore terminate().
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    services: list[Service] = []
    # The Prefect server's first start creates its database: on a loaded machine that takes minutes.
    prefect_s = float(os.environ.get("ROLLFLOW_PREFECT__START_TIMEOUT_S") or 180)
    try:
        for start in (
            lambda: spawn_prefect_server(timeout_s=prefect_s),
            spawn_moto,
            lambda: spawn_simulator("--latency-ms", "50", "--slots", "64"),
        ):
            if stop.is_set():
                return 130
            services.append(start())
        prefect, s3, sim = services
        print(f"Prefect UI     {prefect.url}")
        print(f"S3 (moto)      {s3.url}")
        print(f"simulator      {sim.url}  (agent /run, /v1/responses, /v1/chat/completions)")
        print("\nexport these in another shell:")
        for key, value in {**prefect.env, **s3.env, "ROLLFLOW_BACKEND__URL": sim.url}.items():
            print(f"  export {key}={value}")
        print("\nCtrl-C stops all three.", flush=True)
        while not stop.wait(0.5):
            pass
    except (TimeoutError, RuntimeError) as exc:  # one paragraph: what was waited for, how long, what to do
        print(
            f"make up: {exc}. A first start on a busy machine can take longer: set "
            f"ROLLFLOW_PREFECT__START_TIMEOUT_S above {prefect_s:g} (seconds) or free the machine, then run "
            "`make up` again. Nothing else was left running.",
            file=sys.stderr,
        )
        return 1
    finally:
        for service in reversed(services):
            service.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(up() if sys.argv[1:] == ["up"] else 2)
