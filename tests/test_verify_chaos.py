"""Verifiers under attack, through the CLI over HTTP against the simulator: checks that hang (in a verifier
process, in a thread, on the event loop, an http verifier whose server never answers), megabyte rows and
300 KB replies queued behind a hung check, checks that exit or segfault, verifier modules that cannot be
imported in a fresh interpreter or import too slowly, and the collecting process killed mid-check.

Every case ends with each rollout a row or a failure with its reason, within the subprocess's time
limit, and with no verifier process left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from cli_runs import spawn
from key_server import KeyServer
from local_http import RESPONSE

from rollflow.infra.local import Service, spawn_simulator

TIMEOUT_S = 2  # --verify-timeout-s of every case
RUN_LIMIT_S = 150  # a run not finished by then hangs (under a loaded machine a run takes 10-30 s)
BIG = 2**100

pytestmark = pytest.mark.concurrent  # no rate or duration is measured: the limits are hang guards

CHAOS = """
import asyncio, ctypes, os, sys, threading, time
from pathlib import Path


def score(row, text):
    do = row.get("do", "ok")
    if do == "hang":
        if "mark" in row:
            Path(row["mark"]).write_text(str(os.getpid()))
        time.sleep(3600)
    if do == "exit":
        os._exit(3)
    if do == "segv":
        ctypes.string_at(0)
    if do == "err":
        raise ValueError("x" * 300_000)
    if do == "bigint":
        return 1.0 if type(row["expected_answer"]) is int and row["expected_answer"] == 2**100 else 0.0
    if do == "awaitable":
        async def later():
            await asyncio.sleep(0)
            return 1.0
        return later()
    if do == "die_after":
        threading.Timer(0.2, os._exit, (0,)).start()
    if do == "big" and len(row["pad"]) != 1_000_000:
        return 0.0
    return 1.0 if len(text) > 300_000 else 0.0


async def score_async(row, text):
    if row.get("do") == "hang":
        await asyncio.sleep(3600)
    if row.get("do") == "busy_callback":  # as aiohttp's reading of a long reply: the loop busy in a callback
        asyncio.get_running_loop().call_soon(spin, row["mark"])
        await asyncio.sleep(3600)
    return 1.0


def spin(mark):
    Path(mark).write_text(str(os.getpid()))
    end = time.monotonic() + 4
    while time.monotonic() < end:
        pass
"""

IN_A_WORKER = 'sys.argv[0].endswith("worker.py")'  # true only in a verifier process
FAILS_IN_CHILD = f"""
import sys
if {IN_A_WORKER}:
    raise ImportError("this module cannot load in a verifier process")
def score(row, text):
    return 1.0
"""
SLOW_IN_CHILD = f"""
import sys, time
if {IN_A_WORKER}:
    time.sleep(60)
def score(row, text):
    return 1.0
"""


@pytest.fixture(scope="module")
def long_sim() -> Iterator[Service]:
    """The simulator answering ~320 KB replies."""
    sim = spawn_simulator("--latency-ms", "1", "--min-tokens", "60000", "--max-tokens", "60000")
    yield sim
    sim.stop()


class Case:
    """One run's directory, its verifier module (named uniquely, to find its processes) and input."""

    def __init__(self, tmp_path: Path, source: str, rows: list[dict[str, Any]]) -> None:
        self.module = f"chaos_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{self.module}.py").write_text(source)
        self.inp = tmp_path / "in.jsonl"
        lines = []
        for n, row in enumerate(rows):
            line = orjson.dumps({"responses_create_params": {"input": f"question {n}"}, **row})
            lines.append(line.replace(b'"BIG"', str(BIG).encode()))  # an integer beyond 64 bits, exactly
        self.inp.write_bytes(b"\n".join(lines) + b"\n")
        self.out = tmp_path / "out"
        self.env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def args(self, url: str, verifier: str, *extra: str, kind: str = "responses") -> list[str]:
        return [
            "run", "--input", str(self.inp), "--output", str(self.out), "--backend-kind", kind,
            "--backend-url", url, "--verifier", verifier, "--verify-timeout-s", str(TIMEOUT_S),
            "--parallelism", "16", "--no-progress", *extra,
        ]  # fmt: skip

    def outcome(self) -> tuple[dict[int, float], dict[int, dict[str, Any]]]:
        """Rewards of the rows written and errors of the failures, by task index."""
        rows: dict[int, float] = {}
        failures: dict[int, dict[str, Any]] = {}
        for line in self.written():
            row = orjson.loads(line)
            rows[row["_ng_task_index"]] = row["reward"]
        for path in sorted((self.out / "failures").glob("*.jsonl")):
            for line in path.read_bytes().splitlines():
                row = orjson.loads(line)
                failures[row["_ng_task_index"]] = row["error"]
        return rows, failures

    def written(self) -> list[bytes]:
        """The rows written: the published dataset (its chunk objects go then), else the committed chunks."""
        dataset = self.out / "rollouts.jsonl"
        paths = [dataset] if dataset.exists() else sorted((self.out / "chunks").glob("*.jsonl"))
        return [line for path in paths for line in path.read_bytes().splitlines()]

    def processes(self) -> list[int]:
        """Live processes whose command line names this case's verifier module."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if self.module.encode() in cmdline and state != "Z":
                found.append(int(entry.name))
        return found

    def assert_no_process_left(self) -> None:
        deadline = time.monotonic() + 5
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:  # the test's own leftovers, so the next case starts clean
            os.kill(pid, signal.SIGKILL)
        assert not left, f"verifier processes outlived the run: {left}"


def run(run_cli, case: Case, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return run_cli(*args, env=case.env, timeout=RUN_LIMIT_S)  # type: ignore[no-any-return]
    except subprocess.TimeoutExpired:
        case.assert_no_process_left()
        raise AssertionError(f"the run was still going after {RUN_LIMIT_S}s") from None


def test_pool_hang_crashes_big_rows_and_replies_each_cost_one_rollout(run_cli, long_sim, tmp_path):
    """One verifier process: every check queues behind the hung one, 1 MB rows and 320 KB replies too."""
    do = ["ok", "hang", "big", "ok", "err", "big", "exit", "segv", "bigint", "awaitable", "die_after", "ok"]
    rows = [
        {
            "do": d,
            **({"pad": "p" * 1_000_000} if d == "big" else {}),
            **({"expected_answer": "BIG"} if d == "bigint" else {}),
        }
        for d in do
    ]
    case = Case(tmp_path, CHAOS, rows)
    res = run(run_cli, case, *case.args(long_sim.url, f"{case.module}:score", "--verify-processes", "1"))
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert {n: e["kind"] for n, e in failures.items()} == {
        1: "verifier_timeout",
        4: "verifier",
        6: "verifier_crash",
        7: "verifier_crash",
    }, failures
    assert f"--verify-timeout-s {TIMEOUT_S}s" in failures[1]["message"]
    assert "exit 3" in failures[6]["message"] and "exit -11" in failures[7]["message"]
    assert "ValueError: xxx" in failures[4]["message"] and len(failures[4]["message"]) < 5000
    assert rewards == {n: 1.0 for n in (0, 2, 3, 5, 8, 9, 10, 11)}, rewards
    assert "Traceback" not in res.stderr
    case.assert_no_process_left()


def test_a_hung_check_in_a_thread_times_out_and_the_run_still_exits(run_cli, long_sim, tmp_path):
    rows = [{"do": "ok"}, {"do": "hang"}, {"do": "big", "pad": "p" * 1_000_000}, {"do": "ok"}]
    case = Case(tmp_path, CHAOS, rows)
    res = run(run_cli, case, *case.args(long_sim.url, f"{case.module}:score", "--verify-processes", "0"))
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert {n: e["kind"] for n, e in failures.items()} == {1: "verifier_timeout"}, failures
    assert rewards == {0: 1.0, 2: 1.0, 3: 1.0}


def test_a_hung_async_check_times_out(run_cli, long_sim, tmp_path):
    case = Case(tmp_path, CHAOS, [{"do": "ok"}, {"do": "hang"}, {"do": "ok"}])
    res = run(run_cli, case, *case.args(long_sim.url, f"{case.module}:score_async"))
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert {n: e["kind"] for n, e in failures.items()} == {1: "verifier_timeout"}, failures
    assert rewards == {0: 1.0, 2: 1.0}


class SilentServer:
    """Accepts connections, reads them, never answers: a resources server that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_an_http_verifier_whose_server_never_answers_times_out(run_cli, fast_sim, tmp_path):
    case = Case(tmp_path, CHAOS, [{"do": "ok"}, {"do": "ok", "n": 2}])
    server = SilentServer()
    try:
        res = run(run_cli, case, *case.args(fast_sim.url, "http", "--verifier-url", server.url))
    finally:
        server.close()
    assert res.returncode == 1, res.stderr[-3000:]
    _, failures = case.outcome()
    assert {n: e["kind"] for n, e in failures.items()} == {0: "verifier_timeout", 1: "verifier_timeout"}


def test_a_module_that_cannot_load_in_a_verifier_process_fails_its_checks_with_the_reason(
    run_cli, fast_sim, tmp_path
):
    case = Case(tmp_path, FAILS_IN_CHILD, [{"n": n} for n in range(6)])
    res = run(run_cli, case, *case.args(fast_sim.url, f"{case.module}:score", "--verify-processes", "2"))
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert not rewards and set(failures) == set(range(6))
    for error in failures.values():
        assert error["kind"] == "verifier_crash"
        assert "could not load the verifier: ImportError: this module cannot load" in error["message"]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    case.assert_no_process_left()


def test_a_module_slower_to_import_than_the_start_timeout_fails_its_checks(run_cli, fast_sim, tmp_path):
    case = Case(tmp_path, SLOW_IN_CHILD, [{"n": n} for n in range(4)])
    args = case.args(fast_sim.url, f"{case.module}:score", "--verify-start-timeout-s", "1")
    res = run(run_cli, case, *args)
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert not rewards and set(failures) == set(range(4))
    assert all("not ready within 1s" in e["message"] for e in failures.values()), failures
    case.assert_no_process_left()


def test_sigkill_of_the_collecting_process_leaves_no_verifier_process(cli_env, long_sim, tmp_path):
    mark = tmp_path / "began"
    case = Case(tmp_path, CHAOS, [{"do": "hang", "mark": str(mark)}])
    proc = spawn(
        case.args(long_sim.url, f"{case.module}:score", "--verify-processes", "1"), {**cli_env, **case.env}
    )
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the check never began: {proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
        verifier = int(mark.read_text())
        assert verifier in case.processes()
    finally:
        proc.kill()
        proc.wait()
    case.assert_no_process_left()


class RewardlessAgent(KeyServer):
    """An agent whose replies carry no reward: its answer is the row's input."""

    def __init__(self) -> None:
        super().__init__(key="")

    async def _reply(self, request: web.Request) -> web.Response:
        params = (await request.json())["responses_create_params"]
        message = {**RESPONSE["output"][1], "content": [{"type": "output_text", "text": params["input"]}]}
        return web.json_response(
            {"responses_create_params": params, "response": {**RESPONSE, "output": [message]}}
        )


def test_an_explicit_verifier_scores_agent_replies_that_carry_no_reward(run_cli, tmp_path):
    answers = [0, 99, 2, 99, 4]  # rows 1 and 3 answer wrong
    rows = [
        {"responses_create_params": {"input": f"so \\boxed{{{a}}}"}, "expected_answer": n}
        for n, a in enumerate(answers)
    ]
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    case, other = Case(tmp_path / "with", CHAOS, rows), Case(tmp_path / "without", CHAOS, rows)
    with RewardlessAgent() as agent:
        res = run(run_cli, case, *case.args(agent.url, "math_fast", kind="agent"))
        assert res.returncode == 0, res.stderr[-3000:]
        rewards, failures = case.outcome()
        assert not failures and rewards == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0}

        args = [a for a in other.args(agent.url, "none", kind="agent") if a not in ("--verifier", "none")]
        res = run(run_cli, other, *args)
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = other.outcome()
    assert not rewards and {e["kind"] for e in failures.values()} == {"no_reward"}
    assert all(
        "--verifier scores the replies that carry no reward" in e["message"] for e in failures.values()
    )


@pytest.mark.parametrize("processes", ["0", "1"])
def test_sigterm_during_a_hung_check_stops_the_run_promptly(cli_env, long_sim, tmp_path, processes):
    mark = tmp_path / "began"
    case = Case(tmp_path, CHAOS, [{"do": "hang", "mark": str(mark)}, {"do": "ok"}])
    args = case.args(long_sim.url, f"{case.module}:score", "--verify-processes", processes)
    args[args.index("--verify-timeout-s") + 1] = (
        "600"  # the check is still running when the run is told to stop
    )
    proc = spawn(args, {**cli_env, **case.env})
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the check never began: {proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run was still alive 30 s after SIGTERM") from None
    finally:
        proc.kill()
        proc.wait()
    case.assert_no_process_left()


def test_sigterm_while_the_loop_runs_a_callback_stops_the_run_promptly(cli_env, fast_sim, tmp_path):
    """A signal raised inside an event-loop callback is swallowed there: the run must stop anyway."""
    mark = tmp_path / "began"
    case = Case(tmp_path, CHAOS, [{"do": "busy_callback", "mark": str(mark)}])
    args = case.args(fast_sim.url, f"{case.module}:score_async", "--verify-processes", "0")
    args[args.index("--verify-timeout-s") + 1] = "600"
    proc = spawn(args, {**cli_env, **case.env})
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the callback never ran: {proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)  # lands while the callback spins
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run was still alive 30 s after SIGTERM") from None
        assert proc.returncode == 143, err.decode()[-3000:]
        assert "terminated (SIGTERM)" in err.decode()
    finally:
        proc.kill()
        proc.wait()


EXITS = """
import subprocess, sys, time


def score(row, text):
    do = row.get("do", "ok")
    if do == "exit":
        raise SystemExit(4)
    if do == "interrupt":
        raise KeyboardInterrupt("from the check")
    if do in ("child", "child_hang"):  # a child that outlives the check; its command line names this module
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", __name__])
    if do == "child_hang":
        time.sleep(3600)
    return 1.0
"""


@pytest.mark.parametrize("processes", ["0", "1"])
def test_a_check_raising_systemexit_or_keyboardinterrupt_fails_its_rollout_alone(
    run_cli, fast_sim, tmp_path, processes
):
    case = Case(tmp_path, EXITS, [{"do": "exit"}, {"do": "interrupt"}, {"do": "ok"}])
    res = run(
        run_cli, case, *case.args(fast_sim.url, f"{case.module}:score", "--verify-processes", processes)
    )
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert rewards == {2: 1.0}
    assert {n: (e["kind"], e["message"]) for n, e in failures.items()} == {
        0: ("verifier", "verifier failed: SystemExit: 4"),
        1: ("verifier", "verifier failed: KeyboardInterrupt: from the check"),
    }
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    case.assert_no_process_left()


def test_children_a_check_starts_do_not_outlive_the_run(run_cli, fast_sim, tmp_path):
    case = Case(tmp_path, EXITS, [{"do": "child"}, {"do": "child_hang"}])
    res = run(run_cli, case, *case.args(fast_sim.url, f"{case.module}:score", "--verify-processes", "1"))
    assert res.returncode == 1, res.stderr[-3000:]
    rewards, failures = case.outcome()
    assert rewards == {0: 1.0} and failures[1]["kind"] == "verifier_timeout", failures
    case.assert_no_process_left()


MUTATES = """
def score(row, text):
    had = "touched" in row
    row["touched"] = True  # a verifier that writes into the row it is given
    return 0.0 if had else 1.0


async def score_async(row, text):
    return score(row, text)
"""


@pytest.mark.parametrize(("fn", "processes"), [("score", "0"), ("score", "1"), ("score_async", "0")])
def test_a_verifier_that_changes_its_row_changes_neither_the_output_nor_other_rollouts(
    run_cli, fast_sim, tmp_path, fn, processes
):
    case = Case(tmp_path, MUTATES, [{"n": 0}, {"n": 1}])
    args = case.args(
        fast_sim.url, f"{case.module}:{fn}", "--verify-processes", processes, "--num-repeats", "3"
    )
    res = run(run_cli, case, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [orjson.loads(line) for line in case.written()]
    assert len(rows) == 6 and all(row["reward"] == 1.0 and "touched" not in row for row in rows), rows


HUGE_ERROR = """
def score(row, text):
    raise ValueError("x" * 300_000)


async def score_async(row, text):
    return score(row, text)
"""


@pytest.mark.parametrize(("fn", "processes"), [("score", "0"), ("score_async", "0")])
def test_a_huge_error_text_is_capped_in_a_thread_and_on_the_loop_too(
    run_cli, fast_sim, tmp_path, fn, processes
):
    case = Case(tmp_path, HUGE_ERROR, [{"n": 0}])
    res = run(run_cli, case, *case.args(fast_sim.url, f"{case.module}:{fn}", "--verify-processes", processes))
    assert res.returncode == 1, res.stderr[-3000:]
    _, failures = case.outcome()
    message = failures[0]["message"]
    assert failures[0]["kind"] == "verifier" and message.startswith("verifier failed: ValueError: xxx"), (
        message[:300]
    )
    assert len(message) < 5000, len(message)
