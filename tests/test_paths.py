"""Paths are checked before the first request; --restart removes the dataset it published, wherever."""

from __future__ import annotations

from pathlib import Path

from rollout_data import write_rows
from test_errors import args_for, one_paragraph

from rollflow.infra.local import spawn_simulator


def test_input_inside_the_output_is_refused_and_kept(run_cli, fast_sim, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    inp = write_rows(out / "in.jsonl", 10)
    before = inp.read_bytes()
    for extra in ((), ("--restart",)):
        res = run_cli(*args_for(inp, out, fast_sim.url), *extra)
        assert res.returncode == 2, res.stderr
        assert "is inside the output directory" in one_paragraph(res.stderr)
        assert inp.read_bytes() == before and not (out / "chunks").exists()


def test_dataset_path_that_is_a_directory_is_refused_before_any_request(run_cli, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "in.jsonl", 10)
    target = tmp_path / "results"
    target.mkdir()
    res = run_cli(
        "collect", "--backend-url", fast_sim.url, "--no-progress",
        f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={target}",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert f"The dataset path {target} is a directory" in one_paragraph(res.stderr)
    assert not (tmp_path / "results.rollflow" / "chunks").exists()


def test_restart_removes_the_dataset_it_published_outside_the_output(run_cli, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "in.jsonl", 20)
    target = tmp_path / "results" / "rollouts.jsonl"
    common = ["--no-progress", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={target}", "+num_repeats=2"]
    assert run_cli("collect", "--backend-url", fast_sim.url, *common).returncode == 0
    assert len(target.read_bytes().splitlines()) == 40
    broken = spawn_simulator("--latency-ms", "1", "--fault-rate", "1", "--fault-kinds", "500")
    try:
        res = run_cli("collect", "--backend-url", broken.url, "--restart", "--max-retries", "0", *common)
    finally:
        broken.stop()
    assert res.returncode == 1, res.stderr
    assert not target.exists(), "a restart that published nothing left the discarded run's dataset"
