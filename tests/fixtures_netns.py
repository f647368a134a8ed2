"""`ray_world`: Prefect, moto S3 and a 2-node Ray cluster in a private loopback-only network namespace.

Ray's processes use the machine's own address even when given 127.0.0.1, so a Ray test runs everything in
`unshare -rn --pid` (tests/netns_world.py) and drives it over a JSON-lines pipe: the host's pytest process
cannot reach the servers in there, and nothing in there can reach out. One world per session: it takes
~15-25 s to start on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_prefect import home_with_db

WORLD_SCRIPT = Path(__file__).with_name("netns_world.py")
UNSHARE = ["unshare", "-rn", "--pid", "--fork", "--kill-child", "--mount-proc"]
READY_TIMEOUT_S = 150.0
REPLY_MARGIN_S = 30.0


class WorldError(RuntimeError):
    """The world answered a command with an error, or did not answer in time."""


@dataclass
class RunResult:
    """What a command run inside the world did; `rc` is None while a spawned one still runs."""

    rc: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    timed_out: bool = False
    running: bool = False

    def check(self) -> RunResult:
        """Raise with both output tails unless the command ended with rc 0."""
        if self.rc != 0:
            raise AssertionError(f"rc={self.rc} timed_out={self.timed_out}\n{self.stdout}\n{self.stderr}")
        return self


def unshare_permitted() -> str | None:
    """None if an unprivileged user+net+pid namespace can be made here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) is not installed"
    try:
        probe = subprocess.run(
            [*UNSHARE, "sh", "-c", "ip link set lo up"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        return f"unshare -rn --pid is not permitted here: {probe.stderr.strip()[-300:]}"
    return None


class RayWorld:
    """A handle on the world process; each method is one command of tests/netns_world.py."""

    def __init__(self, root: Path, num_cpus: int = 1) -> None:
        self.root = root
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._seq = 0
        t0 = time.monotonic()
        self._stderr = (root / "unshare.err").open("wb")
        self._proc = subprocess.Popen(
            [*UNSHARE, sys.executable, str(WORLD_SCRIPT), "--dir", str(root), "--num-cpus", str(num_cpus)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            start_new_session=True,  # kill_group() takes unshare and anything it left
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            ready = self._replies.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            self.kill_group()
            raise WorldError(f"world not ready within {READY_TIMEOUT_S}s; see {root}/logs") from None
        if not ready or not ready.get("ready"):
            self.kill_group()
            raise WorldError(f"world failed to start: {json.dumps(ready, indent=1)[-6000:]}")
        self.startup_s = time.monotonic() - t0
        self.info: dict[str, Any] = ready
        self.ray_address: str = ready["ray_address"]
        self.timings: dict[str, float] = ready["timings"]

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self._replies.put(json.loads(line))
        self._replies.put(None)  # the world exited

    def call(self, cmd: str, reply_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Send one command and wait (bounded) for its reply; raise WorldError on an error reply."""
        with self._lock:
            if self._proc.poll() is not None:
                raise WorldError(f"the world has exited ({self._proc.returncode})")
            assert self._proc.stdin is not None
            self._seq += 1
            self._proc.stdin.write(json.dumps({"cmd": cmd, "seq": self._seq, **fields}) + "\n")
            self._proc.stdin.flush()
            deadline = time.monotonic() + reply_s
            while True:  # a late reply to an earlier, timed-out command is dropped here
                try:
                    reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise WorldError(f"no reply to {cmd!r} within {reply_s}s") from None
                if reply is None or reply.get("seq") == self._seq:
                    break
        if reply is None:
            raise WorldError(f"the world exited while running {cmd!r}")
        if not reply.get("ok"):
            raise WorldError(f"{cmd}: {reply.get('error')}\n{reply.get('trace', '')}")
        return reply

    def env(self) -> dict[str, str]:
        """What a child needs to reach the world's servers (PREFECT_API_URL, AWS_*, RAY_*)."""
        return dict(self.call("env")["env"])

    def run(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        cwd: str | None = None,
        input: str | None = None,
    ) -> RunResult:
        """Run a command to completion inside the namespace (killed at `timeout`)."""
        reply = self.call(
            "run", timeout + REPLY_MARGIN_S, args=list(args), env=env, timeout=timeout, cwd=cwd, input=input
        )
        return RunResult(
            reply["rc"], reply["stdout"], reply["stderr"], reply["elapsed_s"], reply["timed_out"]
        )

    def python(self, code: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> RunResult:
        """`python -c code` with the venv's interpreter inside the namespace."""
        return self.run([sys.executable, "-c", code], env=env, timeout=timeout)

    def spawn(self, args: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        """Start a command in the background (its own process group); returns its id for wait()/kill()."""
        return int(self.call("spawn", args=list(args), env=env, cwd=cwd)["id"])

    def wait(self, id: int, timeout: float = 60.0) -> RunResult:
        """Wait up to `timeout` s for a spawned command; `running` is True if it has not ended."""
        r = self.call("wait", timeout + REPLY_MARGIN_S, id=id, timeout=timeout)
        return RunResult(r["rc"], r["stdout"], r["stderr"], r["elapsed_s"], running=r["running"])

    def pids(self, match: str) -> list[int]:
        """Pids (in the namespace's pid view) whose command line contains `match`."""
        return [int(p) for p in self.call("pids", match=match)["pids"]]

    def procs(self, match: str) -> list[dict[str, Any]]:
        """Like pids(), with each command line."""
        return list(self.call("pids", match=match)["procs"])

    def kill(
        self, pid: int | None = None, signal: int = 9, *, id: int | None = None, node: str | None = None
    ) -> bool:
        """Signal a pid, a spawned id's process group, or a Ray node ("head"/"worker") as a whole machine."""
        target = {"pid": pid} if pid is not None else {"id": id} if id is not None else {"node": node}
        return bool(self.call("kill", signal=signal, **target)["signalled"])

    def sockets(self) -> dict[str, Any]:
        """All inet sockets in the namespace: `sockets`, `addresses`, `non_loopback` and `ip_addr`."""
        return self.call("sockets")

    def simulate(self, args: Sequence[str] = (), timeout: float = 30.0) -> str:
        """Start `rollflow simulate ARGS` on a free port inside the world; returns its URL."""
        return str(self.simulate_full(args, timeout)["url"])

    def simulate_full(self, args: Sequence[str] = (), timeout: float = 30.0) -> dict[str, Any]:
        """simulate(), with the spawned id (for kill(id=...)) and one URL per --replica."""
        return self.call("simulate", timeout + REPLY_MARGIN_S, args=list(args), timeout=timeout)

    def bucket(self, name: str) -> str:
        """Create an S3 bucket in the world's moto; returns `s3://name`."""
        return str(self.call("bucket", name=name)["url"])

    def stop(self, timeout: float = 60.0) -> None:
        """Stop cleanly; if that does not finish in `timeout`, kill unshare (and so the namespace)."""
        with contextlib.suppress(WorldError, OSError, ValueError):
            self.call("stop", timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(15)
        self.kill_group()  # a no-op after a clean stop

    def kill_group(self) -> None:
        """SIGKILL unshare's process group; --kill-child takes the namespace's init and so all inside."""
        if self._proc.poll() is None:  # once reaped, its pgid could be another's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(10)
        self._reader.join(5)  # EOF once the world is gone; then its pipes can close
        for pipe in (self._proc.stdin, self._proc.stdout, self._stderr):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()


@pytest.fixture(scope="session")
def ray_world(prefect_db: Path) -> Iterator[RayWorld]:
    """One namespace world per session, stopped at its end (its files under a short /tmp/rfr-* dir)."""
    reason = unshare_permitted()
    if reason is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="rfr-", dir="/tmp"))  # short: Unix socket paths end at 107 chars
    home_with_db(root / "prefect-home", prefect_db)  # the world's Prefect server starts on it
    world = RayWorld(root)
    try:
        yield world
    finally:
        world.stop()
        shutil.rmtree(root, ignore_errors=True)
