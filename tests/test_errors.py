"""Bad input, a changed config, an unreachable backend, a missing bucket: a clear error, nothing lost."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from rollout_data import write_rows

from rollflow.infra.local import free_port


def args_for(inp: Path | str, out: Path | str, url: str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
        "--backend-url", url, "--chunk-size", "50", "--parallelism", "32", "--no-progress", *extra,
    ]  # fmt: skip


def one_paragraph(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("rollflow:")]
    assert lines, stderr
    return " ".join(stderr[stderr.index("rollflow:") :].split())


@pytest.mark.parametrize(
    ("content", "line", "needle"),
    [
        (
            b'{"responses_create_params": {"input": []}}\n{"responses_create_params": {"inp\n',
            2,
            "not valid JSON",
        ),
        (
            b'{"responses_create_params": {"input": []}}\n\n{"prompt": "x"}\n',
            3,
            "no 'responses_create_params'",
        ),
        (b'{"responses_create_params": {"input": "\xff\xfe"}}\n', 1, "not UTF-8"),
        (b"[1, 2]\n", 1, "expected a JSON object"),
    ],
)
def test_bad_input_stops_before_any_request(run_cli, fast_sim, tmp_path, content, line, needle):
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(content)
    res = run_cli(*args_for(inp, tmp_path / "out", fast_sim.url))
    assert res.returncode == 2
    message = one_paragraph(res.stderr)
    assert f"{inp}, line {line}" in message and needle in message and "--skip-bad-rows" in message
    assert not (tmp_path / "out" / "chunks").exists()


def _rows_then_bad_line_5(path: Path) -> Path:
    write_rows(path, 4)
    with path.open("ab") as fh:
        fh.write(b'{"responses_create_params": {"inp\n')
    return path


def test_user_error_is_one_paragraph_without_traceback(run_cli, fast_sim, tmp_path):
    """Prefect's task-failure traceback stays out of the terminal unless --verbose asks for it."""
    inp = _rows_then_bad_line_5(tmp_path / "bad.jsonl")
    res = run_cli(*args_for(inp, tmp_path / "out", fast_sim.url))
    assert res.returncode == 2
    assert f"{inp}, line 5" in one_paragraph(res.stderr)
    assert "Traceback" not in res.stderr and "task_engine" not in res.stderr, res.stderr
    assert res.stderr.count("not valid JSON") == 1, res.stderr
    res = run_cli(*args_for(inp, tmp_path / "out", fast_sim.url, "--verbose"))
    assert res.returncode == 2 and "Traceback" in res.stderr and "InputError" in res.stderr
    assert f"{inp}, line 5" in one_paragraph(res.stderr)


def test_tuning_user_error_is_one_paragraph(run_cli, fast_sim, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 60)
    res = run_cli("diagnose", *args_for(inp, tmp_path / "out", fast_sim.url)[1:])
    assert res.returncode == 2
    assert "too few rows left to diagnose" in one_paragraph(res.stderr)
    assert "Traceback" not in res.stderr and res.stderr.count("too few rows") == 1, res.stderr


def test_tuning_names_the_engine_flags_it_ignores(run_cli, fast_sim, tmp_path):
    """diagnose and tune probe from the command's own process: --runner and its flags do nothing there."""
    inp = write_rows(tmp_path / "rows.jsonl", 60)
    args = args_for(inp, tmp_path / "out", fast_sim.url, "--runner", "ray", "--ray-address", "auto")[1:]
    res = run_cli("diagnose", *args)
    assert res.returncode == 2 and "too few rows left to diagnose" in res.stderr, res.stderr[-3000:]
    note = "rollflow: diagnose probes the backend from this process; it ignores --runner, --ray-address"
    assert res.stderr.count(note) == 1, res.stderr[-3000:]


def test_unexpected_error_keeps_its_traceback(run_cli, fast_sim, tmp_path):
    """A bug (here in the user's verifier module, at import) is not a known error: its traceback shows."""
    (tmp_path / "buggy_rewards.py").write_text("raise RuntimeError('bug in buggy_rewards')\n")
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    res = run_cli(
        *args_for(inp, tmp_path / "out", fast_sim.url, "--verifier", "buggy_rewards:score"),
        "--backend-kind", "responses",
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode != 0
    assert "Traceback" in res.stderr and "RuntimeError: bug in buggy_rewards" in res.stderr, res.stderr


def test_empty_input(run_cli, fast_sim, tmp_path):
    inp = tmp_path / "empty.jsonl"
    inp.write_bytes(b"\n\n")
    res = run_cli(*args_for(inp, tmp_path / "out", fast_sim.url))
    assert res.returncode == 2 and "has no rows" in one_paragraph(res.stderr)


def test_missing_input(run_cli, fast_sim, tmp_path):
    res = run_cli(*args_for(tmp_path / "nope.jsonl", tmp_path / "out", fast_sim.url))
    assert res.returncode == 2 and "does not exist" in one_paragraph(res.stderr)


def test_a_path_with_brackets_is_said_as_it_is(run_cli, fast_sim, tmp_path):
    """Messages were read as Rich markup: `[/x]` in a path crashed the error's own printing (a
    traceback, exit 1), and `[exp1]` vanished from the path it named."""
    for name in ("nope[/x].jsonl", "[exp1]/in.jsonl"):
        res = run_cli(*args_for(tmp_path / name, tmp_path / "out", fast_sim.url))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert f"{tmp_path / name} does not exist" in one_paragraph(res.stderr)


def test_a_compressed_input_cut_short_is_one_paragraph(run_cli, fast_sim, tmp_path):
    """A truncated .jsonl.gz ended in Prefect's traceback of an EOFError."""
    import gzip

    whole = gzip.compress(write_rows(tmp_path / "rows.jsonl", 200).read_bytes())
    inp = tmp_path / "cut.jsonl.gz"
    inp.write_bytes(whole[: len(whole) // 2])
    res = run_cli(*args_for(inp, tmp_path / "out", fast_sim.url))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    message = one_paragraph(res.stderr)
    assert f"{inp}, line " in message and "damaged or cut short" in message, message


def test_skip_bad_rows_records_them(run_cli, fast_sim, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 100)
    with inp.open("ab") as fh:
        fh.write(b"not json\n")
    write_rows(tmp_path / "more.jsonl", 20, start=100)
    inp.write_bytes(inp.read_bytes() + (tmp_path / "more.jsonl").read_bytes())
    out = tmp_path / "out"
    res = run_cli(*args_for(inp, out, fast_sim.url, "--skip-bad-rows"))
    assert res.returncode == 0, res.stderr
    bad = [orjson.loads(x) for x in (out / "bad_rows.jsonl").read_bytes().splitlines()]
    assert [(b["line"], b["task_index"]) for b in bad] == [(101, 100)]
    keys = [orjson.loads(x)["_ng_task_index"] for x in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert keys == list(range(100)) + list(range(101, 121))


def test_changed_config_is_refused_and_nothing_lost(run_cli, fast_sim, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 120)
    out = tmp_path / "out"
    assert run_cli(*args_for(inp, out, fast_sim.url)).returncode == 0
    before = {p.name: p.read_bytes() for p in (out / "chunks").iterdir()}
    res = run_cli(
        *args_for(inp, out, fast_sim.url, "--num-repeats", "3", "--overrides", '{"temperature": 0.2}')
    )
    assert res.returncode == 2
    message = one_paragraph(res.stderr)
    assert "num_repeats 1 -> 3" in message and "config.overrides" in message and "--restart" in message
    assert {p.name: p.read_bytes() for p in (out / "chunks").iterdir()} == before
    write_rows(inp, 121)
    res = run_cli(*args_for(inp, out, fast_sim.url))
    assert res.returncode == 2 and "input fingerprint changed" in one_paragraph(res.stderr)
    res = run_cli(*args_for(inp, out, fast_sim.url, "--restart"))
    assert res.returncode == 0, res.stderr
    assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 121


def test_unreachable_backend(run_cli, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    res = run_cli(*args_for(inp, tmp_path / "out", f"http://127.0.0.1:{free_port()}"), timeout=60)
    assert res.returncode == 2
    message = one_paragraph(res.stderr)
    assert "unreachable" in message and "--backend-url" in message
    assert "Traceback" not in res.stderr and res.stderr.count("unreachable") == 1, res.stderr


def test_missing_bucket(run_cli, fast_sim, moto_s3, tmp_path):
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    res = run_cli(*args_for(inp, "s3://no-such-bucket-rf/run", fast_sim.url), env=moto_s3.env, timeout=120)
    assert res.returncode == 2
    message = one_paragraph(res.stderr)
    assert "no-such-bucket-rf" in message and "does not exist" in message
    assert "testing" not in res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("does not exist") == 1, res.stderr


def test_incomplete_run_is_not_published_then_resumes(run_cli, tmp_path):
    """A backend that fails every request: rows go to failures/, exit 1; fixed backend: re-run completes."""
    from rollflow.infra.local import spawn_simulator

    inp = write_rows(tmp_path / "rows.jsonl", 60)
    out = tmp_path / "out"
    broken = spawn_simulator("--latency-ms", "1", "--fault-rate", "1", "--fault-kinds", "500")
    try:
        res = run_cli(
            *args_for(inp, out, broken.url, "--max-retries", "1"),
            env={"ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.01"},
        )
    finally:
        broken.stop()
    assert res.returncode == 1
    assert "not published" in one_paragraph(res.stderr)
    assert not (out / "rollouts.jsonl").exists()
    failures = (out / "failures" / "00000.jsonl").read_bytes().splitlines()
    assert len(failures) == 50 and orjson.loads(failures[0])["error"]["kind"] == "http_500"
    good = spawn_simulator("--latency-ms", "1")
    try:
        res = run_cli(*args_for(inp, out, good.url))
    finally:
        good.stop()
    assert res.returncode == 0, res.stderr
    assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 60
    assert not (out / "failures").exists() or not list((out / "failures").iterdir())
