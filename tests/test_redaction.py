"""Secrets never reach any text a run writes, whatever the error's class: failures files, reports, the
console, Prefect's logs on its server."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import orjson
from cli_runs import run_args
from key_server import KeyServer
from prefect_api import flow_runs_of, post

from rollflow.infra.local import free_port
from rollflow.settings import redact

API_KEY = "sk-live-8f3a9c2d71e04b5a"
S3_SECRET = "s3-secret-0b9e77aa41cd"
LEAKY = """
import logging, os

def score(row, text):
    key, s3 = os.environ["ROLLFLOW_BACKEND__API_KEY"], os.environ["AWS_SECRET_ACCESS_KEY"]
    if row["n"] % 2:
        logging.getLogger("leaky.verifier").warning("scoring with %s and %s", key, s3)
        raise PermissionError(f"token {key} refused; storage secret {s3}")
    return 1.0
"""


def _server_logs(prefect_url: str, output: str) -> str:
    api = f"{prefect_url}/api"
    runs = flow_runs_of(api, output)
    mine = [r["id"] for r in runs]
    assert mine, "the run's flow run is on the server"
    logs = post(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": mine}}, "limit": 200})
    assert logs, "the run logged to the server"
    states = [r["state"]["message"] or "" for r in runs]
    tasks = post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": mine}}, "limit": 200})
    states += [t["state"]["message"] or "" for t in tasks if t.get("state")]
    return "\n".join([log["message"] for log in logs] + states)


def test_secrets_in_a_verifiers_errors_and_logs_are_written_nowhere(run_cli, cli_env, tmp_path: Path):
    (tmp_path / "leaky.py").write_text(LEAKY)
    inp = tmp_path / "in.jsonl"
    rows = (orjson.dumps({"responses_create_params": {"input": "hi"}, "n": i}) + b"\n" for i in range(20))
    inp.write_bytes(b"".join(rows))
    out = tmp_path / "out"
    env = {
        "ROLLFLOW_BACKEND__API_KEY": API_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    with KeyServer(API_KEY) as server:
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "responses",
            "--backend-url", server.url, "--verifier", "leaky:score", "--no-progress", "--verbose", env=env,
        )  # fmt: skip
    assert res.returncode == 1, res.stderr
    failures = [
        orjson.loads(line) for f in (out / "failures").glob("*.jsonl") for line in f.read_bytes().splitlines()
    ]
    assert len(failures) == 10 and all(
        "PermissionError: token ***" in f["error"]["message"] for f in failures
    )
    texts = {
        "stderr": res.stderr,
        "stdout": res.stdout,
        "server logs": _server_logs(cli_env["PREFECT_API_URL"].removesuffix("/api"), str(out)),
    }
    texts |= {str(p): p.read_bytes().decode(errors="replace") for p in out.rglob("*") if p.is_file()}
    for secret in (API_KEY, S3_SECRET):
        leaked = [where for where, text in texts.items() if secret in text]
        assert not leaked, f"{secret} written to {leaked}"


def test_a_short_secret_is_masked_where_it_stands_alone_not_inside_every_word(monkeypatch) -> None:
    """AWS_SECRET_ACCESS_KEY=s masked every `s` of every message (`***3://b/x.j***onl`)."""
    # the process's set comes back after the test: "s" would mask "the run's deadline" in later tests here
    monkeypatch.setattr(redact._SECRETS, "values", redact._SECRETS.values)
    redact.register(None, "s", "y2")
    text = "Source s3://b/x.jsonl: key=s, token y2; python3.11"
    assert redact.redact(text) == "Source s3://b/x.jsonl: key=***, token ***; python3.11"
    redact.register(None, "1")  # a key of 1 left every address whole: not 127.0.0.***:8000
    assert redact.redact("http://127.0.0.1:8000/v1 key=1") == "http://127.0.0.1:8000/v1 key=***"


def test_log_records_and_tracebacks_are_redacted_in_process() -> None:
    redact.register(None, "tok-unit-5521")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("rollflow.test.redaction")
    logger.addHandler(handler)
    try:
        try:
            raise ValueError("bad token tok-unit-5521")
        except ValueError:
            logger.exception("request with %s failed", "tok-unit-5521")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "ValueError: bad token ***" in text and "request with *** failed" in text, text
    assert "tok-unit-5521" not in text
    error = redact.redacted_error(RuntimeError("tok-unit-5521 expired"))
    assert str(error) == "RuntimeError: *** expired"
    plain = OSError("no secret here")
    assert redact.redacted_error(plain) is plain


def test_credentials_in_an_address_or_url_are_refused_without_echoing_them(
    run_cli, fast_sim, rows_input, tmp_path: Path
) -> None:
    """A user:password@ in a backend URL went into Prefect's parameters, report.json and report.md; in an
    engine address it was printed by usage errors (ray://, or no scheme at all, which no mask matched) or
    raised mid-run by Dask. Each is refused before anything runs, and the refusal does not echo it."""
    password = "pw-51d0c3e2"
    closed = f"127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    for flags, env in (
        (("--runner", "ray", "--ray-address", f"ray://alice:{password}@{closed}"), {}),
        (("--runner", "ray", "--ray-address", f"alice:{password}@{closed}"), {}),
        (("--runner", "ray"), {"RAY_ADDRESS": f"alice:{password}@{closed}"}),
        (("--runner", "dask", "--dask-address", f"tcp://alice:{password}@{closed}"), {}),
        (("--runner", "dask", "--dask-address", f"tcp://alice:pa/{password}@{closed}"), {}),
        (("--dask-address", f"tcp://alice:{password}@{closed}"), {}),  # ignored by the local runner, refused
        (("--backend-url", f"{fast_sim.url},http://bob:{password}@{closed}"), {}),
    ):
        res = run_cli(*run_args(rows_input, str(out), fast_sim), *flags, env=env)
        said = "carries a user and password"
        assert res.returncode == 2 and said in res.stderr, (flags, res.stderr[-3000:])
        assert password not in res.stderr + res.stdout and not out.exists(), (flags, res.stderr[-3000:])
    res = run_cli("ray-workers", "--ray-address", f"alice:{password}@{closed}", "--keep-s", "60")
    assert res.returncode == 2 and password not in res.stderr + res.stdout, res.stderr[-3000:]


def test_a_urls_credentials_are_masked_in_any_redacted_text() -> None:
    """Error texts from libraries (a connect error naming the URL) reach logs and failures files."""
    text = "cannot connect to ray://alice:pw-0a9e@10.0.0.1:10001 or http://bob:x@h/v1"
    assert redact.redact(text) == "cannot connect to ray://***@10.0.0.1:10001 or http://***@h/v1"
    # with no scheme, as Prefect logs a served run's parameters that failed validation
    text = "'ray_address': 'alice:pw-0a9e@10.0.0.1:10001', mail a@b.c, path http://h/a@b"
    assert redact.redact(text) == "'ray_address': '***@10.0.0.1:10001', mail a@b.c, path http://h/a@b"


def test_a_short_key_never_changes_a_number_or_breaks_the_report(run_cli, fast_sim, tmp_path: Path) -> None:
    """An API key of `1` (or `null`, `true`, `32`) was masked inside report.json's rendered text, which was
    then parsed back: a traceback after publishing, no report, no card. Values are scrubbed, not text."""
    from rollout_data import write_rows

    inp = write_rows(tmp_path / "rows.jsonl", 16)
    for key in ("1", "null", "32"):
        out = tmp_path / f"out-{key}"
        res = run_cli(*run_args(inp, str(out), fast_sim), env={"ROLLFLOW_BACKEND__API_KEY": key})
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["rows_written"] == 32 and report["published"] is True
        assert (
            report["spec"]["collection"]["num_repeats"] == 2
            and report["spec"]["collection"]["parallelism"] == 16
        )
        assert (out / "README.md").exists()
        for name in ("report.json", "report.md", "README.md"):  # 127.0.0.***:8000 named no endpoint
            text = (out / name).read_text()
            assert fast_sim.url in text and "***" not in text, (name, key)


def test_scrubbing_a_value_masks_its_strings_only(monkeypatch) -> None:
    monkeypatch.setattr(redact._SECRETS, "values", frozenset({"1", "null"}))
    value = {"n": 1, "f": 1.5, "b": True, "z": None, "s": "key 1 here", "k 1": ["null", 1, None]}
    assert redact.redact_value(value) == {
        "n": 1, "f": 1.5, "b": True, "z": None, "s": "key *** here", "k ***": ["***", 1, None]
    }  # fmt: skip


def test_a_password_in_the_input_url_is_refused_before_any_record(run_cli, tmp_path: Path) -> None:
    """`--input https://user:pw@host/prompts.jsonl` was written in clear into run.json, the reports, the
    artifact and the flow run's `input` parameter; it is refused, without echoing the password."""
    out = tmp_path / "out"
    for flag, value in (
        ("--input", "https://alice:s3cr3t@example.com/p.jsonl"),
        ("--output", "s3://k:s3cr3t@b/o"),
    ):
        args = {"--input": "in.jsonl", "--output": str(out), flag: value}
        res = run_cli("collect", "--input", args["--input"], "--output", args["--output"], "--no-progress")
        assert res.returncode == 2 and flag in res.stderr and "user and password" in res.stderr, res.stderr
        assert "s3cr3t" not in res.stderr and not out.exists()


def test_reverify_refuses_a_password_in_its_source_or_output(run_cli, tmp_path: Path) -> None:
    """reverify took `user:pw@` in its source and --output: the flow run's parameters and its state
    message kept the password in Prefect's database (only the console masked it)."""
    out = tmp_path / "rv"
    for source, output in (
        ("http://bob:hunter2@127.0.0.1:9/x", str(out)),
        (str(tmp_path), "s3://k:hunter2@b/o"),
    ):
        res = run_cli("reverify", source, "--output", output, "--no-progress")
        assert res.returncode == 2 and "user and password" in res.stderr, res.stderr[-2000:]
        assert "hunter2" not in res.stderr and not out.exists()
