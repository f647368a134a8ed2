"""Settling (--settle-after M) against full K sampling, on the simulator with a per-task difficulty.

The simulator's `--difficulty spread`: 60% of the tasks are settled (half always solved, half never), the
rest succeed with a probability spread evenly over [0.2, 0.8]. One seeded full-K run gives every
(task, rollout)'s reward and backend latency; a seeded settled run at the default setting (M = K/2) is run
for real and must hold exactly the rollouts the rule gives on the full run's rewards (the simulator
answers a seeded rollout alike in both runs). The other settings of the curve replay the rule on the
full run's rewards, so every point is measured on the same tasks.

Per setting: rollouts saved, backend time saved (the kept rollouts' own latencies, measured in the full
run; the real settled run's backend seconds are printed beside it) and learnable tasks lost (mixed under
full K, settled under the rule). What the rule risks: a learnable task whose first M rollouts happen to
agree is settled; at success probability p that happens with p^M + (1-p)^M, so the loss falls as M grows
and the saving with it (the saving is at most (K-M)/K of the settled tasks' rollouts).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import orjson
from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save

GOAL = "at the default setting (M = K/2) and K=16: >= 30% fewer rollouts with <= 5% of learnable tasks lost"


def read_rows(path: Path) -> dict[int, list[tuple[float, float]]]:
    """Task -> [(reward, latency_s)] in rollout order, streamed from the dataset."""
    tasks: dict[int, list[tuple[float, float]]] = {}
    with path.open("rb") as fh:
        for line in fh:
            row = orjson.loads(line)
            rf = row.get("_rf") or {}
            tasks.setdefault(row["_ng_task_index"], []).append((row["reward"], rf.get("latency_s", 0.0)))
    return tasks


def replay(tasks: dict[int, list[tuple[float, float]]], m: int, threshold: float = 1.0) -> dict[str, float]:
    """The rule at M on the full run's rewards: rollouts kept, their backend seconds, learnable lost."""
    rollouts = backend = learnable = lost = settled = 0
    for rows in tasks.values():
        correct = [r >= threshold for r, _ in rows]
        mixed = 0 < sum(correct) < len(correct)
        unanimous = len(set(correct[:m])) == 1
        kept = rows[:m] if unanimous else rows
        rollouts += len(kept)
        backend += sum(lat for _, lat in kept)
        learnable += int(mixed)
        lost += int(mixed and unanimous)
        settled += int(unanimous)
    return {
        "rollouts": rollouts,
        "backend_s": backend,
        "learnable": learnable,
        "lost": lost,
        "settled": settled,
    }


def kept_keys(tasks: dict[int, list[tuple[float, float]]], m: int) -> list[tuple[int, int]]:
    out = []
    for t in sorted(tasks):
        correct = [r >= 1.0 for r, _ in tasks[t]]
        n = m if len(set(correct[:m])) == 1 else len(correct)
        out += [(t, r) for r in range(n)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--parallelism", type=int, default=64)
    ap.add_argument("--settings", default="2,3,4,5,6,8,10,12")
    args = ap.parse_args()
    k, default_m = args.repeats, args.repeats // 2
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-settle-"))
    inp = write_input(work / "input.jsonl", args.tasks)
    prefect = spawn_prefect_server()
    sim = spawn_simulator(
        "--latency-ms", "10", "--per-token-ms", "0.05", "--slots", "128", "--difficulty", "spread"
    )
    env = {**prefect.env}
    common = ("--seed", "11", "--chunk-size", "200")
    try:
        full = run_rollflow(
            run_args(
                inp, sim.url, parallelism=args.parallelism, repeats=k, extra=(*common, "--record-latency")
            ),
            env,
            work / "full",
        )
        assert full.returncode == 0, full.stderr[-2000:]
        ruled = run_rollflow(
            run_args(
                inp,
                sim.url,
                parallelism=args.parallelism,
                repeats=k,
                extra=(*common, "--settle-after", str(default_m)),
            ),
            env,
            work / "settled",
        )
        assert ruled.returncode == 0, ruled.stderr[-2000:]
    finally:
        sim.stop()
        prefect.stop()
    tasks = read_rows(work / "full" / "rollouts.jsonl")
    got = [
        (row["_ng_task_index"], row["_ng_rollout_index"])
        for row in map(orjson.loads, (work / "settled" / "rollouts.jsonl").read_bytes().splitlines())
    ]
    same = got == kept_keys(tasks, default_m)
    base = replay(tasks, k)
    print(
        f"settle: {args.tasks:,} tasks x K={k}, simulator --difficulty spread (60% settled, the rest p in "
        f"[0.2, 0.8]); {base['learnable']:,} tasks learnable under full K; {os.cpu_count()} cores"
    )
    whole = full.report["forecast"]["actual"]
    real = ruled.report["forecast"]["actual"]
    print(
        f"  full K run: {base['rollouts']:,} rollouts, backend {whole['backend_s']:,.0f} s, collect "
        f"{whole['wall_s']:.1f} s, wall {full.wall_s:.1f} s"
    )
    print(
        f"  settled run (M={default_m}): {ruled.report['rows_written']:,} rollouts, backend "
        f"{real['backend_s']:,.0f} s, collect {real['wall_s']:.1f} s, wall {ruled.wall_s:.1f} s; holds "
        f"exactly the replayed rule's rollouts: {same}"
    )
    print(f"  {'M':>3}  {'rollouts':>9}  {'saved':>6}  {'backend saved':>13}  ", end="")
    print(f"{'settled':>7}  {'learnable lost':>14}")
    table = []
    for m in sorted({int(x) for x in args.settings.split(",")} | {default_m}):
        if not 1 <= m < k:
            continue
        r = replay(tasks, m)
        saved = 1 - r["rollouts"] / base["rollouts"]
        backend_saved = 1 - r["backend_s"] / base["backend_s"] if base["backend_s"] else None
        lost = r["lost"] / base["learnable"] if base["learnable"] else 0.0
        mark = " (default)" if m == default_m else ""
        print(
            f"  {m:>3}  {r['rollouts']:>9,}  {saved:>6.1%}  {backend_saved or 0:>13.1%}  {r['settled']:>7,}  "
            f"{lost:>14.2%}{mark}"
        )
        table.append(
            {
                "M": m,
                "default": m == default_m,
                "rollouts": r["rollouts"],
                "rollouts saved": round(saved, 4),
                "backend time saved": None if backend_saved is None else round(backend_saved, 4),
                "tasks settled": r["settled"],
                "learnable lost": r["lost"],
                "learnable lost share": round(lost, 4),
            }
        )
    at = next(row for row in table if row["default"])
    met = at["rollouts saved"] >= 0.30 and at["learnable lost share"] <= 0.05
    print(f"  goal: {GOAL}: {'met' if met else 'NOT met'}")
    save(
        "settle",
        table,
        title="Settling: rollouts and backend time saved, learnable tasks lost, against full K",
        params={
            "tasks": args.tasks,
            "num_repeats": k,
            "default_settle_after": default_m,
            "learnable_under_full_k": base["learnable"],
            "full_run_backend_s": whole["backend_s"],
            "full_run_collect_s": whole["wall_s"],
            "settled_run_collect_s": real["wall_s"],
            "settled_run_backend_s": real["backend_s"],
            "settled_run_rollouts": ruled.report["rows_written"],
            "settled_run_matches_replay": same,
            "full_run_wall_s": round(full.wall_s, 1),
            "settled_run_wall_s": round(ruled.wall_s, 1),
        },
        goal=GOAL,
    )


if __name__ == "__main__":
    main()
