"""The report agrees with the dataset it describes: withdrawn chunks and duplicates leave its figures, one
reward mean, pass@k over one stated set of tasks, and the Prefect artifact shows its plots."""

from __future__ import annotations

import hashlib
import statistics
import subprocess
import sys
import urllib.request
from fractions import Fraction
from math import comb
from pathlib import Path

import orjson
import pytest
from rollout_data import write_rows
from test_errors import args_for

from rollflow.infra.local import spawn_simulator

ROWS, CHUNK = 60, 20  # three chunks
ROOT = Path(__file__).resolve().parent.parent


def _args(inp: Path, out: Path, url: str, *extra: str) -> list[str]:
    base = args_for(inp, out, url, *extra)
    base[base.index("--chunk-size") + 1] = str(CHUNK)
    return base


def _unique_rewards(dataset: Path) -> dict[tuple[int, int], float]:
    rows = (orjson.loads(line) for line in dataset.read_bytes().splitlines())
    return {(r["_ng_task_index"], r["_ng_rollout_index"]): r["reward"] for r in rows}


def _duplicate_a_line(out: Path, chunk: int) -> None:
    """A line written twice, its manifest made to vouch for it: the audit counts a duplicate."""
    data_path, manifest_path = out / "chunks" / f"{chunk:05d}.jsonl", out / "chunks" / f"{chunk:05d}.json"
    lines = data_path.read_bytes().splitlines(keepends=True)
    data = b"".join([lines[0], *lines])
    data_path.write_bytes(data)
    manifest = orjson.loads(manifest_path.read_bytes())
    manifest.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    manifest_path.write_bytes(orjson.dumps(manifest))


def _change_rewards(out: Path, chunk: int) -> None:
    """Bytes changed after the commit (valid rows, other rewards): the audit withdraws the chunk."""
    path = out / "chunks" / f"{chunk:05d}.jsonl"
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    path.write_bytes(b"".join(orjson.dumps({**r, "reward": 0.25}) + b"\n" for r in rows))


def _run_then(run_cli, sim_url: str, tmp_path: Path, tamper) -> tuple[dict, dict[tuple[int, int], float]]:
    """A complete run, its output tampered with, the same command again with --allow-incomplete."""
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    args = _args(inp, out, sim_url, "--num-repeats", "2", "--keep-chunks")  # the chunk objects to tamper
    assert run_cli(*args).returncode == 0
    tamper(out)
    res = run_cli(*args, "--allow-incomplete")
    assert res.returncode == 0, res.stderr
    return orjson.loads((out / "report.json").read_bytes()), _unique_rewards(out / "rollouts.jsonl")


def test_a_withdrawn_chunk_leaves_the_report(run_cli, fast_sim, tmp_path: Path):
    report, rewards = _run_then(run_cli, fast_sim.url, tmp_path, lambda out: _change_rewards(out, 1))
    assert sorted({task // CHUNK for task, _ in rewards}) == [0, 2]  # the withdrawn chunk is not published
    assert report["missing_chunks"] == [1] and report["missing"] == CHUNK * 2
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| missing | {CHUNK * 2:,} |" in card and f"missing: {CHUNK * 2}" in card  # table, front matter
    assert report["rows_written"] == report["rewards"]["rollouts"] == len(rewards) == 2 * CHUNK * 2
    assert report["rewards"]["tasks"] == 2 * CHUNK
    assert report["reward_mean"] == pytest.approx(statistics.fmean(rewards.values()), abs=1e-6)


def test_a_duplicate_line_counts_once_in_the_one_reward_mean(run_cli, fast_sim, tmp_path: Path):
    report, rewards = _run_then(run_cli, fast_sim.url, tmp_path, lambda out: _duplicate_a_line(out, 0))
    assert report["duplicates"] == 1 and report["rows_written"] == ROWS * 2 + 1
    assert report["rewards"]["rollouts"] == len(rewards) == ROWS * 2 and sum(rewards.values()) > 0
    mean = statistics.fmean(rewards.values())
    assert report["reward_mean"] == pytest.approx(mean, abs=1e-6)
    assert report["reward_mean"] == report["rewards"]["mean"]


def _brute_pass_at_k(rewards: dict[tuple[int, int], float], repeats: int) -> tuple[dict[str, float], int]:
    by_task: dict[int, list[float]] = {}
    for (task, _), reward in rewards.items():
        by_task.setdefault(task, []).append(reward)
    complete = [r for r in by_task.values() if len(r) == repeats]
    out = {}
    for k in (1, 2, 4):
        values = [
            1 - Fraction(comb(repeats - sum(x >= 1.0 for x in r), k), comb(repeats, k)) for r in complete
        ]
        out[str(k)] = float(sum(values) / len(values))
    return out, len(complete)


def test_pass_at_k_is_over_the_tasks_with_every_rollout(run_cli, tmp_path: Path):
    sim = spawn_simulator("--latency-ms", "1", "--fault-rate", "0.15", "--fault-kinds", "500", "--seed", "3")
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    try:
        res = run_cli(
            *_args(inp, out, sim.url, "--num-repeats", "4", "--max-retries", "0", "--allow-incomplete"),
            env={"ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.01"},
        )
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr
    report = orjson.loads((out / "report.json").read_bytes())
    want, complete = _brute_pass_at_k(_unique_rewards(out / "rollouts.jsonl"), 4)
    assert 0 < complete < ROWS, "some tasks must have lost a rollout for this test to mean anything"
    assert report["rewards"]["pass_at_k"] == pytest.approx(want, abs=1e-6)
    assert report["rewards"]["pass_at_k_tasks"] == {"1": complete, "2": complete, "4": complete}
    md = (out / "report.md").read_text()
    assert f"| 4 | {want['4']:.4f} | {complete:,} |" in md


def _report_artifact(server: object, output: Path) -> str:
    body = {"artifacts": {"key": {"any_": ["rollflow-report"]}}, "sort": "CREATED_DESC", "limit": 50}
    req = urllib.request.Request(
        f"{server.url}/api/artifacts/filter",  # type: ignore[attr-defined]
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    found = orjson.loads(urllib.request.urlopen(req, timeout=30).read())
    return next(a["data"] for a in found if f"Output: `{output}`" in a["data"])


def test_report_artifact_embeds_its_plots(run_cli, prefect_server, fast_sim, tmp_path: Path):
    """With tuning (--parallelism auto) the report has both plots: rewards.png and throughput.png."""
    inp = write_rows(tmp_path / "rows.jsonl", 100)
    out = tmp_path / "out"
    args = _args(inp, out, fast_sim.url, "--num-repeats", "4")
    args[args.index("--parallelism") + 1] = "auto"
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    markdown = _report_artifact(prefect_server, out)
    assert "(rewards.png)" not in markdown and "(throughput.png)" not in markdown
    assert "![per-task mean reward histogram](data:image/png;base64," in markdown
    assert markdown.count("](data:image/png;base64,") == 2, markdown[:2000]
    beside = (out / "report.md").read_text()  # the files beside report.md keep their names
    assert "(rewards.png)" in beside and "(throughput.png)" in beside


def test_card_figures_are_exact_counts_never_scientific() -> None:
    """10,003 rollouts showed as `1e+04` in the card's Figures table (its front matter said 10003)."""
    from rollflow.tasks.publish.card import _num

    assert [_num(v) for v in (10003, 1_000_000, 0.123456, 12345.678, None, True)] == [
        "10,003", "1,000,000", "0.1235", "12,345.7", "-", "yes"
    ]  # fmt: skip


def _collected_report(rows: int) -> dict:
    """A collection's report.json as the card reads it: rewards, failures and the story's figures."""
    tokens = {"rollouts": rows, "mean": 812.5, "p50": 790, "p95": 1400, "max": 2048, "total": rows * 812}
    return {
        "rows_written": rows,
        "failed": 3,
        "input": "s3://bucket/rows.jsonl",
        "format": "parquet",
        "rewards": {"tasks": 2501, "mean": 0.4375, "std": 0.25, "pass_at_k": {"1": 0.4375, "4": 0.8125}},
        "story": {
            "sent": None,
            "scored_by": None,
            "origin": {"input": "s3://bucket/rows.jsonl", "spec": {"note": "{{ not a template }}"}},
            "returned": {
                "failures_by_kind": {"verifier": 3},
                "truncation_rate": 0.0125,
                "tokens_out": tokens,
                "tokens_in": None,
                "finish_reasons": {"stop": rows - 3, "length": 3},
            },
        },
    }


def test_the_card_round_trips_through_huggingface_hub(tmp_path: Path) -> None:
    """The card is the Hub's DatasetCard: DatasetCard.load (a local path, no network) gives back every
    front-matter value (configs' data_files, size_categories, features, the figures under `rollflow`), as
    plain YAML gives them too; and its body keeps counts exact (10,003, never 1e+04)."""
    import yaml
    from huggingface_hub import DatasetCard

    from rollflow.tasks.publish.card import render_card

    features = [{"name": "reward", "dtype": "float64"}, {"name": "response", "dtype": "string"}]
    path = tmp_path / "README.md"
    path.write_text(render_card(_collected_report(10003), "data/*.parquet", features), encoding="utf-8")
    text = path.read_text(encoding="utf-8")
    expected = {
        "size_categories": ["10K<n<100K"],
        "task_categories": ["text-generation"],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}],
        "dataset_info": {"features": features, "splits": [{"name": "train", "num_examples": 10003}]},
        "tags": ["rollflow", "rollouts", "reinforcement-learning"],
        "rollflow": {
            "rollouts": 10003, "tasks": 2501, "reward_mean": 0.4375, "reward_std": 0.25,
            "pass_at_k": {"1": 0.4375, "4": 0.8125}, "failed": 3, "truncation_rate": 0.0125,
            "tokens_out_mean": 812.5, "tokens_in_mean": None,
        },
    }  # fmt: skip
    card = DatasetCard.load(path)
    assert card.data.to_dict() == expected
    assert card.data.to_dict()["configs"][0]["data_files"][0]["path"] == "data/*.parquet"
    assert card.data.size_categories == ["10K<n<100K"] and "license" not in card.data.to_dict()
    assert text.startswith("---\n") and yaml.safe_load(text.split("---\n", 2)[1]) == expected
    assert str(DatasetCard(text)) == text, "the Hub writes back the very card it read"
    assert "| rollouts | 10,003 |" in card.text and "1e+04" not in text
    assert "| finish reason | rollouts |" in card.text and "| stop | 10,000 |" in card.text
    assert "| failure kind | rollouts |" in card.text and "| verifier | 3 |" in card.text
    assert '"note": "{{ not a template }}"' in card.text, "the body is text, never a Jinja template"


@pytest.mark.parametrize("rows", [0, 7, 10003, 2_000_000])
@pytest.mark.parametrize("license", [None, "apache-2.0"])
def test_the_card_is_what_the_hub_writes(rows: int, license: str | None) -> None:
    """Written without huggingface_hub, the card is byte for byte the DatasetCard of the Hub's own
    DatasetCardData of the same values (its fields first, then the rest)."""
    from huggingface_hub import DatasetCard, DatasetCardData

    from rollflow.tasks.publish.card import card_data, render_card

    features = [{"name": "reward", "dtype": "float64"}, {"name": "answer ✓", "dtype": "string"}]
    report = {**_collected_report(rows), **({"license": license} if license else {})}
    text = render_card(report, "data/*.parquet", features)
    meta = card_data(report, "data/*.parquet", features)
    hub_meta = DatasetCardData(**meta).to_yaml()
    body = text.split("\n---\n", 1)[1]
    assert text == str(DatasetCard(f"---\n{hub_meta}\n---\n{body}"))
    assert list(meta)[:2] == (
        ["license", "size_categories"] if license else ["size_categories", "task_categories"]
    )


def test_a_card_of_a_run_where_every_rollout_failed_has_no_pass_at_k() -> None:
    """--allow-incomplete with every rollout failed: no task was scored, pass@k is {}; the card says "-"
    (it raised on formatting the empty figure as a number)."""
    from rollflow.tasks.publish.card import render_card

    report = _collected_report(0)
    report["rewards"] = {"tasks": 0, "mean": None, "std": None, "pass_at_k": {}}
    text = render_card(report, "rollouts.jsonl")
    assert "| pass at k | - |" in text, text


def test_the_card_does_not_import_huggingface_hub() -> None:
    """A run writes its card without importing huggingface_hub (0.3 s of every run's fixed cost)."""
    code = (
        "import sys, json; sys.path.insert(0, 'tests'); from test_report_figures import _collected_report; "
        "from rollflow.tasks.publish.card import render_card; render_card(_collected_report(5), 'x.jsonl'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'huggingface_hub')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert orjson.loads(out.stdout) == []
