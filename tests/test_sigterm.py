"""SIGTERM stops a run the way Ctrl-C does: one line, its own exit status, committed work kept."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import run_args, spawn, wait_until

from rollflow.infra.local import spawn_simulator


@pytest.mark.parametrize(
    ("sig", "status", "said"),
    [(signal.SIGTERM, 143, "rollflow: terminated (SIGTERM)"), (signal.SIGINT, 130, "rollflow: interrupted")],
)
def test_sigterm_is_one_line_exit_143_and_the_next_run_resumes(
    run_cli, cli_env, rows_input, tmp_path, sig, status, said
):
    """SIGTERM, and Ctrl-C (whose one cancellation of the run could be lost), each stop the run."""
    sim = spawn_simulator("--latency-ms", "40", "--slots", "16")  # 400/s: 2,400 rollouts take ~6 s
    try:
        out = tmp_path / "out"
        proc = spawn(run_args(rows_input, str(out), sim), cli_env)
        wait_until(lambda: len(list(out.glob("chunks/*.json"))) >= 2, proc)
        committed = {p.name: p.read_bytes() for p in out.glob("chunks/*.json*")}
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        stderr = err.decode()
        assert proc.returncode == status, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(said), stderr[-3000:]
        for name, data in committed.items():
            assert (out / "chunks" / name).read_bytes() == data
        res = run_cli(*run_args(rows_input, str(out), sim))
        assert res.returncode == 0, res.stderr
        assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 2 * 1200
    finally:
        sim.stop()


def test_sigterm_before_the_flow_is_one_line(cli_env, rows_input, tmp_path: Path):
    proc = spawn(
        ["run", "--input", str(rows_input), "--output", str(tmp_path / "o"), "--no-progress"], cli_env
    )
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (143, -signal.SIGTERM), err.decode()[-2000:]
    assert "Traceback" not in err.decode()


WHILE_PARSING = """
import os, signal, sys
from rollflow.flows.cli import main as cli
build = cli.make_parser
def make_parser(command):  # the signal lands while the parser's modules load, as it can at any moment
    os.kill(os.getpid(), signal.SIGTERM)
    return build(command)
cli.make_parser = make_parser
sys.argv = ["rollflow", *sys.argv[1:]]
sys.exit(cli.main())
"""


def test_sigterm_while_the_parser_loads_is_one_line(cli_env, rows_input, tmp_path: Path):
    args = ["run", "--input", str(rows_input), "--output", str(tmp_path / "o"), "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-c", WHILE_PARSING, *args], env=cli_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.strip() == "rollflow: terminated (SIGTERM) before any work.", proc.stderr[-2000:]


def crash_handling_error() -> ValueError:
    """What Prefect's crash handling raises for a task run the signal stopped before it existed: a
    ValueError ("Task run is not set") raised while the TerminationSignal unwound."""
    from prefect.exceptions import TerminationSignal

    try:
        try:
            raise TerminationSignal(signal.SIGTERM)
        except TerminationSignal:
            raise ValueError("Task run is not set") from None
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


def test_an_error_raised_while_a_signal_unwinds_is_still_that_stop():
    """The CLI must still say one line and exit 143 when the signal comes back as another error."""
    from prefect.exceptions import TerminationSignal

    from rollflow.flows.stops import signal_stop_in

    assert isinstance(signal_stop_in(crash_handling_error()), TerminationSignal)
    wrapped = ExceptionGroup("tasks", [RuntimeError("x"), ValueError("y")])
    assert signal_stop_in(wrapped) is None and signal_stop_in(ValueError("plain")) is None


def test_a_chunk_error_raised_while_a_signal_unwinds_stops_the_run():
    """A SIGTERM that lands while Prefect creates a chunk's task run comes back as that ValueError: it is
    the stop, not a failed chunk after which the run would go on to its audit."""
    from prefect.exceptions import TerminationSignal

    from rollflow.flows.stops import chunk_error

    try:
        chunk_error(crash_handling_error())
    except TerminationSignal as stop:
        assert stop.signal == signal.SIGTERM
    else:
        raise AssertionError("a chunk error raised while a SIGTERM unwound was counted as a failed chunk")
    plain = RuntimeError("backend gone")
    assert chunk_error(plain) is plain


def test_sigterm_during_tuning_is_one_line_exit_143(cli_env, rows_input, tmp_path: Path):
    """`rollflow tune` stopped mid-search: the same one line and exit status as `run`, no traceback."""
    sim = spawn_simulator("--latency-ms", "200", "--slots", "8")  # the search's steps take seconds
    try:
        out = tmp_path / "out"
        proc = spawn(["tune", "--input", str(rows_input), "--output", str(out), "--backend-kind", "agent",
                      "--backend-url", sim.url], cli_env)  # fmt: skip
        wait_until(lambda: any(out.glob("parts/**/*")), proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        lines = [line for line in err.decode().splitlines() if line.strip()]
        assert proc.returncode == 143, err.decode()[-3000:]
        assert len(lines) == 1 and lines[0].startswith("rollflow: terminated (SIGTERM)"), lines
    finally:
        sim.stop()
