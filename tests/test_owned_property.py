"""Restart, resume, move, reverify and --failed-only in random orders over one output.

One output folder takes a sequence of commands hypothesis chooses: the collection (`run`, with verification
failures published with their gaps), a reverify of a fixed source (`reverify SOURCE --output OUT --verifier
math_fast`) and its completion (`reverify SOURCE --failed-only --output OUT`), each run again as typed (a
resume) or with --restart, and `mv OUT OUT2`, after which the commands name the new place. After every step
the folder's record, published.json, names exactly the published files it holds (each there, at its recorded
size when one is recorded; none of rollflow's fixed names unrecorded), and every committed chunk belongs to
the run in run.json. A command the folder can take (a restart, a new folder, or the run it holds) succeeds,
and then its dataset and its record equal what a fresh run of the command into a new folder publishes; one
it cannot (the folder holds another run) is refused and changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from rollout_data import flaky_verifier, write_sum_rows

pytestmark = pytest.mark.concurrent  # checks what was written, never a rate or a duration

TASKS = 12

# Raises for every task whose expected answer ends in 3 or 7: those checks fail as kind `verifier`, and the
# collection publishes the rest (--allow-incomplete), leaving a run --failed-only completes.
FLAKY = flaky_verifier("37")

# rollflow's fixed names of what a publish writes in its output (data/*.parquet is matched apart)
PUBLISHED_NAMES = (
    "rollouts.jsonl",
    "rollouts.tasks.jsonl",
    "README.md",
    "report.json",
    "report.md",
    "failures.jsonl",
    "rewards.png",
    "throughput.png",
)
LOCK = ".lease.lock"  # the lease a refused command takes too: run state, never published
# `_rf` fields that are no property of the rollout: how many requests it took (a transient error retries)
# and anything timed
UNSTABLE_RF = ("attempts",)

OPERATIONS = (
    "collect",
    "collect --restart",
    "reverify",
    "reverify --restart",
    "failed-only",
    "failed-only --restart",
    "move",
)


@dataclass
class Commands:
    """The three commands, by what they run; each takes its --output."""

    inp: Path
    source: Path
    backend_url: str

    def args(self, kind: str, out: Path) -> list[str]:
        if kind == "collect":
            return [
                "run", "--input", str(self.inp), "--output", str(out), "--backend-kind", "chat",
                "--backend-url", self.backend_url, "--num-repeats", "2", "--chunk-size", "8",
                "--parallelism", "8", "--seed", "11", "--verifier", "flaky_owned:verify",
                "--verify-processes", "0", "--allow-incomplete", "--no-progress",
            ]  # fmt: skip
        if kind == "reverify":
            return [
                "reverify", str(self.source), "--output", str(out), "--verifier", "math_fast",
                "--chunk-size", "6",
            ]  # fmt: skip
        assert kind == "failed-only", kind
        return [
            "reverify", str(self.source), "--failed-only", "--output", str(out), "--verifier", "exact_match",
        ]  # fmt: skip


@dataclass
class World:
    commands: Commands
    env: dict[str, str]
    fresh: dict[str, Path]  # each command's fresh run into a folder of its own
    base: Path


@pytest.fixture(scope="module")
def world(run_cli, fast_sim, tmp_path_factory) -> World:
    """The source (the collection's own fresh run: it published its rollouts with the failed checks left
    out), and a fresh reverify and a fresh --failed-only of it, each into a new folder."""
    base = tmp_path_factory.mktemp("owned_property")
    (base / "flaky_owned.py").write_text(FLAKY)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(base), os.environ.get("PYTHONPATH")) if p)}
    commands = Commands(write_sum_rows(base / "rows.jsonl", TASKS), base / "source", fast_sim.url)
    fresh = {"collect": commands.source}
    for kind in ("collect", "reverify", "failed-only"):
        out = fresh.setdefault(kind, base / f"fresh-{kind}")
        res = run_cli(*commands.args(kind, out), env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        assert read_record(out), f"{kind}: the fresh run recorded nothing"
    assert len(dataset(fresh["collect"])) < 2 * TASKS == len(dataset(fresh["failed-only"]))
    return World(commands, env, fresh, base)


def read_record(folder: Path) -> dict[str, list[dict[str, Any]]]:
    path = folder / "published.json"
    return orjson.loads(path.read_bytes()) if path.exists() else {}


def recorded_paths(record: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    return {kind: sorted(e["path"] for e in entries) for kind, entries in record.items() if entries}


def published_files(folder: Path) -> set[str]:
    """The files of rollflow's fixed names the folder holds, relative to it."""
    found = {name for name in PUBLISHED_NAMES if (folder / name).is_file()}
    data = folder / "data"
    return found | ({f"data/{p.name}" for p in data.glob("*.parquet")} if data.is_dir() else set())


def tree(folder: Path) -> dict[str, str]:
    """Every file but the lease, by path relative to the folder, with its digest."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK
    }


def dataset(folder: Path) -> list[dict[str, Any]]:
    """The published rows in order, without what is no property of the rollout."""
    rows = []
    for line in (folder / "rollouts.jsonl").read_bytes().splitlines():
        if not line.strip():
            continue
        row = orjson.loads(line)
        if isinstance(row.get("_rf"), dict):
            row["_rf"] = {
                k: v
                for k, v in row["_rf"].items()
                if k not in UNSTABLE_RF and not k.endswith(("_s", "_ms", "_at"))
            }
        rows.append(row)
    return rows


def run_id(folder: Path) -> str | None:
    run = folder / "run.json"
    return orjson.loads(run.read_bytes()).get("run_id") if run.exists() else None


def check_record(folder: Path, said: str) -> None:
    """The record names exactly the published files the folder holds; the run state is one run's."""
    if not folder.exists():
        return
    listed: set[str] = set()
    for kind, entries in read_record(folder).items():
        for entry in entries:
            target = Path(os.path.normpath(folder / entry["path"]))
            assert target.is_file(), f"{said}: {kind} {entry['path']} is recorded but not in {folder}"
            if entry.get("size") is not None:
                assert target.stat().st_size == entry["size"], f"{said}: {entry} is {target.stat().st_size}"
            if target.is_relative_to(folder):
                listed.add(str(target.relative_to(folder)))
    unowned = published_files(folder) - listed
    assert not unowned, f"{said}: {sorted(unowned)} published in {folder} but not in its published.json"
    current = run_id(folder)
    for manifest in sorted((folder / "chunks").glob("*.json")):
        owner = orjson.loads(manifest.read_bytes()).get("run_id")
        assert owner == current, f"{said}: {manifest.name} is of run {owner}, the folder holds {current}"


def check_as_fresh(folder: Path, fresh: Path, said: str) -> None:
    """What the command published equals its fresh run's: the same rows, the same record."""
    rows, expected = dataset(folder), dataset(fresh)
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    assert keys == [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in expected], f"{said}: {keys}"
    for row, want in zip(rows, expected, strict=True):
        assert row == want, f"{said}: rollout {row['_ng_task_index'], row['_ng_rollout_index']} differs"
    got, want = recorded_paths(read_record(folder)), recorded_paths(read_record(fresh))
    assert got == want, f"{said}: published.json names {got}, a fresh run's {want}"
    assert published_files(folder) == published_files(fresh), f"{said}: {published_files(folder)}"
    report = orjson.loads((folder / "report.json").read_bytes())
    assert report["published"] is True and report["rows_written"] == len(expected), said


@dataclass
class Output:
    """The one output: where it is now, and which command's run it holds."""

    path: Path
    holds: str | None = None
    moves: int = 0
    done: list[str] = field(default_factory=list)


def apply(op: str, out: Output, world: World, run_cli) -> None:
    out.done.append(op)
    said = " -> ".join(out.done)
    if op == "move":
        if out.path.exists():
            before = tree(out.path)
            out.moves += 1
            moved = out.path.with_name(f"out-moved-{out.moves}")
            shutil.move(out.path, moved)
            out.path = moved
            assert tree(moved) == before, said
        return
    kind, restart = op.split()[0], op.endswith("--restart")
    before = tree(out.path) if out.path.exists() else None
    replaced = run_id(out.path)
    res = run_cli(*world.commands.args(kind, out.path), *(["--restart"] if restart else []), env=world.env)
    if restart or out.holds in (None, kind):
        assert res.returncode == 0, f"{said}: exit {res.returncode}\n{res.stderr[-3000:]}"
        out.holds = kind
        check_as_fresh(out.path, world.fresh[kind], said)
        if restart and replaced is not None:
            assert run_id(out.path) != replaced, f"{said}: the restart kept run {replaced}"
    else:
        assert res.returncode == 2 and "holds a different run" in res.stderr, (
            f"{said}: exit {res.returncode}, not refused\n{res.stderr[-3000:]}"
        )
        after = tree(out.path) if out.path.exists() else None
        assert after == before, f"{said}: a refused command changed the output"
    check_record(out.path, said)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: each step is a CLI run of a few seconds
    print_blob=False,
)
@given(ops=st.lists(st.sampled_from(OPERATIONS), min_size=2, max_size=4))
@example(ops=["reverify", "collect --restart", "move", "collect"])  # a reverify's failures.jsonl goes
@example(ops=["collect", "failed-only --restart", "move", "failed-only"])  # the collection's plot goes
@example(ops=["failed-only", "move", "reverify", "reverify --restart"])  # refused, then replaced
def test_published_files_are_the_record_and_the_record_a_fresh_runs(ops, world: World, run_cli) -> None:
    out = Output(Path(tempfile.mkdtemp(dir=world.base, prefix="case-")) / "out")
    for op in ops:
        apply(op, out, world, run_cli)
