"""Randomized consistency: kills, SIGTERM, restarts, changed configs, foreign or corrupt objects,
concurrent runs, a backend answering 200 error objects and null rewards, rows no backend can take.

Each seeded schedule drives real `rollflow run` processes at one output (local disk or s3:// on moto).
After every run that ends, the outcome must be one of two: exit 0 with a dataset byte-identical to a clean
run of that run's configuration, or a refusal (exit 1 or 2, a `rollflow:` paragraph) that published
nothing (the dataset object is exactly what it was before). The last run of a schedule must publish.
No committed chunk may lack a rollout without a failure record giving its reason.
ROLLFLOW_TEST_SCHEDULES sets how many schedules run (default 6); the seed of each is in its name.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import orjson
import pytest
from cli_runs import spawn
from rollout_data import write_rows

from rollflow.infra.local import Service, spawn_simulator
from rollflow.tasks.storage.rowjson import MAX_ROW_DEPTH

ROWS, REPEATS, CHUNK = 120, 2, 20
SCHEDULES = int(os.environ.get("ROLLFLOW_TEST_SCHEDULES", "6"))
STEP_KINDS = (
    "complete", "kill", "sigterm", "concurrent", "foreign_part", "garbage_part", "tamper", "drop_manifest",
    "failing_backend", "bad_input",
)  # fmt: skip
# Every request to the failing backend answers 200 with an error object or an agent reward of null.
FAILING = ("--fault-rate", "1", "--fault-kinds", "error_object,null_reward")
FAST_FAILURES = {"ROLLFLOW_BACKEND__MAX_RETRIES": "1", "ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.01"}
CONFIGS = ("base", "override", "other_backend")
SEEN: Counter[str] = Counter()
EXE = str(Path(sys.executable).with_name("rollflow"))


@dataclass
class World:
    """The servers, input and clean reference datasets every schedule shares."""

    inp: Path
    sims: dict[str, Service]
    references: dict[str, bytes] = field(default_factory=dict)

    def args(
        self, out: str, config: str, *extra: str, sim: str | None = None, inp: Path | None = None
    ) -> list[str]:
        url = self.sims[sim or backend(config)].url
        args = [
            "run", "--input", str(inp or self.inp), "--output", out, "--backend-kind", "agent",
            "--backend-url", url, "--num-repeats", str(REPEATS), "--parallelism", "8",
            "--chunk-size", str(CHUNK), "--no-progress", *extra,
        ]  # fmt: skip
        if config == "override":
            args += ["--overrides", '{"temperature": 0.5}']
        return args


@pytest.fixture(scope="module")
def world(run_cli, tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("consistency")
    sims = {
        "a": spawn_simulator("--latency-ms", "15", "--slots", "8", "--seed", "1"),
        "b": spawn_simulator("--latency-ms", "15", "--slots", "8", "--seed", "2"),
        "failing": spawn_simulator("--latency-ms", "2", "--slots", "32", *FAILING),
    }
    w = World(write_rows(root / "in.jsonl", ROWS), sims)
    for config in CONFIGS:
        out = root / f"ref-{config}"
        res = run_cli(*w.args(str(out), config))
        assert res.returncode == 0, res.stderr
        w.references[config] = (out / "rollouts.jsonl").read_bytes()
    assert len(set(w.references.values())) == len(CONFIGS), "each configuration must give other bytes"
    yield w
    for sim in sims.values():
        sim.stop()


class Output:
    """The run's output through fsspec, as a test would poke at it from outside."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, skip_instance_cache=True)

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def cat(self, rel: str) -> bytes | None:
        self.fs.invalidate_cache()
        try:
            return self.fs.cat_file(self._path(rel))
        except FileNotFoundError:
            return None

    def pipe(self, rel: str, data: bytes) -> None:
        if "://" not in self.url:
            os.makedirs(os.path.dirname(self._path(rel)), exist_ok=True)
        self.fs.pipe_file(self._path(rel), data)

    def names(self, rel_dir: str, suffix: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self._path(rel_dir))
        except FileNotFoundError:
            return []
        return sorted(p.rsplit("/", 1)[-1] for p in found if p.endswith(suffix))

    def rm(self, rel: str) -> None:
        self.fs.invalidate_cache()
        if self.fs.exists(self._path(rel)):
            self.fs.rm_file(self._path(rel))


def backend(config: str) -> str:
    return "b" if config == "other_backend" else "a"


class Schedule:
    def __init__(self, world: World, out: Output, env: dict[str, str], rng: random.Random) -> None:
        self.world, self.out, self.env, self.rng = world, out, env, rng
        self.possible: set[str] = set()  # configurations the output may hold (several after a kill)
        self.log: list[str] = []

    def _args(self, config: str, final: bool = False, **where: object) -> list[str]:
        """--restart when the backend changes (a resume may switch URLs by design, but then the bytes
        would match no clean run), and mostly when the configuration changes (else: refused)."""
        other_backend = any(backend(p) != backend(config) for p in self.possible)
        changed = any(p != config for p in self.possible)
        restart = other_backend or (changed and (final or self.rng.random() < 0.7))
        return self.world.args(self.out.url, config, *(("--restart",) if restart else ()), **where)  # type: ignore[arg-type]

    def check(self, res: subprocess.CompletedProcess[str], config: str, before: bytes | None) -> bool:
        """The rule: published == clean run of `config`, or refused with a message and nothing published."""
        after = self.out.cat("rollouts.jsonl")
        if res.returncode == 0:
            assert after == self.world.references[config], f"{self.log}: published bytes differ\n{res.stderr}"
            self.possible = {config}
            return True
        assert res.returncode in (1, 2), f"{self.log}: exit {res.returncode}\n{res.stderr[-3000:]}"
        paragraphs = [line for line in res.stderr.splitlines() if line.startswith("rollflow:")]
        assert len(paragraphs) == 1, f"{self.log}: not one paragraph\n{res.stderr[-3000:]}"
        assert "Traceback" not in res.stderr, f"{self.log}: a traceback\n{res.stderr[-3000:]}"
        assert after == before, f"{self.log}: a refused run changed the dataset"
        return False

    def accounted(self) -> None:
        """Every committed chunk holds each planned rollout as a row or as a failure with its reason."""
        for name in self.out.names("chunks", ".json"):
            manifest = orjson.loads(self.out.cat(f"chunks/{name}") or b"{}")
            assert manifest["rows"] + manifest["failed"] == manifest["rows_expected"], (
                f"{self.log}: {manifest}"
            )
            lines = (self.out.cat(f"failures/{name}l") or b"").splitlines()
            assert len(lines) == manifest["failed"], f"{self.log}: chunk {name} failures file"
            for line in lines:
                error = orjson.loads(line)["error"]
                assert error["kind"] and error["message"], f"{self.log}: a failure without its reason"

    def run(self, config: str, final: bool = False, **where: object) -> bool:
        args, before = self._args(config, final, **where), self.out.cat("rollouts.jsonl")
        env = {**self.env, **FAST_FAILURES} if where.get("sim") == "failing" else self.env
        res = subprocess.run([EXE, *args], env=env, capture_output=True, text=True, timeout=180)
        if "--restart" in args and res.returncode != 0:
            self.possible = {config}
        published = self.check(res, config, before)
        self.accounted()
        return published

    def failing_backend(self, config: str) -> None:
        """Error objects in a 200 and null rewards are failures with reasons, never reward-0 rows."""
        published = self.run(config, sim="failing")
        if not published:
            failures = [f for n in self.out.names("failures", ".jsonl") for f in self._failures(n)]
            assert all(f["error"]["kind"] in ("malformed", "no_reward") for f in failures), failures[:3]

    def _failures(self, name: str) -> list[dict]:
        return [orjson.loads(line) for line in (self.out.cat(f"failures/{name}") or b"").splitlines()]

    def bad_input(self, config: str) -> None:
        """A row too deep to store, or one chat cannot send: refused at plan time by file and line,
        before anything of the output is touched (even with --restart)."""
        deep = self.rng.random() < 0.5
        bad = {"responses_create_params": {"input": ["plain", "strings"]}}
        line = orjson.dumps(bad)
        if deep:
            depth = MAX_ROW_DEPTH + 5
            line = (
                b'{"responses_create_params": {"input": "hi"}, "meta": ' + b"[" * depth + b"]" * depth + b"}"
            )
        lines = self.world.inp.read_bytes().splitlines(keepends=True)
        at = self.rng.randrange(len(lines) + 1)
        lines.insert(at, line + b"\n")
        inp = self.world.inp.with_name(f"bad-{self.rng.getrandbits(32)}.jsonl")
        inp.write_bytes(b"".join(lines))
        args = self._args(config, inp=inp)
        if not deep:
            args[args.index("agent")] = "chat"
        before, run_json = self.out.cat("rollouts.jsonl"), self.out.cat("run.json")
        res = subprocess.run([EXE, *args], env=self.env, capture_output=True, text=True, timeout=180)
        assert res.returncode == 2, f"{self.log}: exit {res.returncode}\n{res.stderr[-3000:]}"
        assert f"{inp}, line {at + 1}" in res.stderr, f"{self.log}: {res.stderr[-3000:]}"
        assert self.out.cat("rollouts.jsonl") == before and self.out.cat("run.json") == run_json

    def kill(self, config: str, sig: int = signal.SIGKILL) -> None:
        args, before = self._args(config), self.out.cat("rollouts.jsonl")
        proc = spawn(args, self.env)
        target = self.rng.choice(["run.json", "part", "manifest"])
        need = self.rng.randint(1, 4)
        deadline = time.monotonic() + 90
        while sig == signal.SIGTERM and proc.poll() is None and time.monotonic() < deadline:
            if orjson.loads(self.out.cat("lease.json") or b"{}").get("pid") == proc.pid:
                break  # the command runs (a signal before its handlers exist ends the interpreter)
            time.sleep(0.01)
        while proc.poll() is None and time.monotonic() < deadline:
            if target == "run.json" and self.out.cat("run.json") is not None:
                break
            if target == "part" and self.out.names("parts", ".jsonl"):
                break
            if target == "manifest" and len(self.out.names("chunks", ".json")) >= need:
                break
            time.sleep(0.01)
        ended = proc.poll() is not None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        stderr = err.decode()
        self.log.append(f"{signal.Signals(sig).name}:{config}@{target}")
        if sig == signal.SIGTERM and (ended or proc.returncode != 143):
            self.check(subprocess.CompletedProcess(args, proc.returncode, "", stderr), config, before)
            if proc.returncode == 0:
                return
        elif sig == signal.SIGTERM:
            assert "Traceback" not in stderr and "terminated (SIGTERM)" in stderr, stderr[-3000:]
            assert self.out.cat("rollouts.jsonl") == before, f"{self.log}: SIGTERM changed the dataset"
        self.accounted()
        if "--restart" in args or not self.possible:
            self.possible.add(config)

    def concurrent(self, config: str) -> None:
        before = self.out.cat("rollouts.jsonl")
        args = self._args(config)
        procs = [subprocess.Popen(
            [EXE, *args],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ) for _ in range(2)]  # fmt: skip
        outcomes = []
        for proc in procs:
            _, err = proc.communicate(timeout=180)
            res = subprocess.CompletedProcess(proc.args, proc.returncode, "", err)
            if res.returncode == 0:
                assert self.out.cat("rollouts.jsonl") == self.world.references[config]
            else:
                assert "rollflow:" in err, err[-3000:]
            outcomes.append(res.returncode)
        if 0 in outcomes:
            self.possible = {config}
        else:
            assert self.out.cat("rollouts.jsonl") == before
            if "--restart" in args:
                self.possible.add(config)

    def corrupt(self, kind: str) -> None:
        chunk = self.rng.randrange(ROWS // CHUNK)
        foreign = self.world.references["other_backend"].splitlines()[chunk * CHUNK * REPEATS :][:5]
        if kind == "foreign_part":
            header = orjson.dumps({"_rf_part": {"run_id": "f" * 16, "chunk": chunk}})
            body = [header, *foreign] if self.rng.random() < 0.5 else foreign
            self.out.pipe(f"parts/{chunk:05d}/flush-foreign.jsonl", b"\n".join(body) + b"\n")
        elif kind == "garbage_part":
            self.out.pipe(f"parts/{chunk:05d}/flush-garbage.jsonl", b'{"_ng_task_index": 1, "_ng_roll')
        elif kind == "tamper":
            names = self.out.names("chunks", ".jsonl")
            if names:
                rel = f"chunks/{self.rng.choice(names)}"
                data = self.out.cat(rel) or b""
                flipped = data.replace(b'"reward":1.0', b'"reward":0.0', 1)
                self.out.pipe(rel, flipped if flipped != data else data + foreign[0] + b"\n")
        elif kind == "drop_manifest":
            names = self.out.names("chunks", ".json")
            if names:
                self.out.rm(f"chunks/{self.rng.choice(names)}")

    def step(self) -> None:
        kind = self.rng.choice(STEP_KINDS)
        current = min(self.possible) if self.possible else "base"
        config = self.rng.choice(CONFIGS) if self.rng.random() < 0.4 else current
        SEEN[kind] += 1
        SEEN[f"{kind}:{'same' if self.possible <= {config} else 'changed'}"] += 1
        if kind == "complete":
            self.log.append(f"run:{config}")
            self.run(config)
        elif kind == "kill":
            self.kill(config)
        elif kind == "sigterm":
            self.kill(config, signal.SIGTERM)
        elif kind == "failing_backend":
            self.log.append(f"failing_backend:{config}")
            self.failing_backend(config)
        elif kind == "bad_input":
            self.log.append(f"bad_input:{config}")
            self.bad_input(config)
        elif kind == "concurrent":
            self.log.append(f"concurrent:{config}")
            self.concurrent(config)
        else:
            self.log.append(kind)
            self.corrupt(kind)

    def finish(self) -> None:
        """Run the final configuration until it publishes: each attempt obeys the rule; three at most."""
        final = self.rng.choice(sorted(self.possible)) if self.possible else "base"
        for _ in range(3):
            self.log.append(f"final:{final}")
            if self.run(final, final=True):
                return
        raise AssertionError(f"{self.log}: the final configuration never published")


@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_random_schedule(world: World, cli_env, moto_s3, tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    if seed % 2:
        out, env = Output(f"s3://{moto_s3.new_bucket()}/run"), {**cli_env, **moto_s3.env}
    else:
        out, env = Output(str(tmp_path / "out")), dict(cli_env)
    env["ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S"] = "0.2"
    schedule = Schedule(world, out, env, rng)
    for _ in range(rng.randint(2, 4)):
        schedule.step()
    schedule.finish()
    SEEN["s3" if seed % 2 else "local"] += 1
    print(f"schedule {seed}: {' -> '.join(schedule.log)}; situations so far: {len(SEEN)}")
