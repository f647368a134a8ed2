"""20,000 rollouts end to end against a zero-latency agent server, rollflow next to NeMo Gym's collector.

The agent server is rollflow's simulator in agent mode (`--latency-ms 0`), in its own process; parallelism
256. Each collector runs as a whole command in a subprocess: wall time, rollouts/s, CPU-s from
RUSAGE_CHILDREN (the command and every process it waited for; servers that run detached from it, such as
the simulator, the running `prefect server` and the head-server stand-in, are not counted), CPU ms/rollout.
Rows: rollflow with a running `prefect server` (PREFECT_API_URL set), with Prefect's ephemeral server, with
no server configured (the default: a kept local server, started by a warm-up run), and NeMo Gym 0.7.0's
`ng_collect_rollouts`, found in the venv NG_VENV
(default /work/ngvenv when it exists; the row is skipped with a message otherwise). The collector resolves
its agent through NeMo Gym's head server, which `ng_run` would start; bench/ng_head.py stands in for it,
serving a config that names the simulator as the agent and its environment server. NeMo Gym's aggregate
metrics step is off (`+disable_aggregation=true`): it calls an `/aggregate_metrics` route that only a real
NeMo Gym agent has. Each output is counted: every row must hold ROLLOUTS lines.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import Service, spawn_prefect_server, spawn_simulator, write_input
from results import save

from rollflow.infra.local import free_port, wait_http

ROLLOUTS, PARALLELISM = 20_000, 256
AGENT = "bench_agent"
HERE = Path(__file__).resolve().parent
ROLLFLOW = str(Path(sys.executable).with_name("rollflow"))


@dataclass
class Row:
    name: str
    wall_s: float
    cpu_s: float
    returncode: int
    lines: int


def timed(name: str, cmd: list[str], env: dict[str, str], output: Path, cwd: str | None = None) -> Row:
    """Run one whole command; wall time, CPU-s of it and its waited-for children, rows in `output`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        print(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
    lines = _count_lines(output) if output.exists() else 0
    return Row(name, wall, cpu, proc.returncode, lines)


def _count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for _ in fh)


def ng_venv() -> Path | None:
    """NeMo Gym's venv: NG_VENV, else /work/ngvenv when it holds `ng_collect_rollouts`."""
    venv = Path(os.environ.get("NG_VENV", "/work/ngvenv"))
    return venv if (venv / "bin" / "ng_collect_rollouts").exists() else None


def spawn_ng_head(venv: Path, agent_url: str) -> Service:
    """bench/ng_head.py in NeMo Gym's Python, serving the config that points at `agent_url`."""
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), str(HERE / "ng_head.py"), "--agent", AGENT, "--agent-url", agent_url],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    match = re.search(r"http://\S+", line)
    if not match:
        proc.terminate()
        raise RuntimeError(f"the head-server stand-in did not start: {line!r}")
    url = match.group(0)
    wait_http(f"{url}/global_config_dict_yaml", 30, proc)
    return Service("ng-head", proc, url)


def rollflow_rows(inp: Path, tmp: Path, sim_url: str, base: dict[str, str]) -> list[Row]:
    """`rollflow collect` with a running `prefect server`, with Prefect's ephemeral server, and with no
    server configured (the default: the local server a first run started and left running is reused)."""
    args = ["collect", "--input", str(inp), "--backend-kind", "agent", "--backend-url", sim_url,
            "--parallelism", str(PARALLELISM), "--no-progress"]  # fmt: skip
    # A fresh PREFECT_HOME whose server port nobody listens on: no running server is found or reused.
    # On a loaded machine the ephemeral server can take longer than Prefect's default 20 s to answer.
    eph = {**base, "PREFECT_HOME": str(tmp / "home"), "PREFECT_SERVER_API_PORT": "1",
           "ROLLFLOW_PREFECT__LOCAL_SERVER": "ephemeral",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}  # fmt: skip
    keep = {**base, "PREFECT_HOME": str(tmp / "keep-home"), "PREFECT_SERVER_API_PORT": str(free_port())}
    # A first run pays one-off costs (bytecode, the database, starting the kept server) that users pay once.
    for name, env in (("eph", eph), ("keep", keep)):
        warm = tmp / f"warm-{name}"
        timed(
            "warm-up", [ROLLFLOW, *args, "--limit", "10", "--output", str(warm)], env, warm / "rollouts.jsonl"
        )
    try:
        prefect = spawn_prefect_server()
        try:
            out = tmp / "rf-server"
            env = {**base, **prefect.env}
            rows = [timed("rollflow, running prefect server", [ROLLFLOW, *args, "--output", str(out)], env,
                          out / "rollouts.jsonl")]  # fmt: skip
        finally:
            prefect.stop()
        out = tmp / "rf-ephemeral"
        rows.append(timed("rollflow, ephemeral Prefect", [ROLLFLOW, *args, "--output", str(out)], eph,
                          out / "rollouts.jsonl"))  # fmt: skip
        out = tmp / "rf-keep"
        rows.append(timed("rollflow, no server set (kept one)", [ROLLFLOW, *args, "--output", str(out)], keep,
                          out / "rollouts.jsonl"))  # fmt: skip
    finally:
        subprocess.run([str(Path(ROLLFLOW).with_name("prefect")), "server", "stop"], env=keep,
                       capture_output=True, timeout=60)  # fmt: skip
    return rows


def ng_row(venv: Path, inp: Path, tmp: Path, sim_url: str, base: dict[str, str]) -> Row:
    """`ng_collect_rollouts` at the same parallelism, through the head-server stand-in."""
    head = spawn_ng_head(venv, sim_url)
    try:
        out = tmp / "ng" / "rollouts.jsonl"
        cmd = [str(venv / "bin" / "ng_collect_rollouts"), f"+agent_name={AGENT}",
               f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
               f"+num_samples_in_parallel={PARALLELISM}", f"+head_server.port={head.url.rsplit(':', 1)[1]}",
               "+disable_aggregation=true"]  # fmt: skip
        return timed("NeMo Gym ng_collect_rollouts", cmd, base, out, cwd=str(tmp))
    finally:
        head.stop()


def main() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLFLOW_", "PREFECT_API_URL"))}
    base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    venv = ng_venv()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    try:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            inp = write_input(tmp / "in.jsonl", ROLLOUTS)
            rows = rollflow_rows(inp, tmp, sim.url, base)
            if venv:
                rows.append(ng_row(venv, inp, tmp, sim.url, base))
            else:
                print("NeMo Gym row skipped: no ng_collect_rollouts in NG_VENV (default /work/ngvenv); "
                      "install nemo-gym==0.7.0 in a Python 3.13 venv and set NG_VENV to it")  # fmt: skip
    finally:
        sim.stop()
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    _print(rows)
    table = [
        {
            "collector": r.name,
            "wall s": round(r.wall_s, 2),
            "rollouts/s": round(ROLLOUTS / r.wall_s),
            "CPU s": round(r.cpu_s, 2),
            "CPU ms/rollout": round(r.cpu_s * 1000 / ROLLOUTS, 3),
            "rows": r.lines,
            "exit": r.returncode,
        }
        for r in rows
    ]
    save(
        "end_to_end",
        table,
        title="End to end, beside NeMo Gym's ng_collect_rollouts",
        params={"rollouts": ROLLOUTS, "parallelism": PARALLELISM},
    )


def _print(rows: list[Row]) -> None:
    print(f"{ROLLOUTS:,} rollouts, parallelism {PARALLELISM}, zero-latency simulator (agent /run); CPU-s "
          "counts the command and its children, not detached servers")  # fmt: skip
    print(
        f"{'collector':34} {'wall s':>7} {'rollouts/s':>10} {'CPU s':>7} {'CPU ms/rollout':>14} {'rows':>7}"
    )
    for r in rows:
        line = (f"{r.name:34} {r.wall_s:7.2f} {ROLLOUTS / r.wall_s:10,.0f} {r.cpu_s:7.2f} "
                f"{r.cpu_s * 1000 / ROLLOUTS:14.3f} {r.lines:7,}")  # fmt: skip
        problems = [f"exit {r.returncode}"] * bool(r.returncode)
        problems += [f"expected {ROLLOUTS:,} rows"] * (r.lines != ROLLOUTS)
        print(line + (f"  ({', '.join(problems)})" if problems else ""))


if __name__ == "__main__":
    main()
