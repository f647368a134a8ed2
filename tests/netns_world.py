"""A private world for Ray tests: Prefect, moto S3 and a 2-node Ray cluster inside a loopback-only netns.

Run as `unshare -rn --pid --fork --kill-child --mount-proc <python> tests/netns_world.py --dir DIR`
(tests/fixtures_netns.py does). Why a namespace: outside one, Ray's processes talk over the machine's own
address even when told 127.0.0.1; inside, loopback is the only interface, and every process dies with it.

Protocol (JSON lines; pipes work across namespaces): one line `{"ready": true, ...}` (or `{"ready": false,
"error": ..., "log_tail": ...}`), then one reply line (echoing its `seq`) per command line read from stdin.
Commands: env, info, run, spawn, wait, pids, kill, sockets, simulate, bucket, stop. EOF on stdin is a stop.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rollflow.infra.local import Service, free_port, spawn_moto, spawn_prefect_server, wait_http

BIN = Path(sys.executable).parent
TAIL = 20_000
RAY_START_S = 120.0
TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
    "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}  # fmt: skip


def tail(path: Path, limit: int = TAIL) -> str:
    """The end of a log file ('' if it does not exist), for error replies that must not hang or flood."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def run_as_init() -> None:
    """As PID 1, fork: the child is the world, this process only reaps orphans (Ray daemons end up here).

    A separate init keeps the world's own Popen.wait() results intact: a reaper in the same process would
    steal them. When the world exits, so does init, and the kernel kills everything left in the namespace.
    """
    child = os.fork()
    if child == 0:
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda _s, _f: _kill_quietly(child))
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@dataclass
class Proc:
    """A command the world started in the background; its output goes to files under DIR/procs."""

    id: int
    args: list[str]
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    started: float = field(default_factory=time.monotonic)

    def result(self) -> dict[str, Any]:
        rc = self.proc.poll()
        return {
            "id": self.id,
            "pid": self.proc.pid,
            "running": rc is None,
            "rc": rc,
            "stdout": tail(self.out),
            "stderr": tail(self.err),
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }


class World:
    """The servers and the Ray cluster of one namespace, and the command handlers over them."""

    def __init__(self, root: Path, num_cpus: int, object_store_bytes: int) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.num_cpus = num_cpus
        self.object_store_bytes = object_store_bytes
        self.ray_tmp = root / "ray"
        self.ray_tmp.mkdir(exist_ok=True)
        self.services: list[Service] = []
        self.nodes: dict[str, Proc] = {}
        self.procs: dict[int, Proc] = {}
        self.next_id = 1
        self.base_env: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.ray_port = 0
        self.s3_env: dict[str, str] = {}

    # start-up

    def start(self) -> dict[str, Any]:
        """moto first (the Ray nodes get its keys, as a worker host has its own), then Prefect in a thread
        while the Ray nodes start one after the other."""
        t0 = time.monotonic()
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
        s3 = self._timed("s3_s", self._start_moto)
        self.s3_env = dict(s3.env)
        with ThreadPoolExecutor(2) as pool:
            futures = {
                "prefect": pool.submit(self._timed, "prefect_s", self._start_prefect),
                "ray": pool.submit(self._timed, "ray_s", self._start_ray),
            }
            services = {name: fut.result() for name, fut in futures.items()}  # the first error propagates
        prefect = services["prefect"]
        self.base_env = {
            **prefect.env,
            **s3.env,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_HOME": str(self.root / "client-home"),
            "RAY_ADDRESS": f"127.0.0.1:{self.ray_port}",
            "RAY_TMPDIR": str(self.ray_tmp),
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.timings["total_s"] = round(time.monotonic() - t0, 3)
        return self.info()

    def _timed(self, key: str, start: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return start()
        finally:
            self.timings[key] = round(time.monotonic() - t0, 3)

    def _start_prefect(self) -> Service:
        home = self.root / "prefect-home"
        home.mkdir(exist_ok=True)
        server = spawn_prefect_server(home=str(home), settings={"PREFECT_UI_ENABLED": "false"})
        self.services.append(server)
        return server

    def _start_moto(self) -> Service:
        s3 = spawn_moto()
        self.services.append(s3)
        return s3

    def _ray_env(self, node: str) -> dict[str, str]:
        """A node's env, as on a machine of its own: its S3 keys, no Prefect API URL (the task context
        carries it)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "ROLLFLOW_", "RAY_"))}
        env.update(self.s3_env)
        home = self.root / f"home-{node}"
        home.mkdir(exist_ok=True)
        env.update(
            {
                "RAY_AUTH_MODE": "disabled",
                "RAY_TMPDIR": str(self.ray_tmp),
                "RAY_USAGE_STATS_ENABLED": "0",
                # Ray's client proxy starts each ray:// client's server with Popen(preexec_fn=...): a fork
                # that runs gRPC's fork handlers, and the child's starts an event_engine thread that can
                # segfault before the exec (grpc/grpc#43055): the server died at once, one client in ~4.
                "GRPC_ENABLE_FORK_SUPPORT": "false",
                "PREFECT_HOME": str(home),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            }
        )
        return env

    def _start_ray(self) -> None:
        """Two `ray start --block` process trees, each in its own session: killing one is losing a machine."""
        self.ray_port = free_port()
        common = [
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store_bytes}",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
            "--block",
        ]
        head = [
            str(BIN / "ray"), "start", "--head", f"--port={self.ray_port}", "--include-dashboard=false",
            f"--temp-dir={self.ray_tmp}", *common,
        ]  # fmt: skip
        self._start_node("head", head)
        worker = [str(BIN / "ray"), "start", f"--address=127.0.0.1:{self.ray_port}", *common]
        self._start_node("worker", worker)

    def _start_node(self, name: str, args: list[str]) -> None:
        out = self.logs / f"ray-{name}.log"
        with out.open("wb") as fh:
            proc = subprocess.Popen(
                args, env=self._ray_env(name), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = Proc(0, args, proc, out, out)
        self.nodes[name] = node
        deadline = time.monotonic() + RAY_START_S
        while time.monotonic() < deadline:
            if "will now block forever" in tail(out):
                return
            if proc.poll() is not None:
                raise RuntimeError(f"ray {name} node exited with {proc.returncode}")
            time.sleep(0.2)
        raise TimeoutError(f"ray {name} node not up within {RAY_START_S}s")

    def log_tails(self, limit: int = 4000) -> dict[str, str]:
        return {p.name: tail(p, limit) for p in sorted(self.logs.glob("*.log"))}

    # commands

    def info(self) -> dict[str, Any]:
        return {
            "env": self.base_env,
            "dir": str(self.root),
            "ray_address": f"127.0.0.1:{self.ray_port}",
            "nodes": {name: node.proc.pid for name, node in self.nodes.items()},
            "num_cpus": self.num_cpus,
            "timings": self.timings,
        }

    def child_env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLFLOW_")}
        return {**env, **self.base_env, **(extra or {})}

    def cmd_env(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"env": self.base_env}

    def cmd_info(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.info()

    def cmd_run(self, req: dict[str, Any]) -> dict[str, Any]:
        """Run to completion (or its timeout, then kill its process group) and return the output tails."""
        timeout = float(req.get("timeout", 120))
        t0 = time.monotonic()
        proc = subprocess.Popen(
            req["args"],
            env=self.child_env(req.get("env")),
            cwd=req.get("cwd"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate((req.get("input") or "").encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=10)
        limit = int(req.get("tail", TAIL))
        return {
            "rc": proc.returncode,
            "timed_out": timed_out,
            "stdout": out.decode(errors="replace")[-limit:],
            "stderr": err.decode(errors="replace")[-limit:],
            "elapsed_s": round(time.monotonic() - t0, 3),
        }

    def _spawn(self, args: list[str], env: dict[str, str] | None, cwd: str | None) -> Proc:
        pid_id = self.next_id
        self.next_id += 1
        procs = self.root / "procs"
        procs.mkdir(exist_ok=True)
        out, err = procs / f"{pid_id}.out", procs / f"{pid_id}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            proc = subprocess.Popen(
                args,
                env=self.child_env(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                start_new_session=True,
            )
        self.procs[pid_id] = Proc(pid_id, list(args), proc, out, err)
        return self.procs[pid_id]

    def cmd_spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        proc = self._spawn(req["args"], req.get("env"), req.get("cwd"))
        return {"id": proc.id, "pid": proc.proc.pid}

    def cmd_wait(self, req: dict[str, Any]) -> dict[str, Any]:
        """Wait up to `timeout` s for a spawned command; `running: true` in the reply if it has not ended."""
        proc = self.procs[int(req["id"])]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.proc.wait(float(req.get("timeout", 60)))
        return proc.result()

    def cmd_pids(self, req: dict[str, Any]) -> dict[str, Any]:
        """Processes of the namespace (its own pid view) whose command line contains `match`."""
        match = str(req.get("match", ""))
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            if cmdline and match in cmdline and int(entry.name) != os.getpid():
                found.append({"pid": int(entry.name), "cmdline": cmdline[:500]})
        found.sort(key=lambda p: p["pid"])
        return {"pids": [p["pid"] for p in found], "procs": found}

    def cmd_kill(self, req: dict[str, Any]) -> dict[str, Any]:
        """Signal a pid, a spawned id (its process group) or a Ray node by name (its whole process tree)."""
        sig = int(req.get("signal", signal.SIGKILL))
        if "node" in req:
            target = -self.nodes[str(req["node"])].proc.pid
        elif "id" in req:
            target = -self.procs[int(req["id"])].proc.pid
        else:
            target = int(req["pid"])
        try:
            if target < 0:
                os.killpg(-target, sig)
            else:
                os.kill(target, sig)
        except ProcessLookupError:
            return {"signalled": False}
        return {"signalled": True}

    def cmd_sockets(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every inet socket of the namespace from /proc/net, and which of them are not loopback-only."""
        sockets = []
        for proto in ("tcp", "tcp6", "udp", "udp6"):
            with open(f"/proc/net/{proto}") as fh:
                next(fh)
                for line in fh:
                    fields = line.split()
                    state = TCP_STATES.get(fields[3], fields[3]) if proto.startswith("tcp") else fields[3]
                    sockets.append(
                        {
                            "proto": proto,
                            "local": _addr(fields[1]),
                            "remote": _addr(fields[2]),
                            "state": state,
                        }
                    )
        outside = [s for s in sockets if not (_is_local(s["local"][0]) and _is_local(s["remote"][0]))]
        addrs = sorted({s["local"][0] for s in sockets} | {s["remote"][0] for s in sockets})
        ip_addr = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        return {"sockets": sockets, "addresses": addrs, "non_loopback": outside, "ip_addr": ip_addr}

    def cmd_simulate(self, req: dict[str, Any]) -> dict[str, Any]:
        """`rollflow simulate` on a free port; the reply has its URL (and one per --replica)."""
        args = [str(x) for x in req.get("args", [])]
        port = free_port()
        cmd = [str(BIN / "rollflow"), "simulate", "--host", "127.0.0.1", "--port", str(port), *args]
        proc = self._spawn(cmd, req.get("env"), None)
        expected = max(1, args.count("--replica") + sum(a.startswith("--replica=") for a in args))
        deadline = time.monotonic() + float(req.get("timeout", 30))
        urls: list[str] = []
        while time.monotonic() < deadline:
            urls = [
                line.rsplit(" ", 1)[-1]
                for line in tail(proc.out).splitlines()
                if line.startswith("rollflow simulator listening on ")
            ]
            if len(urls) >= expected or proc.proc.poll() is not None:
                break
            time.sleep(0.1)
        if len(urls) < expected:
            proc.proc.kill()
            raise RuntimeError(f"simulator did not start: {proc.result()}")
        for url in urls:
            wait_http(f"{url}/health", 30, proc.proc)  # type: ignore[arg-type]
        return {"id": proc.id, "pid": proc.proc.pid, "url": urls[0], "urls": urls}

    def cmd_bucket(self, req: dict[str, Any]) -> dict[str, Any]:
        import boto3

        env = self.base_env
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )
        client.create_bucket(Bucket=str(req["name"]))
        return {"bucket": str(req["name"]), "url": f"s3://{req['name']}"}

    def stop(self) -> dict[str, Any]:
        """Spawned commands, then `ray stop`, then the servers; whatever is left dies with the namespace."""
        t0 = time.monotonic()
        steps: dict[str, float] = {}
        for proc in self.procs.values():
            _end_group(proc.proc)
        steps["procs_s"] = round(time.monotonic() - t0, 3)
        ray_rc: int | None = None
        if self.nodes:
            try:
                ray_rc = subprocess.run(
                    [str(BIN / "ray"), "stop", "--grace-period", "10"],
                    env=self._ray_env("head"),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=40,
                ).returncode
            except subprocess.TimeoutExpired:
                ray_rc = None
            steps["ray_stop_s"] = round(time.monotonic() - t0, 3)
            for node in self.nodes.values():  # `--block` monitors left; on SIGTERM they would drain for 30 s
                _end_group(node.proc, grace_s=0)
            steps["nodes_s"] = round(time.monotonic() - t0, 3)
        for service in reversed(self.services):
            service.stop()
        steps["services_s"] = round(time.monotonic() - t0, 3)
        return {"stopped": True, "ray_stop_rc": ray_rc, "steps": steps}


def _end_group(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM a process group, SIGKILL it if its leader is still there after `grace_s` (0: at once)."""
    if proc.poll() is None and grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _addr(field: str) -> tuple[str, int]:
    """/proc/net's `HEX:PORT` (the address in host byte order, 32-bit word by word) as (ip, port)."""
    hexaddr, hexport = field.split(":")
    raw = bytes.fromhex(hexaddr)
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, swapped), int(hexport, 16)


def _is_local(ip: str) -> bool:
    """Loopback, or unspecified (0.0.0.0/:: bound is reachable only over lo here; as remote: unconnected)."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_unspecified


def serve(world: World, cmd_in: IO[str], reply: Callable[[dict[str, Any]], None]) -> None:
    """One reply line per command line, echoing its `seq`; an error becomes `{"ok": false, "error": ...}`."""
    for line in cmd_in:
        if not line.strip():
            continue
        seq = None
        try:
            req = json.loads(line)
            name, seq = req.get("cmd"), req.get("seq")
            if name == "stop":
                reply({"ok": True, "seq": seq, **world.stop()})
                return
            handler = getattr(world, f"cmd_{name}", None)
            if handler is None:
                raise ValueError(f"unknown command {name!r}")
            reply({"ok": True, "seq": seq, **handler(req)})
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            reply({"ok": False, "seq": seq, "error": error, "trace": traceback.format_exc()})
    world.stop()  # EOF: the test process went away


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, type=Path, help="the world's files (keep the path short)")
    parser.add_argument("--num-cpus", type=int, default=1, help="logical CPUs of each Ray node")
    parser.add_argument("--object-store-mb", type=int, default=128, help="object store of each Ray node")
    args = parser.parse_args()
    if os.getpid() == 1:
        run_as_init()
    # The protocol owns the original stdin/stdout; fd 0/1 of every child are /dev/null and a log file.
    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    cmd_in = os.fdopen(os.dup(0), "r")
    args.dir.mkdir(parents=True, exist_ok=True)
    world_log = os.open(args.dir / "world.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(world_log, 1)
    os.dup2(world_log, 2)
    lock = threading.Lock()

    def reply(msg: dict[str, Any]) -> None:
        with lock:
            proto_out.write(json.dumps(msg, default=str) + "\n")
            proto_out.flush()

    world = World(args.dir, args.num_cpus, args.object_store_mb * 1024 * 1024)
    try:
        info = world.start()
    except Exception as exc:
        reply(
            {
                "ready": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
                "timings": world.timings,
                "log_tail": world.log_tails(),
            }
        )
        world.stop()
        return 1
    reply({"ready": True, **info})
    serve(world, cmd_in, reply)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
