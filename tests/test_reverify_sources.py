"""reverify reads what collection publishes: a dataset written elsewhere (--dataset, NeMo Gym's
+output_jsonl_fpath) through its run's folder; a Parquet output through the committed chunks its shards
were written from, refused when the two disagree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rollout_data import assert_complete, write_rows

from rollflow.infra.local import spawn_simulator


def _collect(run_cli, inp: Path, out: Path, url: str, *extra: str):
    res = run_cli(
        "collect", "--input", str(inp), "--output", str(out), "--backend-kind", "chat", "--backend-url", url,
        "--num-repeats", "2", "--parallelism", "8", "--verifier", "exact_match", "--verify-processes", "0",
        "--no-progress", *extra,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr


def test_reverify_finds_a_dataset_published_elsewhere(run_cli, fast_sim, tmp_path: Path) -> None:
    inp, out, dataset = (
        write_rows(tmp_path / "rows.jsonl", 12),
        tmp_path / "run",
        tmp_path / "results" / "x.jsonl",
    )
    _collect(run_cli, inp, out, fast_sim.url, "--dataset", str(dataset))
    assert not (out / "rollouts.jsonl").exists() and dataset.exists()
    res = run_cli("reverify", str(out), "--output", str(tmp_path / "rv"), "--verifier", "math_fast")
    assert res.returncode == 0, res.stderr
    assert_complete((tmp_path / "rv" / "rollouts.jsonl").read_bytes().splitlines(), 12, 2)


def _said(res) -> str:
    return " ".join(res.stderr.split())


def test_reverify_of_a_parquet_output_rescores_what_its_shards_hold(
    run_cli, fast_sim, tmp_path: Path
) -> None:
    """Plain reverify refused a Parquet output ("which reverify does not read"); it rescores its rows now,
    and refuses (exit 2, nothing written as a dataset) shards and committed chunks that disagree."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp, out = write_rows(tmp_path / "rows.jsonl", 12), tmp_path / "run"
    _collect(run_cli, inp, out, fast_sim.url, "--format", "parquet", "--chunk-size", "4")
    res = run_cli("reverify", str(out), "--output", str(tmp_path / "rv"), "--verifier", "math_fast")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_complete((tmp_path / "rv" / "rollouts.jsonl").read_bytes().splitlines(), 12, 2)
    chunks = sorted((out / "chunks").glob("*.jsonl"))
    assert (tmp_path / "rv" / "rollouts.jsonl").read_bytes().count(b"\n") == sum(
        c.read_bytes().count(b"\n") for c in chunks
    )

    def damaged(name: str, damage) -> str:
        copy = tmp_path / name
        shutil.copytree(out, copy)
        damage(copy)
        res = run_cli(
            "reverify", str(copy), "--output", str(tmp_path / f"rv-{name}"), "--verifier", "math_fast"
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr, (name, res.stderr[-3000:])
        assert not (tmp_path / f"rv-{name}" / "rollouts.jsonl").exists(), name
        return _said(res)

    def edit_shard(copy: Path) -> None:
        shard = next((copy / "data").glob("*.parquet"))
        table = pq.read_table(shard)
        i = table.schema.get_field_index("reward")
        values = table.column("reward").to_pylist()
        values[5] = 1.0 - values[5]
        table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
        pq.write_table(table, shard, compression="zstd")

    said = damaged("shard", edit_shard)
    assert "row 5 (from 0) is not the chunk row it was written from" in said, said
    assert "Remove" in said and "train-00000-of-00001.parquet" in said and "Nothing was rescored" in said

    def edit_chunk(copy: Path) -> None:
        chunk = copy / "chunks" / "00001.jsonl"
        chunk.write_bytes(chunk.read_bytes().replace(b'"reward":', b'"reward": ', 1))

    said = damaged("chunk", edit_chunk)
    assert "chunk 1's data (chunks/00001.jsonl) is not what its shard was written from" in said, said
    assert "Run the collection's command" in said

    def cut_chunk(copy: Path) -> None:
        chunk = copy / "chunks" / "00002.jsonl"
        chunk.write_bytes(chunk.read_bytes()[:50])

    said = damaged("cut", cut_chunk)
    assert "chunks/00002.jsonl, line 1:" in said, said

    said = damaged("gone", lambda copy: (copy / "chunks" / "00000.jsonl").unlink())
    assert "chunk 0's data (chunks/00000.jsonl) is gone" in said, said


CHUNK_REWRITER = """
import os

def verify(row, text):
    \"\"\"Scores 1.0; on its first call, cuts the source's last chunk object (a collection run over it).\"\"\"
    path = os.environ["RF_REWRITE_SOURCE"]
    try:
        os.close(os.open(path + ".cut", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return 1.0
    lines = open(path, "rb").read().splitlines(keepends=True)
    open(path + ".tmp", "wb").write(b"".join(lines[:2]))
    os.replace(path + ".tmp", path)
    return 1.0
"""


def test_a_parquet_source_changed_while_reverify_runs_publishes_nothing(
    run_cli, fast_sim, tmp_path: Path
) -> None:
    inp, out = write_rows(tmp_path / "rows.jsonl", 12), tmp_path / "run"
    _collect(run_cli, inp, out, fast_sim.url, "--format", "parquet", "--chunk-size", "4")
    (tmp_path / "chunk_rewriter.py").write_text(CHUNK_REWRITER)
    rv = tmp_path / "rv"
    args = ["reverify", str(out), "--output", str(rv), "--verifier", "chunk_rewriter:verify",
            "--chunks-in-flight", "1", "--verify-processes", "0"]  # fmt: skip
    env = {"PYTHONPATH": str(tmp_path), "RF_REWRITE_SOURCE": str(out / "chunks" / "00002.jsonl")}
    res = run_cli(*args, env=env)
    said = _said(res)
    assert res.returncode != 0 and "changed after this reverify planned it: chunk 2" in said, said[-3000:]
    assert "Traceback" not in res.stderr and not (rv / "rollouts.jsonl").exists(), said[-3000:]
    assert json.loads((rv / "report.json").read_text())["published"] is False
    # the source's shards no longer are its chunks: a restart refuses it whole, at its plan
    res = run_cli(*args, "--restart", env=env)
    said = _said(res)
    assert res.returncode == 2 and "chunk 2's data (chunks/00002.jsonl) is not what its shard" in said, said


def test_a_damaged_source_line_is_refused_at_its_line(run_cli, fast_sim, tmp_path: Path) -> None:
    """A line cut just after its _ng_* keys, a BOM on line 1 or a cut last line passed the plan (a regular
    expression read the keys) and each chunk then died on every attempt with a traceback."""
    inp, out = write_rows(tmp_path / "rows.jsonl", 12), tmp_path / "run"
    _collect(run_cli, inp, out, fast_sim.url)
    lines = (out / "rollouts.jsonl").read_bytes().splitlines(keepends=True)
    cut = lines[4][: lines[4].index(b'"_ng_rollout_index":') + len(b'"_ng_rollout_index":0,')] + b"\n"
    for name, damaged, line in (
        ("cut.jsonl", [*lines[:4], cut, *lines[5:]], 5),
        ("bom.jsonl", [b"\xef\xbb\xbf" + lines[0], *lines[1:]], 1),
        ("tail.jsonl", [*lines[:-1], lines[-1][:40]], len(lines)),
    ):
        source = tmp_path / name
        source.write_bytes(b"".join(damaged))
        res = run_cli(
            "reverify", str(source), "--output", str(tmp_path / f"rv-{name}"), "--verifier", "math_fast"
        )
        assert res.returncode == 2, (name, res.stderr[-2000:])
        assert f"line {line}:" in res.stderr and "Traceback" not in res.stderr, (name, res.stderr[-2000:])


REWRITER = '''
import os

def verify(row, text):
    """Scores 1.0; on its first call, cuts the source to its first 10 lines (a collection re-run over it)."""
    path = os.environ["RF_REWRITE_SOURCE"]
    try:
        os.close(os.open(path + ".cut", os.O_CREAT | os.O_EXCL))  # one check rewrites it, once
    except FileExistsError:
        return 1.0
    lines = open(path, "rb").read().splitlines(keepends=True)
    open(path + ".tmp", "wb").write(b"".join(lines[:10]))
    os.replace(path + ".tmp", path)  # whole: a check reading it meanwhile never sees it empty
    return 1.0
'''


def test_a_source_rewritten_while_reverify_runs_publishes_nothing(run_cli, fast_sim, tmp_path: Path) -> None:
    """A source republished under a running reverify (a collection re-run with --restart --limit) gave a
    dataset missing most rollouts, exit 0 and "complete": chunks read byte offsets without checking them."""
    inp, out = write_rows(tmp_path / "rows.jsonl", 30), tmp_path / "run"
    _collect(run_cli, inp, out, fast_sim.url)
    (tmp_path / "rewriter.py").write_text(REWRITER)
    source, rv = out / "rollouts.jsonl", tmp_path / "rv"
    args = ["reverify", str(source), "--output", str(rv), "--verifier", "rewriter:verify",
            "--chunk-size", "10", "--chunks-in-flight", "1", "--verify-processes", "0"]  # fmt: skip
    env = {"PYTHONPATH": str(tmp_path), "RF_REWRITE_SOURCE": str(source)}
    res = run_cli(*args, env=env)
    assert res.returncode != 0 and "changed after this reverify planned it" in res.stderr, res.stderr[-3000:]
    assert "--restart" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert not (rv / "rollouts.jsonl").exists()
    report = json.loads((rv / "report.json").read_text())
    assert report["published"] is False
    # what the source holds now is rescored by a restart, whole
    res = run_cli(*args, "--restart", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (rv / "rollouts.jsonl").read_bytes().count(b"\n") == 10


def test_reverify_of_a_folder_reads_the_dataset_its_run_published_last(
    run_cli, fast_sim, tmp_path: Path
) -> None:
    """The same run published rollouts.jsonl, then again with --dataset elsewhere: reverify of the folder
    read the stale rollouts.jsonl left beside it (here cut short), exit 0, most rollouts missing."""
    inp, out, other = write_rows(tmp_path / "rows.jsonl", 12), tmp_path / "run", tmp_path / "all.jsonl"
    _collect(run_cli, inp, out, fast_sim.url)
    _collect(run_cli, inp, out, fast_sim.url, "--dataset", str(other))
    stale = out / "rollouts.jsonl"
    stale.write_bytes(b"".join(stale.read_bytes().splitlines(keepends=True)[:4]))
    res = run_cli("reverify", str(out), "--output", str(tmp_path / "rv"), "--verifier", "math_fast")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_complete((tmp_path / "rv" / "rollouts.jsonl").read_bytes().splitlines(), 12, 2)


def test_failed_only_over_backend_failures_says_to_collect_them_again(run_cli, tmp_path: Path) -> None:
    """Rollouts that failed at the backend have no reply to score: --failed-only told the user to "run the
    same command again to retry them", which can never work."""
    sim = spawn_simulator("--latency-ms", "1", "--slots", "32", "--fault-rate", "0.3", "--fault-kinds", "500")
    inp, out = write_rows(tmp_path / "rows.jsonl", 12), tmp_path / "run"
    try:
        _collect(run_cli, inp, out, sim.url, "--allow-incomplete", "--max-retries", "0")
    finally:
        sim.stop()
    assert any((out / "failures").glob("*.jsonl")), "the faults left no failure to complete"
    res = run_cli("reverify", str(out), "--output", str(tmp_path / "rv"), "--verifier", "exact_match",
                  "--failed-only")  # fmt: skip
    said = " ".join(res.stderr.split())
    assert res.returncode != 0 and "failed at the backend" in said, said[-3000:]
    assert "run the collection's command" in said and "Run the same command again to retry" not in said
