"""Fault suite: kill -9 at random moments, a frozen S3 server, backend faults, two runs on one output.

Prints a table: each scenario, whether the final dataset is byte-identical to an uninterrupted run, and
(for the kills) the rollouts redone, against the goal of at most in-flight + one flush interval.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson
from harness import REPO, run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save

from rollflow.infra.local import spawn_moto

PARALLELISM, FLUSH_S, RATE = 16, 0.5, 800


def metrics(url: str) -> dict:
    return orjson.loads(urllib.request.urlopen(f"{url}/stats").read())


def reset(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{url}/stats/reset", method="POST")).read()


def without_rf(data: bytes | Path) -> list[dict]:
    """Rows without rollflow's own `_rf` fields (attempt counts differ when faults force retries)."""
    raw = data.read_bytes() if isinstance(data, Path) else data
    return [{k: v for k, v in orjson.loads(line).items() if k != "_rf"} for line in raw.splitlines()]


def saved_rollouts(out: Path) -> int:
    """Rollouts the output holds right now: committed chunks plus flushed parts."""
    keys = set()
    for path in list(out.glob("chunks/*.jsonl")) + list(out.glob("parts/*/*.jsonl")):
        for line in path.read_bytes().splitlines():
            row = orjson.loads(line)
            keys.add((row["_ng_task_index"], row["_ng_rollout_index"]))
    return len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=30_000)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="rollflow-faults-"))
    inp = write_input(work / "input.jsonl", args.rows)
    sim = spawn_simulator("--latency-ms", "20", "--slots", "16")
    prefect = spawn_prefect_server()
    env = {**prefect.env, "ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S": str(FLUSH_S)}
    exe = str(Path(sys.executable).with_name("rollflow"))

    def cmd(out: str, url: str = sim.url) -> list[str]:
        return run_args(inp, url, parallelism=PARALLELISM, extra=("--chunk-size", "500"))

    rows: list[tuple[str, str, str]] = []
    try:
        ref = run_rollflow(cmd(""), env, work / "ref")
        reference = (work / "ref" / "rollouts.jsonl").read_bytes()
        bound = PARALLELISM + FLUSH_S * RATE
        out = work / "killed"
        redone_max = 0
        for i in range(args.kills):
            reset(sim.url)
            before = saved_rollouts(out) if out.exists() else 0
            proc = subprocess.Popen(
                [exe, *cmd(str(out)), "--output", str(out), "--no-progress"],
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=REPO,
            )
            deadline = time.monotonic() + 120
            while metrics(sim.url)["requests"] == 0 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rnd.uniform(0.0, 2.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            completed = metrics(sim.url)["completed"]
            kept = saved_rollouts(out) - before
            redone = max(0, completed - kept)
            redone_max = max(redone_max, redone)
            print(
                f"  kill {i + 1:2d}: {completed:5d} answered, {kept:5d} kept, {redone:4d} to redo", flush=True
            )
        final = run_rollflow(cmd(str(out)), env, out)
        same = final.returncode == 0 and (out / "rollouts.jsonl").read_bytes() == reference
        rows.append(
            (
                f"kill -9 x{args.kills}",
                "identical" if same else "DIFFERENT",
                f"max redone {redone_max} (goal <= {bound:.0f})",
            )
        )

        moto = spawn_moto()
        try:
            import s3fs

            os.environ.update(moto.env)
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("faults")
            s3_out = "s3://faults/run"
            proc = subprocess.Popen(
                [exe, *cmd(s3_out), "--output", s3_out, "--no-progress"],
                env={**os.environ, **env, **moto.env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                cwd=REPO,
            )
            time.sleep(4)
            moto.proc.send_signal(signal.SIGSTOP)
            time.sleep(3)
            moto.proc.send_signal(signal.SIGCONT)
            code = proc.wait(600)
            data = s3fs.S3FileSystem(skip_instance_cache=True).cat_file(f"{s3_out}/rollouts.jsonl")
            rows.append(
                (
                    "S3 server frozen 3 s mid-run",
                    "identical" if data == reference else "DIFFERENT",
                    f"exit {code}",
                )
            )
        finally:
            moto.stop()

        faulty = spawn_simulator(
            "--latency-ms",
            "20",
            "--slots",
            "16",
            "--fault-rate",
            "0.1",
            "--fault-kinds",
            "429,500,503,reset,malformed,hang",
            "--retry-after-s",
            "0.2",
            "--hang-s",
            "60",
        )
        try:
            fenv = {
                **env,
                "ROLLFLOW_BACKEND__TIMEOUT_S": "2",
                "ROLLFLOW_BACKEND__MAX_RETRIES": "12",
                "ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.05",
                "ROLLFLOW_BACKEND__BACKOFF_MAX_S": "0.5",
            }
            res = run_rollflow(cmd("", faulty.url), fenv, work / "faulty")
            same = res.returncode == 0 and without_rf(work / "faulty" / "rollouts.jsonl") == without_rf(
                reference
            )
            rows.append(
                (
                    "10% backend faults with hangs",
                    "same rows" if same else "DIFFERENT",
                    f"{res.report['metrics']['retries']} retries, {res.report['failed']} failed",
                )
            )
        finally:
            faulty.stop()

        twin = work / "twin"
        a = subprocess.Popen(
            [exe, *cmd(""), "--output", str(twin), "--no-progress"],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(3)
        b = subprocess.run(
            [exe, *cmd(""), "--output", str(twin), "--no-progress"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        a.wait(600)
        same = (twin / "rollouts.jsonl").read_bytes() == reference
        refused = b.returncode == 2 and "in use by another rollflow run" in b.stderr
        rows.append(
            (
                "two runs on one output",
                "identical" if same else "DIFFERENT",
                "second refused" if refused else f"second exit {b.returncode}",
            )
        )

        corrupt = work / "corrupt"
        run_rollflow([*cmd(""), "--deadline-s", "4"], env, corrupt)
        part_dir = corrupt / "parts" / "00099"
        part_dir.mkdir(parents=True, exist_ok=True)
        chunks = sorted(corrupt.glob("chunks/*.jsonl"))
        (corrupt / "parts" / "00000").mkdir(parents=True, exist_ok=True)
        (corrupt / "parts" / "00000" / "flush-bad-00000.jsonl").write_bytes(b'{"_ng_task_index": 0, "trunc')
        if chunks:
            (chunks[-1].with_suffix(".jsonl.tmp-1-dead")).write_bytes(b"half a chunk")
        res = run_rollflow(cmd(""), env, corrupt)
        same = res.returncode == 0 and (corrupt / "rollouts.jsonl").read_bytes() == reference
        rows.append(
            (
                "corrupted part + half-written temp object",
                "identical" if same else "DIFFERENT",
                f"exit {res.returncode}",
            )
        )
    finally:
        sim.stop()
        prefect.stop()
    print(f"\nfault suite: {args.rows:,} rows x 1 rollout, parallelism {PARALLELISM}, flush every {FLUSH_S}s")
    print(f"  {'scenario':<42} {'dataset':<10} detail")
    for name, verdict, detail in rows:
        print(f"  {name:<42} {verdict:<10} {detail}")
    print(f"  uninterrupted reference: exit {ref.returncode}, {len(reference.splitlines()):,} rows")
    table = [{"scenario": n, "dataset": v, "detail": d} for n, v, d in rows]
    save(
        "fault_suite",
        table,
        title="Faults: kills, restarts and corruption against an uninterrupted run",
        params={"rows": args.rows, "parallelism": PARALLELISM, "flush_s": FLUSH_S},
    )


if __name__ == "__main__":
    main()
