"""Publishing beside other files: per-task files named after their dataset, a user's files left alone,
partial copies of a killed publish removed, a full disk and an unwritable output said in one paragraph."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import yaml
from rollout_data import assert_complete, write_rows
from test_errors import args_for, one_paragraph

USER_FILE = b'{"mine": "a file of the user\'s, never touched"}\n'


def _collect(run_cli, url: str, inp: Path, dataset: Path, *extra: str):
    return run_cli(
        "collect", "--backend-url", url, "--no-progress", "+num_repeats=2",
        f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={dataset}", *extra,
    )  # fmt: skip


def _task_indices(path: Path) -> list[int]:
    return [orjson.loads(line)["task_index"] for line in path.read_bytes().splitlines()]


def test_two_datasets_in_one_folder_keep_their_own_task_files(run_cli, fast_sim, tmp_path: Path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "tasks.jsonl").write_bytes(USER_FILE)
    math = write_rows(tmp_path / "math.jsonl", 30)
    code = write_rows(tmp_path / "code.jsonl", 12, start=500)
    for inp in (math, code):
        res = _collect(run_cli, fast_sim.url, inp, results / inp.name)
        assert res.returncode == 0, res.stderr
    assert _task_indices(results / "math.tasks.jsonl") == list(range(30))
    assert _task_indices(results / "code.tasks.jsonl") == list(range(12))
    assert (results / "tasks.jsonl").read_bytes() == USER_FILE
    code_tasks = (results / "code.tasks.jsonl").read_bytes()
    # a restart of one discards its own dataset and per-task file, and nothing of the other's or the user's
    res = _collect(run_cli, fast_sim.url, math, results / "math.jsonl", "--restart", "--limit", "5")
    assert res.returncode == 0, res.stderr
    assert _task_indices(results / "math.tasks.jsonl") == list(range(5))
    assert (results / "code.tasks.jsonl").read_bytes() == code_tasks
    assert (results / "tasks.jsonl").read_bytes() == USER_FILE


def test_an_output_named_by_another_path_is_still_its_own(run_cli, fast_sim, tmp_path: Path):
    """`out` typed in one folder, then the same folder by its absolute path (as a deployment names it) or
    as `./out`: the files the output published beside its dataset are still its own, so the run resumes,
    republishes and restarts."""
    inp = write_rows(tmp_path / "rows.jsonl", 20)
    res = run_cli(*args_for(inp, "out", fast_sim.url), cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    for out, extra in (
        (tmp_path / "out", ()),
        ("./out", ()),
        (tmp_path / "out", ("--restart", "--limit", "5")),
    ):
        res = run_cli(*args_for(inp, out, fast_sim.url, *extra), cwd=str(tmp_path))
        assert res.returncode == 0, f"{out} {extra}: {res.stderr[-2000:]}"
    assert _task_indices(tmp_path / "out" / "rollouts.tasks.jsonl") == list(range(5))
    assert len((tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()) == 5


def _card(path: Path) -> tuple[int, str]:
    """(rollouts, data file) from a dataset card's YAML front matter."""
    meta = yaml.safe_load(path.read_text().split("---\n")[1])
    return meta["rollflow"]["rollouts"], meta["configs"][0]["data_files"][0]["path"]


def test_two_datasets_in_one_folder_keep_their_own_cards(run_cli, fast_sim, tmp_path: Path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "README.md").write_bytes(USER_FILE)
    math = write_rows(tmp_path / "math.jsonl", 30)
    code = write_rows(tmp_path / "code.jsonl", 12, start=500)
    for inp in (math, code):
        res = _collect(run_cli, fast_sim.url, inp, results / inp.name)
        assert res.returncode == 0, res.stderr
    assert _card(results / "math.README.md") == (60, "math.jsonl")
    assert _card(results / "code.README.md") == (24, "code.jsonl")
    assert (results / "README.md").read_bytes() == USER_FILE
    code_card = (results / "code.README.md").read_bytes()
    res = _collect(run_cli, fast_sim.url, math, results / "math.jsonl", "--restart", "--limit", "5")
    assert res.returncode == 0, res.stderr
    assert _card(results / "math.README.md") == (10, "math.jsonl")
    assert (results / "code.README.md").read_bytes() == code_card
    assert (results / "README.md").read_bytes() == USER_FILE


def test_a_users_file_where_the_card_goes_is_refused(run_cli, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "in.jsonl", 10)
    theirs = tmp_path / "math.README.md"
    theirs.write_bytes(USER_FILE)
    res = _collect(run_cli, fast_sim.url, inp, tmp_path / "math.jsonl")
    assert res.returncode == 2, res.stderr
    message = one_paragraph(res.stderr)
    assert f"{theirs} exists and was not written by this output" in message and "No request" in message
    assert theirs.read_bytes() == USER_FILE and not (tmp_path / "math.jsonl").exists()


def test_a_users_file_where_the_task_file_goes_is_refused(run_cli, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "in.jsonl", 10)
    theirs = tmp_path / "math.tasks.jsonl"
    theirs.write_bytes(USER_FILE)
    res = _collect(run_cli, fast_sim.url, inp, tmp_path / "math.jsonl")
    assert res.returncode == 2, res.stderr
    message = one_paragraph(res.stderr)
    assert f"{theirs} exists and was not written by this output" in message and "No request" in message
    assert theirs.read_bytes() == USER_FILE and not (tmp_path / "math.jsonl").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_partial_copies_of_a_killed_publish_are_removed(run_cli, fast_sim, tmp_path: Path):
    """A publish killed mid-copy leaves `<dataset>.tmp-<pid>-<hex>`; the next run removes it, but never
    the copy of a writer that is still alive."""
    inp = write_rows(tmp_path / "in.jsonl", 20)
    out = tmp_path / "out"
    out.mkdir()
    dead = out / f"rollouts.jsonl.tmp-{_dead_pid()}-0badc0de"
    dead.write_bytes(b"half a dataset" * 1000)
    dead_tasks = out / f"rollouts.tasks.jsonl.tmp-{_dead_pid()}-0badc0de"
    dead_tasks.write_bytes(b"half")
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = out / f"rollouts.jsonl.tmp-{writer.pid}-1ive1ive"
        live.write_bytes(b"still being written")
        res = run_cli(*args_for(inp, out, fast_sim.url))
        assert res.returncode == 0, res.stderr
        assert not dead.exists() and not dead_tasks.exists()
        assert live.exists()
    finally:
        writer.kill()
        writer.wait()
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 20, 1)


@contextlib.contextmanager
def tmpfs(path: Path, *options: str) -> Iterator[Path]:
    """A small tmpfs at `path` (root only: the disk that fills up, or the file system that is read-only)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join(options)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(shutil.which("mount") is None or os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_while_publishing_is_one_paragraph_and_a_rerun_publishes(run_cli, fast_sim, tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", 200)
    out = tmp_path / "out"
    with tmpfs(tmp_path / "small", "size=128k") as disk:
        dataset = disk / "rollouts.jsonl"
        args = args_for(inp, out, fast_sim.url, "--dataset", str(dataset), "--num-repeats", "2")
        res = run_cli(*args)
        assert res.returncode == 2, res.stderr
        message = one_paragraph(res.stderr)
        assert "Traceback" not in res.stderr, res.stderr
        assert f"Publishing {dataset} failed: no space left on device (ENOSPC)" in message, message
        assert "committed chunks" in message and "run the same command again" in message
        assert not dataset.exists() and os.listdir(disk) == []
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["published"] is False and "ENOSPC" in report["publish_error"]
        manifests = sorted((out / "chunks").glob("*.json"))
        assert len(manifests) == 4
        committed = {m.name: m.read_bytes() for m in (out / "chunks").iterdir()}
        # room again: the same command publishes what is committed, collecting nothing again
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
        manifests_now = {m.name: m.read_bytes() for m in (out / "chunks").glob("*.json")}
        assert manifests_now == {k: v for k, v in committed.items() if k.endswith(".json")}
        # the committed bytes are the dataset's now: its chunk objects went once it was published
        assert dataset.read_bytes() == b"".join(v for k, v in sorted(committed.items()) if k.endswith("l"))
        assert not list((out / "chunks").glob("*.jsonl"))
        assert orjson.loads((out / "report.json").read_bytes())["metrics"]["chunks_run"] == 0
        assert_complete(dataset.read_bytes().splitlines(), 200, 2)


def _unprivileged(args: list[str]) -> list[str]:
    """As root, the command runs without the capabilities that bypass file permissions."""
    if os.geteuid() != 0:
        return args
    drop = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", "--bounding-set", drop, "--inh-caps", drop, *args]


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="needs setpriv as root")
def test_unwritable_local_output_gets_advice_for_local_paths(cli_env, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "in.jsonl", 5)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    exe = str(Path(sys.executable).with_name("rollflow"))
    try:
        res = subprocess.run(
            _unprivileged([exe, *args_for(inp, locked / "out", fast_sim.url)]),
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        locked.chmod(0o755)
    assert res.returncode == 2, res.stderr
    message = one_paragraph(res.stderr)
    assert "permission denied (EACCES)" in message and "chmod" in message, message
    assert "AWS" not in message and "credentials" not in message and "bucket" not in message


def test_a_moved_output_runs_again_as_itself(run_cli, fast_sim, tmp_path: Path):
    """published.json held absolute paths: after `mv out_a out_b` the same command refused its own
    rollouts.tasks.jsonl as another's. Files inside the output are recorded relative to it."""
    from cli_runs import run_args

    inp = write_rows(tmp_path / "rows.jsonl", 20)
    first = tmp_path / "out_a"
    res = run_cli(*run_args(inp, str(first), fast_sim))
    assert res.returncode == 0, res.stderr
    data = (first / "rollouts.jsonl").read_bytes()
    moved = tmp_path / "out_b"
    shutil.move(first, moved)
    res = run_cli(*run_args(inp, str(moved), fast_sim))
    assert res.returncode == 0, res.stderr
    assert (moved / "rollouts.jsonl").read_bytes() == data
    report = orjson.loads((moved / "report.json").read_bytes())
    assert report["published"] and report["rows_written"] == 40


@pytest.mark.skipif(shutil.which("mount") is None or os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_while_writing_parquet_is_one_paragraph(run_cli, fast_sim, tmp_path):
    """ENOSPC in the Parquet writer ended in two tracebacks and exit 1, with no report; it is JSONL's one
    paragraph, exit 2, and the report says so."""
    inp = write_rows(tmp_path / "in.jsonl", 1000)
    out = tmp_path / "out"
    with tmpfs(out / "data", "size=4k"):
        res = run_cli(*args_for(inp, out, fast_sim.url, "--format", "parquet", "--num-repeats", "2"))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
        message = one_paragraph(res.stderr)
        assert f"Publishing {out / 'data'} failed: no space left on device (ENOSPC)" in message, message
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["published"] is False and "ENOSPC" in report["publish_error"]
        assert not [p for p in (out / "data").iterdir() if p.name.endswith(".parquet")]


def test_a_restart_removes_all_the_discarded_run_published_and_only_that(run_cli, fast_sim, tmp_path: Path):
    """What a run owns was written in five places, and rewards.png was in none: a --restart that did not
    publish kept the discarded run's plot. Every object a publish writes is in the output's one record, and
    a restart removes exactly those, in the output and beside a dataset elsewhere."""
    from cli_runs import run_args

    from rollflow.infra.local import free_port

    inp, out, elsewhere = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "out", tmp_path / "results"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_bytes(USER_FILE)
    dataset = elsewhere / "math.jsonl"
    args = [*run_args(inp, str(out), fast_sim), "--verifier", "exact_match", "--dataset", str(dataset)]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    record = orjson.loads((out / "published.json").read_bytes())
    assert set(record) >= {"dataset", "tasks", "cards", "report"}, record
    assert {"report.json", "report.md", "rewards.png"} <= {e["path"] for e in record["report"]}, record
    # beside the output, relative to it (a copied folder names its own), with the size it was published at
    assert record["dataset"] == [
        {
            "path": "../results/math.jsonl",
            "size": dataset.stat().st_size,
            "at": str(dataset),
            "by": str(out),
        }
    ], record
    owned = [(out / e["path"]).resolve() for kind in record.values() for e in kind]
    assert all(p.exists() for p in owned) and (out / "rewards.png").exists(), owned
    dead = f"http://127.0.0.1:{free_port()}"
    restart = [a if a != fast_sim.url else dead for a in args]
    res = run_cli(*restart, "--restart", "--num-repeats", "3")
    assert res.returncode == 2, res.stderr
    assert [p for p in owned if p.exists()] == [] and orjson.loads(
        (out / "published.json").read_bytes()
    ) == {}
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes.txt"]
    assert (elsewhere / "notes.txt").read_bytes() == USER_FILE


def test_a_restart_never_deletes_a_file_that_is_not_what_the_run_published(run_cli, fast_sim, tmp_path: Path):
    """A relative --dataset recorded as typed was deleted, on a restart run from another folder, in that
    folder (a user's file); in a copied results folder a restart deleted the original's files and kept the
    copy's; a restart of a folder that never held a run deleted a user's `parquet/` and `data/` files."""
    from cli_runs import run_args

    inp = write_rows(tmp_path / "rows.jsonl", 20)
    first, other = tmp_path / "first", tmp_path / "other"
    for folder in (first, other):
        (folder / "shared").mkdir(parents=True)
    (other / "shared" / "data.jsonl").write_bytes(USER_FILE)
    out = first / "out"
    res = run_cli(*run_args(inp, "out", fast_sim), "--dataset", "shared/data.jsonl", cwd=first)
    assert res.returncode == 0, res.stderr
    res = run_cli(
        *run_args(inp, str(out), fast_sim), "--dataset", str(first / "new.jsonl"), "--restart", cwd=other
    )
    assert res.returncode == 0, res.stderr
    assert (other / "shared" / "data.jsonl").read_bytes() == USER_FILE
    assert not (first / "shared" / "data.jsonl").exists(), "the discarded run's own dataset goes"

    results = tmp_path / "results"
    results.mkdir()
    res = run_cli(
        *run_args(inp, str(results / "r.jsonl.rollflow"), fast_sim), "--dataset", str(results / "r.jsonl")
    )
    assert res.returncode == 0, res.stderr
    copy = tmp_path / "results2"
    shutil.copytree(results, copy)
    again = run_cli(
        *run_args(inp, str(copy / "r.jsonl.rollflow"), fast_sim), "--dataset", str(copy / "r.jsonl")
    )
    assert again.returncode == 0, again.stderr  # the copy is itself: its dataset is its own
    originals = {p.name: p.read_bytes() for p in results.iterdir() if p.is_file()}
    res = run_cli(
        *run_args(inp, str(copy / "r.jsonl.rollflow"), fast_sim),
        "--dataset",
        str(copy / "o.jsonl"),
        "--restart",
    )
    assert res.returncode == 0, res.stderr
    assert {p.name: p.read_bytes() for p in results.iterdir() if p.is_file()} == originals
    assert not (copy / "r.jsonl").exists() and not (copy / "r.tasks.jsonl").exists()

    fresh = tmp_path / "proj"
    (fresh / "parquet").mkdir(parents=True)
    (fresh / "data").mkdir()
    (fresh / "parquet" / "notes.txt").write_bytes(USER_FILE)
    (fresh / "data" / "train-00000-of-00001.parquet").write_bytes(USER_FILE)
    res = run_cli(*run_args(inp, str(fresh), fast_sim), "--dataset", str(fresh / "out.jsonl"), "--restart")
    assert res.returncode == 0, res.stderr
    assert (fresh / "parquet" / "notes.txt").read_bytes() == USER_FILE
    assert (fresh / "data" / "train-00000-of-00001.parquet").read_bytes() == USER_FILE


def test_a_file_put_at_the_dataset_path_after_a_failed_run_is_not_overwritten(
    run_cli, fast_sim, tmp_path: Path
):
    """A run that failed before publishing had recorded its --dataset; a user's file put there afterwards
    was overwritten by the next run, as if the output had written it."""
    from cli_runs import run_args

    from rollflow.infra.local import free_port

    inp, out, dataset = write_rows(tmp_path / "rows.jsonl", 10), tmp_path / "out", tmp_path / "shared.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    args = [a if a != fast_sim.url else dead for a in run_args(inp, str(out), fast_sim)]
    res = run_cli(*args, "--dataset", str(dataset))
    assert res.returncode == 2, res.stderr
    dataset.write_bytes(USER_FILE)
    res = run_cli(*run_args(inp, str(out), fast_sim), "--dataset", str(dataset))
    assert res.returncode == 2 and "was not written by this output" in res.stderr, res.stderr
    assert dataset.read_bytes() == USER_FILE


def test_a_dataset_beside_its_output_goes_only_with_the_folder_that_published_it(
    run_cli, fast_sim, tmp_path: Path
):
    """A copy of an output whose dataset lies outside it named the same file: the copy's --restart deleted
    the original's dataset (its only copy once the chunk data had gone). The moved output was refused as
    not having written its own dataset, and reverify, run from another folder, read run.json's dataset
    URL against that folder: it refused ("no dataset") or rescored another run's file."""
    from cli_runs import run_args

    inp = write_rows(tmp_path / "rows.jsonl", 20)
    cwd, elsewhere = tmp_path / "cwd", tmp_path / "elsewhere"
    cwd.mkdir()
    (elsewhere / "ds").mkdir(parents=True)
    args = [*run_args(inp, "../out", fast_sim), "--dataset", "ds.jsonl"]
    res = run_cli(*args, cwd=str(cwd))
    assert res.returncode == 0, res.stderr
    published = {p.name: p.read_bytes() for p in cwd.iterdir()}
    assert "ds.jsonl" in published, published

    shutil.copytree(tmp_path / "out", tmp_path / "copy")
    res = run_cli(*run_args(inp, "../copy", fast_sim), "--restart", "--num-repeats", "3", cwd=str(cwd))
    assert res.returncode == 0, res.stderr
    assert {p.name: p.read_bytes() for p in cwd.iterdir()} == published, "the copy deleted the original's"

    (tmp_path / "moved").mkdir()
    shutil.move(tmp_path / "out", tmp_path / "moved" / "out")
    res = run_cli(*[a if a != "../out" else "../moved/out" for a in args], cwd=str(cwd))
    assert res.returncode == 0, res.stderr
    rows = {p.name: p.read_bytes() for p in cwd.iterdir() if p.suffix == ".jsonl"}
    assert rows == {k: v for k, v in published.items() if k.endswith(".jsonl")}, "the moved output is itself"

    (elsewhere / "ds.jsonl").write_bytes(published["ds.jsonl"].splitlines(keepends=True)[0])  # another file
    res = run_cli(
        "reverify", str(tmp_path / "moved" / "out"), "--output", str(tmp_path / "rv"), "--no-progress",
        cwd=str(elsewhere),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert orjson.loads((tmp_path / "rv" / "report.json").read_bytes())["rows_written"] == 40


@pytest.mark.skipif(shutil.which("mount") is None or os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_while_committing_a_chunk_is_one_paragraph(run_cli, fast_sim, tmp_path):
    """ENOSPC was one paragraph only when the dataset was copied: a chunk's commit, the audit or the card
    on a full disk ended in tracebacks and exit 1."""
    inp = write_rows(tmp_path / "in.jsonl", 600)
    with tmpfs(tmp_path / "small", "size=96k") as small:
        res = run_cli(*args_for(inp, small / "out", fast_sim.url, "--num-repeats", "4"))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    message = one_paragraph(res.stderr)
    assert "no space left on device (ENOSPC)" in message and "run the same command again" in message, message


def test_a_users_readme_in_a_folder_that_never_held_a_run_is_not_replaced(run_cli, fast_sim, tmp_path):
    """A README.md or report.md in a new output folder was replaced by the card and the report, silently."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_bytes(USER_FILE)
    res = run_cli(*args_for(write_rows(tmp_path / "in.jsonl", 10), out, fast_sim.url))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "README.md, which no rollflow run wrote" in one_paragraph(res.stderr)
    assert (out / "README.md").read_bytes() == USER_FILE and not (out / "run.json").exists()
