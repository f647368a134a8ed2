"""A real NeMo Gym 0.7.0 server stack on 127.0.0.1, for tests that talk to NeMo Gym rather than a fake of it.

What starts, each in its own session so `stop()` can end every process it left behind:

- two stub models (stub_model.py, names A and B), so a reply says which agent's model wrote it;
- a Ray head (`ray start --head --block`) bound to 127.0.0.1, because `gym env start` always joins or
  starts a Ray cluster, and one it starts itself binds the host's address and the fixed dashboard port;
- `gym env start` with one config file: a head server on the given port, a `string_match` resources
  server, and per agent (`agent_a`, `agent_b`) a `simple_agent`, its own `openai_model` model server
  pointed at its stub, and a `legacy_agent` environment server in front of it (rollout collection
  posts `/run` to the environment server, never to the agent).

Offline: `+skip_venv_if_present=true` with `+uv_venv_dir` pointing at a tree of `.venv` links to the
NeMo Gym venv makes every server run from that venv with no `uv venv` or `uv pip install`.

`python stack.py --dir D --head-port P` starts it and runs until interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollflow.infra.local import free_port
from rollflow.infra.sessions import default_sigint, end_session, tail

HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path(os.environ.get("ROLLFLOW_NEMO_GYM_VENV", Path.home() / ".cache/rollflow/nemo-gym-0.7.0"))
AGENTS = {"agent_a": "A", "agent_b": "B"}  # agent name -> the stub its model server calls
RESOURCES_SERVER = "string_match"
SERVER_KINDS = ("resources_servers", "responses_api_models", "responses_api_agents", "environment_servers")
# Server directories the config uses: each gets a `.venv` link under uv_venv_dir.
SERVER_DIRS = (
    "resources_servers/string_match",
    "responses_api_models/openai_model",
    "responses_api_agents/simple_agent",
    "environment_servers/legacy_agent",
)
LISTENING = re.compile(r"listening on (http://\S+)")
START_TIMEOUT_S = 240.0


def _spawn(
    args: list[str], log: Path, env: dict[str, str], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start a process in its own session with stdout and stderr in `log`, and SIGINT able to stop it."""
    with log.open("ab") as out:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=default_sigint,
        )  # fmt: skip


def _wait_for_log(
    proc: subprocess.Popen[bytes], log: Path, pattern: re.Pattern[str], timeout_s: float
) -> str:
    """Wait until `pattern` shows in `log` and return its first group (or the match), bounded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = pattern.search(tail(log, 200_000))
        if found:
            return found.group(1) if pattern.groups else found.group(0)
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}:\n{tail(log)}")
        time.sleep(0.1)
    raise TimeoutError(f"{pattern.pattern!r} not in {log} within {timeout_s}s:\n{tail(log)}")


def nemo_gym_env() -> dict[str, str]:
    """The environment for NeMo Gym and Ray: rollflow's venv and any outside Ray cluster left out."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "RAY_ADDRESS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


def stack_config(stub_urls: dict[str, str]) -> dict[str, Any]:
    """The NeMo Gym config: one resources server, and per agent a model server, an agent and its relay."""
    config: dict[str, Any] = {
        RESOURCES_SERVER: {
            "resources_servers": {
                "string_match": {
                    "entrypoint": "app.py",
                    "domain": "knowledge",
                    "verified": False,
                    "description": "string matching verifier (rollflow test stack)",
                    "value": "scores the stub's reply against expected_answer",
                }
            }
        }
    }
    for agent, stub in AGENTS.items():
        model = f"model_{stub.lower()}"
        config[model] = {
            "responses_api_models": {
                "openai_model": {
                    "entrypoint": "app.py",
                    "openai_base_url": f"{stub_urls[stub]}/v1",
                    "openai_api_key": "stub-key",
                    "openai_model": f"stub-{stub.lower()}",
                }
            }
        }
        config[agent] = {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": RESOURCES_SERVER},
                    "model_server": {"type": "responses_api_models", "name": model},
                }
            }
        }
        config[f"{agent}_environment_server"] = {
            "environment_servers": {
                "legacy_agent": {
                    "entrypoint": "app.py",
                    "agent_server": {"type": "responses_api_agents", "name": agent},
                }
            }
        }
    return config


@dataclass(frozen=True)
class NgServer:
    """One server as the head server's config names it."""

    name: str
    kind: str  # resources_servers, responses_api_models, responses_api_agents or environment_servers
    impl: str  # e.g. simple_agent, legacy_agent
    host: str
    port: int
    config: dict[str, Any]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def parse_servers(config: dict[str, Any]) -> dict[str, NgServer]:
    """Every server in a NeMo Gym global config, by its top-level name."""
    servers = {}
    for name, value in config.items():
        if not isinstance(value, dict) or len(value) != 1:
            continue
        kind, inner = next(iter(value.items()))
        if kind not in SERVER_KINDS or not isinstance(inner, dict) or len(inner) != 1:
            continue
        impl, body = next(iter(inner.items()))
        if isinstance(body, dict) and "port" in body:
            servers[name] = NgServer(name, kind, impl, str(body["host"]), int(body["port"]), body)
    return servers


def http_json(url: str, body: Any = None, timeout_s: float = 60.0) -> Any:
    """GET (or POST `body` as JSON) and decode the JSON reply; raises on an HTTP error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


@dataclass
class Stack:
    """A running stack: where its servers listen, and how to end every process it started."""

    head_url: str
    config: dict[str, Any]
    servers: dict[str, NgServer]
    stub_urls: dict[str, str]  # stub name (A, B) -> its base URL (no /v1)
    log_dir: Path
    venv: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ray_tmp: Path | None = None
    started_in_s: float = 0.0

    @property
    def agents(self) -> list[str]:
        return [s.name for s in self.servers.values() if s.kind == "responses_api_agents"]

    def environment_server(self, agent: str) -> NgServer:
        """The environment server that fronts `agent` (its `agent_server` names it)."""
        for server in self.servers.values():
            if (
                server.kind == "environment_servers"
                and server.config.get("agent_server", {}).get("name") == agent
            ):
                return server
        raise KeyError(f"no environment server fronts {agent!r}: {sorted(self.servers)}")

    def stub_for(self, agent: str) -> str:
        """The name of the stub whose model server `agent` calls."""
        return AGENTS[agent]

    def stub_requests(self, stub: str) -> dict[str, Any]:
        """What stub `stub` saw: {"name", "count", "last": [{"path", "body"}, ...]}."""
        return http_json(f"{self.stub_urls[stub]}/requests", timeout_s=10)

    def bin(self, name: str) -> Path:
        """A NeMo Gym command in the stack's venv, e.g. `ng_collect_rollouts`."""
        return self.venv / "bin" / name

    def log_tail(self, limit: int = 6000) -> str:
        """The end of every log the stack writes, for an assertion message."""
        return "\n".join(f"--- {p.name}\n{tail(p, limit)}" for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        """End NeMo Gym (SIGINT: it stops its servers), then Ray, then the stubs; SIGKILL what remains."""
        order = sorted(
            self.procs, key=lambda name: ("gym", "ray").index(name) if name in ("gym", "ray") else 2
        )
        for name in order:
            end_session(self.procs[name], signal.SIGINT if name == "gym" else signal.SIGTERM)
        self.procs.clear()
        if self.ray_tmp is not None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
            self.ray_tmp = None


def _link_venvs(root: Path, venv: Path) -> None:
    """uv_venv_dir/<kind>/<name>/.venv -> the NeMo Gym venv, so skip_venv_if_present reuses it."""
    for rel in SERVER_DIRS:
        link = root / rel / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(venv, target_is_directory=True)


def _start_ray(stack: Stack, env: dict[str, str]) -> str:
    """A one-node Ray head on 127.0.0.1 with every port picked free; returns its GCS address."""
    # Ray's socket paths must stay under 108 bytes, which a pytest tmp dir can exceed: a short dir in /tmp.
    stack.ray_tmp = Path(tempfile.mkdtemp(prefix="ngray-", dir="/tmp"))
    port = free_port()
    args = [
        str(stack.bin("ray")), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        "--include-dashboard=false", "--disable-usage-stats", "--num-cpus=2",
        "--object-store-memory=134217728", f"--temp-dir={stack.ray_tmp}",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}", "--block",
    ]  # fmt: skip
    log = stack.log_dir / "ray.log"
    stack.procs["ray"] = _spawn(args, log, env)
    _wait_for_log(stack.procs["ray"], log, re.compile("will now block forever"), 120)
    return f"127.0.0.1:{port}"


def _start_stub(stack: Stack, name: str) -> None:
    """One stub model on a free port, its URL read from what it prints."""
    log = stack.log_dir / f"stub_{name}.log"
    args = [sys.executable, str(HERE / "stub_model.py"), "--port", "0", "--name", name]
    stack.procs[f"stub_{name}"] = _spawn(args, log, dict(os.environ))
    stack.stub_urls[name] = _wait_for_log(stack.procs[f"stub_{name}"], log, LISTENING, 30)


def _wait_ready(stack: Stack, deadline: float) -> None:
    """Wait until the head server says ready (NeMo Gym marks it so once every server and model answers)."""
    gym, last = stack.procs["gym"], ""
    while time.monotonic() < deadline:
        if gym.poll() is not None:
            raise RuntimeError(f"gym env start exited with {gym.returncode}")
        try:
            with urllib.request.urlopen(f"{stack.head_url}/readyz", timeout=5) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"head server {stack.head_url} not ready in time (last: {last})")


def start_stack(
    tmp_dir: Path, head_port: int, venv: Path = DEFAULT_VENV, timeout_s: float = START_TIMEOUT_S
) -> Stack:
    """Start stubs, Ray and NeMo Gym in `tmp_dir`; return once every server answers, else raise with logs."""
    started = time.monotonic()
    deadline = started + timeout_s
    tmp_dir = Path(tmp_dir).resolve()
    log_dir = tmp_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(f"http://127.0.0.1:{head_port}", {}, {}, {}, log_dir, Path(venv))
    try:
        if not stack.bin("gym").exists():
            raise FileNotFoundError(f"no NeMo Gym in {venv}: run infra/nemo_gym/install.sh")
        for stub in AGENTS.values():
            _start_stub(stack, stub)
        env = nemo_gym_env()
        ray_address = _start_ray(stack, env)
        config_path = tmp_dir / "stack.yaml"
        config_path.write_text(yaml.safe_dump(stack_config(stack.stub_urls), sort_keys=False))
        _link_venvs(tmp_dir / "venvs", stack.venv)
        args = [
            str(stack.bin("gym")), "env", "start", "--config", str(config_path),
            "+head_server.host=127.0.0.1", f"+head_server.port={head_port}", "+default_host=127.0.0.1",
            "+skip_venv_if_present=true", f"+uv_venv_dir={tmp_dir / 'venvs'}",
            f"+ray_head_node_address={ray_address}", "+error_on_agent_without_environment_server=true",
            f"+server_spinup_timeout_seconds={int(timeout_s)}",
            "+model_endpoint_readiness_timeout_seconds=30",
        ]  # fmt: skip
        (tmp_dir / "gym_command.txt").write_text(" ".join(args) + "\n")
        stack.procs["gym"] = _spawn(args, log_dir / "gym.log", env, cwd=tmp_dir)
        _wait_ready(stack, deadline)
        stack.config = yaml.safe_load(http_json(f"{stack.head_url}/global_config_dict_yaml", timeout_s=30))
        stack.servers = parse_servers(stack.config)
        stack.started_in_s = time.monotonic() - started
        return stack
    except BaseException as exc:
        logs = stack.log_tail()
        stack.stop()
        if isinstance(exc, Exception):
            raise RuntimeError(f"NeMo Gym stack did not start: {exc}\n{logs}") from exc
        raise


def main(argv: list[str] | None = None) -> None:
    """Start a stack, print its servers, and run until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--head-port", type=int, default=0)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the stack as Ctrl-C does
    stack = start_stack(args.dir, args.head_port or free_port(), args.venv)
    try:
        print(f"head server {stack.head_url} ready in {stack.started_in_s:.1f}s", flush=True)
        for server in stack.servers.values():
            print(f"  {server.name:32} {server.kind}/{server.impl:14} {server.url}", flush=True)
        while all(proc.poll() is None for proc in stack.procs.values()):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
