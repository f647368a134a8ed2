"""Rollouts end to end against a zero-latency agent server, rollflow next to NeMo Gym's collector.

`--rollouts 20000` (the default) measures the rate; `--rollouts 10` a small run's fixed cost. Each rollflow
row is printed as a ratio of NeMo Gym's row of the same run: rate, wall time and CPU-s.

The agent server is rollflow's simulator in agent mode (`--latency-ms 0`), in its own process; parallelism
256. Each collector runs as a whole command in a subprocess: wall time, rollouts/s, CPU-s from
RUSAGE_CHILDREN (the command and every process it waited for; servers that run detached from it, such as the
simulator, the running `prefect server` and the head-server stand-in, are not counted), CPU ms/rollout.
Rows (each kind of server first serves one 10-row warm-up run, as a server in use has): rollflow with a
running `prefect server` (PREFECT_API_URL set), with Prefect's ephemeral server, with
no server configured (the default: a kept local server, started by a warm-up run), and NeMo Gym 0.7.0's
`ng_collect_rollouts`, found in the venv NG_VENV (default: where infra/nemo_gym/install.sh puts it,
ROLLFLOW_NEMO_GYM_VENV or ~/.cache/rollflow/nemo-gym-0.7.0; the row is skipped with a message when there is
none). The collector resolves its agent through NeMo Gym's head server, which `ng_run` would start;
bench/ng_head.py stands in for it, serving a config that names the simulator as the agent and its
environment server. NeMo Gym's aggregate metrics step is off (`+disable_aggregation=true`): it calls an
`/aggregate_metrics` route that only a real NeMo Gym agent has. Each output is counted: every row must hold
one line per rollout.
"""

from __future__ import annotations

import argparse
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

PARALLELISM = 256
NG_DEFAULT = Path.home() / ".cache" / "rollflow" / "nemo-gym-0.7.0"
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
    """NeMo Gym's venv: NG_VENV, else where infra/nemo_gym/install.sh puts it, when it holds the command."""
    venv = Path(os.environ.get("NG_VENV") or os.environ.get("ROLLFLOW_NEMO_GYM_VENV") or NG_DEFAULT)
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
    # A first run pays one-off costs (bytecode, the database, starting the kept server, a just-started
    # server's first requests and start-up work) that users pay once: each kind of server gets one first.
    try:
        prefect = spawn_prefect_server()
        try:
            server = {**base, **prefect.env}
            for name, env in (("eph", eph), ("keep", keep), ("server", server)):
                warm = tmp / f"warm-{name}"
                timed("warm-up", [ROLLFLOW, *args, "--limit", "10", "--output", str(warm)], env,
                      warm / "rollouts.jsonl")  # fmt: skip
            out = tmp / "rf-server"
            rows = [timed("rollflow, running prefect server", [ROLLFLOW, *args, "--output", str(out)], server,
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=20_000, help="rows in the input (one rollout each)")
    rollouts = ap.parse_args().rollouts
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLFLOW_", "PREFECT_API_URL"))}
    base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    venv = ng_venv()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    try:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            inp = write_input(tmp / "in.jsonl", rollouts)
            rows = rollflow_rows(inp, tmp, sim.url, base)
            if venv:
                rows.append(ng_row(venv, inp, tmp, sim.url, base))
            else:
                print(f"NeMo Gym row skipped: no ng_collect_rollouts in NG_VENV (default {NG_DEFAULT}); "
                      "bash infra/nemo_gym/install.sh installs it")  # fmt: skip
    finally:
        sim.stop()
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    _print(rows, rollouts)
    ng = _nemo_gym(rows, rollouts)
    table = [
        {
            "collector": r.name,
            "wall s": round(r.wall_s, 2),
            "rollouts/s": round(rollouts / r.wall_s),
            "CPU s": round(r.cpu_s, 2),
            "CPU ms/rollout": round(r.cpu_s * 1000 / rollouts, 3),
            **(_ratios(r, ng) if ng and r is not ng else {}),
            "rows": r.lines,
            "exit": r.returncode,
        }
        for r in rows
    ]
    save(
        "end_to_end" if rollouts == 20_000 else f"end_to_end_{rollouts}",
        table,
        title=f"End to end, {rollouts:,} rollouts, beside NeMo Gym's ng_collect_rollouts",
        params={"rollouts": rollouts, "parallelism": PARALLELISM},
    )


def _nemo_gym(rows: list[Row], rollouts: int) -> Row | None:
    """NeMo Gym's row when it ran to the end and wrote every rollout: the others are set against it."""
    ng = next((r for r in rows if r.name.startswith("NeMo Gym")), None)
    return ng if ng and ng.returncode == 0 and ng.lines == rollouts else None


def _ratios(r: Row, ng: Row) -> dict[str, float]:
    """This row against NeMo Gym's of the same run: rate (higher is better), wall and CPU (lower is)."""
    return {
        "rate x NeMo Gym": round(ng.wall_s / r.wall_s, 2),
        "wall x NeMo Gym": round(r.wall_s / ng.wall_s, 2),
        "CPU x NeMo Gym": round(r.cpu_s / ng.cpu_s, 2),
    }


def _print(rows: list[Row], rollouts: int) -> None:
    print(f"{rollouts:,} rollouts, parallelism {PARALLELISM}, zero-latency simulator (agent /run); CPU-s "
          "counts the command and its children, not detached servers")  # fmt: skip
    ng = _nemo_gym(rows, rollouts)
    print(
        f"{'collector':34} {'wall s':>7} {'rollouts/s':>10} {'CPU s':>7} {'CPU ms/rollout':>14} {'rows':>7}"
        + ("   rate, wall, CPU x NeMo Gym" if ng else "")
    )
    for r in rows:
        line = (f"{r.name:34} {r.wall_s:7.2f} {rollouts / r.wall_s:10,.0f} {r.cpu_s:7.2f} "
                f"{r.cpu_s * 1000 / rollouts:14.3f} {r.lines:7,}")  # fmt: skip
        if ng and r is not ng:
            line += "   " + ", ".join(f"{v:.2f}x" for v in _ratios(r, ng).values())
        problems = [f"exit {r.returncode}"] * bool(r.returncode)
        problems += [f"expected {rollouts:,} rows"] * (r.lines != rollouts)
        print(line + (f"  ({', '.join(problems)})" if problems else ""))


if __name__ == "__main__":
    main()
