"""rollflow as a drop-in for `ng_collect_rollouts`, against NeMo Gym 0.7.0's own server stack: a head server,
agent_a and agent_b (each its own model server on its own stub, whose replies say which stub answered).

Each test here failed on the code before the head-server lookup and per-row routing: rollflow posted to
127.0.0.1:8000, sent every row to one URL, refused the keys, or put the seed where agents reject it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_gym_rows import collect, read_jsonl, reply_text, row

from rollflow.infra.nemo_gym.stack import Stack, http_json
from rollflow.infra.nemo_gym.stub_model import FAIL_MARKER

# Fields that differ from ng_collect_rollouts' rows on purpose: rollflow's `_rf` (attempts, seed), and
# the input row's fields the reply leaves out (rollflow keeps the row whole; NeMo Gym keeps the reply).
OWN_FIELDS = {"_rf"}


def head_args(stack: Stack) -> list[str]:
    port = stack.head_url.rsplit(":", 1)[1]
    return ["+head_server.host=127.0.0.1", f"+head_server.port={port}"]


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stub_of(result: dict[str, Any]) -> str:
    """Which stub answered: 'A' or 'B' (the reply says `answer from X: ...`)."""
    return reply_text(result).split(":", 1)[0].removeprefix("answer from ")


def mixed_rows(n: int) -> list[dict[str, Any]]:
    """n rows, alternately agent_a's and agent_b's, each scored 1.0 only if its own agent's stub answers."""
    out = []
    for i in range(n):
        agent, stub = ("agent_a", "A") if i % 2 == 0 else ("agent_b", "B")
        out.append(row(f"question {i}", f"answer from {stub}: question {i}", agent))
    return out


def test_no_backend_url_finds_the_agent_through_the_head_server_and_writes_nemo_gyms_files(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    inp = write(
        tmp_path / "in.jsonl", [row(f"q{i}", f"answer from A: q{i}") for i in range(3)] + [row("q3", "x")]
    )
    out = tmp_path / "results" / "out.jsonl"
    res = run_cli(
        "collect", "+agent_name=agent_a", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
        *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr + nemo_gym_stack.log_tail()
    rows = read_jsonl(out)
    assert [r["_ng_task_index"] for r in rows] == [0, 1, 2, 3]
    assert {stub_of(r) for r in rows} == {"A"}
    assert [r["reward"] for r in rows] == [1.0, 1.0, 1.0, 0.0]
    assert {(r["_ng_environment_server"], r["_ng_result_type"]) for r in rows} == {
        ("agent_a_environment_server", "legacy_agent")
    }
    assert (out.parent / "out_failures.jsonl").read_text() == ""
    (metrics,) = json.loads((out.parent / "out_aggregate_metrics.json").read_text())
    assert metrics["_ng_environment_server"] == "agent_a_environment_server"
    assert metrics["agent_ref"] == {"name": "agent_a"}
    assert metrics["key_metrics"]["mean/reward"] == 0.75


def test_a_head_server_that_does_not_answer_is_one_error_naming_it(run_cli, tmp_path: Path) -> None:
    from fixtures_net import free_port

    port = free_port()
    inp = write(tmp_path / "in.jsonl", [row("q", "a")])
    res = run_cli(
        "collect", "+agent_name=agent_a", f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={tmp_path / 'out.jsonl'}", f"+head_server.port={port}", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert f"head server at http://127.0.0.1:{port}" in res.stderr and "Traceback" not in res.stderr


def test_mixed_agents_go_each_to_their_own_server(run_cli, nemo_gym_stack: Stack, tmp_path: Path) -> None:
    inp = write(tmp_path / "in.jsonl", mixed_rows(20))
    out = tmp_path / "out.jsonl"
    res = run_cli(
        "collect", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}", "+num_samples_in_parallel=8",
        *head_args(nemo_gym_stack), "--no-progress", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr + nemo_gym_stack.log_tail()
    rows = read_jsonl(out)
    assert len(rows) == 20
    for r in rows:
        agent = r["agent_ref"]["name"]
        assert stub_of(r) == {"agent_a": "A", "agent_b": "B"}[agent]
        assert r["_ng_environment_server"] == f"{agent}_environment_server"
        assert r["reward"] == 1.0
    report = json.loads((Path(f"{out}.rollflow") / "report.json").read_text())
    served = {tuple(e["agents"]): e["rollouts"] for e in report["endpoints"]}
    assert served == {("agent_a",): 10, ("agent_b",): 10}
    each = {"rollouts": 10, "failed": 0, "reward_mean": 1.0}
    assert report["agents"] == {"agent_a": each, "agent_b": each}, report["agents"]
    card = (tmp_path / "out.README.md").read_text()
    assert "## Agents" in card and "| agent_b | 10 | 0 | 1.0000 |" in card, card
    assert "agents" in res.stderr and "reward mean" in res.stderr, res.stderr
    metrics = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    assert sorted(m["_ng_environment_server"] for m in metrics) == [
        "agent_a_environment_server",
        "agent_b_environment_server",
    ]


def test_agent_name_overrides_every_row_and_agent_map_re_routes(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    inp = write(tmp_path / "in.jsonl", mixed_rows(6))
    out = tmp_path / "over.jsonl"
    res = run_cli(
        "collect", "+agent_name=agent_b", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
        *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert {(r["agent_ref"]["name"], stub_of(r)) for r in read_jsonl(out)} == {("agent_b", "B")}
    mapped = tmp_path / "mapped.jsonl"
    res = run_cli(
        "collect", "+agent_map={agent_a:agent_b, agent_b: agent_a}", f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={mapped}", *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for r in read_jsonl(mapped):
        swapped = "agent_b" if r["_ng_task_index"] % 2 == 0 else "agent_a"
        assert r["agent_ref"] == {"name": swapped} and stub_of(r) == swapped[-1].upper()


def test_unknown_agents_are_refused_before_any_request(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    before = {s: nemo_gym_stack.stub_requests(s)["count"] for s in ("A", "B")}
    inp = write(tmp_path / "in.jsonl", [*mixed_rows(2), row("q", "a", "agent_c")])
    res = run_cli(
        "collect", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={tmp_path / 'o.jsonl'}",
        *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "line 3" in res.stderr and "'agent_c'" in res.stderr and "agent_a, agent_b" in res.stderr
    res = run_cli(
        "collect", "+agent_name=agent_aa", f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={tmp_path / 't.jsonl'}", *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "did you mean 'agent_a'" in res.stderr, res.stderr
    assert {s: nemo_gym_stack.stub_requests(s)["count"] for s in ("A", "B")} == before


def test_seeds_and_nested_overrides_reach_the_model_where_agents_take_them(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    inp = write(tmp_path / "in.jsonl", [row(f"s{i}", f"answer from A: s{i}") for i in range(3)])
    for extra, seed_of in (
        (["+num_repeats_add_seed=true"], lambda r: r["_ng_rollout_index"]),
        (["--seed", "7"], lambda r: r["_rf"]["seed"]),
    ):
        out = tmp_path / f"seed{len(extra)}.jsonl"
        res = run_cli(
            "collect", "+agent_name=agent_a", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
            "+num_repeats=2", "+responses_create_params.reasoning.effort=low", *extra,
            *head_args(nemo_gym_stack), "--no-progress",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr + nemo_gym_stack.log_tail()
        rows = read_jsonl(out)
        assert len(rows) == 6 and all(r["reward"] == 1.0 for r in rows)
        for r in rows:
            params = r["responses_create_params"]
            assert params["reasoning"]["effort"] == "low"
            assert json.loads(params["metadata"]["extra_body"])["seed"] == seed_of(r)


def test_the_gym_eval_run_form_writes_the_dataset_file(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    inp = write(tmp_path / "in.jsonl", [row(f"e{i}", f"answer from B: e{i}") for i in range(4)])
    out = tmp_path / "eval.jsonl"
    res = run_cli(
        "collect", "-a", "agent_b", "-i", str(inp), "-o", str(out), "--concurrency", "2", "--resume",
        "--temperature", "0.5", "--head-server", nemo_gym_stack.head_url, "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert out.is_file() and Path(f"{out}.rollflow/report.json").is_file()
    rows = read_jsonl(out)
    assert [stub_of(r) for r in rows] == ["B"] * 4
    assert {r["responses_create_params"]["temperature"] for r in rows} == {0.5}


def test_a_failed_rollout_lands_in_nemo_gyms_sidecar(run_cli, nemo_gym_stack: Stack, tmp_path: Path) -> None:
    rows = [row(f"{FAIL_MARKER} now", "x"), row("fine", "answer from A: fine")]
    inp = write(tmp_path / "in.jsonl", rows)
    out = tmp_path / "f.jsonl"
    res = run_cli(
        "collect", "+agent_name=agent_a", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
        "+route_failures_to_sidecar=true", *head_args(nemo_gym_stack), "--no-progress",
        env={"NEMO_GYM_MAX_ROLLOUT_ATTEMPTS": "1"},
    )  # fmt: skip
    assert [(r["_ng_task_index"], r["reward"]) for r in read_jsonl(out)] == [(1, 1.0)], res.stderr
    (failure,) = read_jsonl(tmp_path / "f_failures.jsonl")
    env = nemo_gym_stack.environment_server("agent_a")
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_type"] == "ClientResponseError"
    assert failure["_ng_failure_message"] == f"500, message='Internal Server Error', url='{env.url}/run'"
    assert failure["_ng_failure_http_status"] == 500
    assert "stub A refuses" in failure["_ng_failure_response_body"]
    assert (failure["_ng_task_index"], failure["_ng_rollout_index"]) == (0, 0)
    assert failure["_ng_environment_server"] == "agent_a_environment_server"
    assert failure["agent_ref"] == {"name": "agent_a"} and failure["_rf"]["attempts"] == 1
    assert "reward" not in failure and "response" not in failure
    report = json.loads((Path(f"{out}.rollflow") / "report.json").read_text())
    assert report["agents"] == {"agent_a": {"rollouts": 1, "failed": 1, "reward_mean": 1.0}}, report["agents"]


def test_a_bad_prompt_uses_its_own_retries_and_no_more(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    """Each agent has one server: a prompt its model refuses takes that server out of rotation, but the
    other agent's server is no replica to retry on, so each rollout is tried max-retries + 1 times."""
    rows = [row(f"{FAIL_MARKER} a", "x", "agent_a"), row(f"{FAIL_MARKER} b", "x", "agent_b"), *mixed_rows(4)]
    out = tmp_path / "r.jsonl"
    res = run_cli(
        "collect", f"+input_jsonl_fpath={write(tmp_path / 'in.jsonl', rows)}", f"+output_jsonl_fpath={out}",
        "+route_failures_to_sidecar=true", "--max-retries", "2", *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert len(read_jsonl(out)) == 4, res.stderr
    failures = read_jsonl(tmp_path / "r_failures.jsonl")
    assert sorted((f["agent_ref"]["name"], f["_rf"]["attempts"]) for f in failures) == [
        ("agent_a", 3),
        ("agent_b", 3),
    ]


def test_rows_routed_by_task_source_and_dotted_keys(run_cli, nemo_gym_stack: Stack, tmp_path: Path) -> None:
    rows = [{**row(f"t{i}", f"answer from B: t{i}"), "task_source": "agent_b"} for i in range(3)]
    out = tmp_path / "ts.jsonl"
    res = run_cli(
        "collect", f"+input_jsonl_fpath={write(tmp_path / 'in.jsonl', rows)}", f"+output_jsonl_fpath={out}",
        *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert {(r["agent_ref"]["name"], stub_of(r), r["reward"]) for r in read_jsonl(out)} == {
        ("agent_b", "B", 1.0)
    }
    # string_match serves both agents: its name alone cannot say which; a dotted agent_map key can
    shared = [{**row("s", "answer from A: s"), "task_source": "string_match"}]
    inp = write(tmp_path / "shared.jsonl", shared)
    res = run_cli(
        "collect", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={tmp_path / 'no.jsonl'}",
        *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "'string_match'" in res.stderr and "+agent_map" in res.stderr, res.stderr
    res = run_cli(
        "collect", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={tmp_path / 'yes.jsonl'}",
        "+agent_map.string_match=agent_a", *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert [stub_of(r) for r in read_jsonl(tmp_path / "yes.jsonl")] == ["A"]


def test_routing_that_would_mislabel_rows_is_refused(run_cli, nemo_gym_stack: Stack, tmp_path: Path) -> None:
    inp = write(tmp_path / "in.jsonl", mixed_rows(4))
    env_a = nemo_gym_stack.environment_server("agent_a").url
    res = run_cli(
        "collect", "--backend-url", env_a, f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={tmp_path / 'one.jsonl'}", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "line 2" in res.stderr and "one agent server URL" in res.stderr, res.stderr
    res = run_cli(
        "collect", "+num_repeats={agent_a: 2}", f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={tmp_path / 'rep.jsonl'}", *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "no entry for its routing keys agent_b" in res.stderr, res.stderr
    assert not (tmp_path / "one.jsonl").exists() and not (tmp_path / "rep.jsonl").exists()


def test_the_head_server_given_as_the_backend_url_and_the_short_flags(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    """The README's form (--backend-url at the head server) and `gym eval run`'s -i/-o alone."""
    inp = write(tmp_path / "in.jsonl", mixed_rows(4))
    res = run_cli(
        "collect", "--backend-url", nemo_gym_stack.head_url, f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={tmp_path / 'h.jsonl'}", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = run_cli(
        "collect", "-i", str(inp), "-o", str(tmp_path / "short.jsonl"),
        "--head-server", nemo_gym_stack.head_url, "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for name in ("h.jsonl", "short.jsonl"):
        assert all(stub_of(r) == r["agent_ref"]["name"][-1].upper() for r in read_jsonl(tmp_path / name))


def test_the_same_invocation_gives_ng_collect_rollouts_rows(
    run_cli, nemo_gym_stack: Stack, ng_bin: Callable[[str], Path], tmp_path: Path
) -> None:
    rows = [row(f"same {i}", f"answer from A: same {i}") for i in range(4)] + [row("other", "nope")]
    words = ["+num_repeats=2", "+num_repeats_add_seed=true", "+responses_create_params.temperature=0.3"]
    (tmp_path / "ng").mkdir()
    done, ng_out = collect(nemo_gym_stack, ng_bin, tmp_path / "ng", rows, *words)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = tmp_path / "rf" / "out.jsonl"
    res = run_cli(
        "collect", "+agent_name=agent_a", f"+input_jsonl_fpath={tmp_path / 'ng' / 'in.jsonl'}",
        f"+output_jsonl_fpath={ours}", *words, *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr

    def by_key(path: Path) -> dict[tuple[int, int], dict[str, Any]]:
        return {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in read_jsonl(path)}

    theirs, mine = by_key(ng_out), by_key(ours)
    assert sorted(theirs) == sorted(mine) and len(mine) == 10
    for key, expected in theirs.items():
        source = rows[key[0]]
        kept = {k for k in source if k not in expected and mine[key][k] == source[k]}
        assert kept <= {"extraction_mode"}, kept
        got = {k: v for k, v in mine[key].items() if k not in OWN_FIELDS | kept}
        assert got == expected, (key, sorted(set(got) ^ set(expected)))


# The stack itself is real: each environment server runs its agent on its own stub, string_match scores,
# and NeMo Gym's own ng_collect_rollouts writes its rollouts, failures sidecar and aggregate metrics.


def test_head_server_maps_each_agent_to_its_environment_server(nemo_gym_stack: Stack) -> None:
    servers = nemo_gym_stack.servers
    assert sorted(nemo_gym_stack.agents) == ["agent_a", "agent_b"]
    for agent in ("agent_a", "agent_b"):
        env = nemo_gym_stack.environment_server(agent)
        assert (env.name, env.kind, env.impl) == (
            f"{agent}_environment_server",
            "environment_servers",
            "legacy_agent",
        )
        model = servers[servers[agent].config["model_server"]["name"]]
        stub_url = nemo_gym_stack.stub_urls[nemo_gym_stack.stub_for(agent)]
        assert model.config["openai_base_url"] == f"{stub_url}/v1"
    assert {s.host for s in servers.values()} == {"127.0.0.1"}
    assert 11000 not in {s.port for s in servers.values()}
    assert nemo_gym_stack.config["head_server"]["host"] == "127.0.0.1"


def test_each_agent_is_answered_by_its_own_stub(nemo_gym_stack: Stack) -> None:
    """The same row to each environment server: A's reply matches the expected answer, B's does not."""
    for agent, reward in (("agent_a", 1.0), ("agent_b", 0.0)):
        stub = nemo_gym_stack.stub_for(agent)
        before = nemo_gym_stack.stub_requests(stub)["count"]
        url = f"{nemo_gym_stack.environment_server(agent).url}/run"
        result = http_json(url, row("what is 2+2", "answer from A: what is 2+2", agent))
        assert reply_text(result) == f"answer from {stub}: what is 2+2", nemo_gym_stack.log_tail()
        assert result["reward"] == reward
        assert result["extracted_answer"] == f"answer from {stub}: what is 2+2"
        seen = nemo_gym_stack.stub_requests(stub)
        assert seen["count"] == before + 1
        assert seen["last"][-1]["path"] == "/v1/responses"
        assert seen["last"][-1]["body"]["model"] == f"stub-{stub.lower()}"


def test_ng_collect_rollouts_writes_rollouts_and_aggregate_metrics(
    nemo_gym_stack: Stack, ng_bin: Callable[[str], Path], tmp_path: Path
) -> None:
    prompts = ["what is 2+2", "name a colour", "say hello", "count to three"]
    rows = [row(p, f"answer from A: {p}") for p in prompts[:3]] + [row(prompts[3], "three")]
    done, out = collect(nemo_gym_stack, ng_bin, tmp_path, rows)
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{nemo_gym_stack.log_tail()}"
    results = sorted(read_jsonl(out), key=lambda r: r["_ng_task_index"])
    assert [r["_ng_task_index"] for r in results] == [0, 1, 2, 3]
    for result, prompt in zip(results, prompts, strict=True):
        assert result["_ng_environment_server"] == "agent_a_environment_server"
        assert result["_ng_result_type"] == "legacy_agent"
        assert result["agent_ref"] == {"name": "agent_a"}
        assert reply_text(result) == f"answer from A: {prompt}"
    assert [r["reward"] for r in results] == [1.0, 1.0, 1.0, 0.0]
    assert (out.parent / "out_failures.jsonl").read_text() == ""
    metrics = json.loads((out.parent / "out_aggregate_metrics.json").read_text())
    assert [m["_ng_environment_server"] for m in metrics] == ["agent_a_environment_server"]
    assert metrics[0]["agent_ref"] == {"name": "agent_a"}
    assert metrics[0]["key_metrics"]["mean/reward"] == 0.75


def test_a_failed_model_call_lands_in_the_failures_sidecar(
    nemo_gym_stack: Stack, ng_bin: Callable[[str], Path], tmp_path: Path
) -> None:
    """The stub answers FAIL_MARKER with HTTP 400 (not retried): a sidecar row; the other row still scores."""
    rows = [row(f"{FAIL_MARKER} now", "x"), row("fine", "answer from A: fine")]
    done, out = collect(nemo_gym_stack, ng_bin, tmp_path, rows, "+route_failures_to_sidecar=true")
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{nemo_gym_stack.log_tail()}"
    assert [(r["_ng_task_index"], r["reward"]) for r in read_jsonl(out)] == [(1, 1.0)]
    (failure,) = read_jsonl(out.parent / "out_failures.jsonl")
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_http_status"] == 500
    assert failure["_ng_task_index"] == 0
    assert failure["_ng_environment_server"] == "agent_a_environment_server"
    assert "stub A refuses" in failure["_ng_failure_response_body"]


def test_collect_with_long_flags_alone_asks_nemo_gyms_head_server(run_cli, tmp_path: Path) -> None:
    """`collect --input x --output y.jsonl` (gym eval run's long flags) went to a responses server at
    127.0.0.1:8000, where a NeMo Gym user's vLLM often listens; it is an agent run through the head server."""
    inp = write(tmp_path / "in.jsonl", [row("q", "a")])
    res = run_cli("collect", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--no-progress")
    assert res.returncode == 2, res.stderr
    assert "head server at http://127.0.0.1:11000" in res.stderr and ":8000" not in res.stderr, res.stderr


def test_short_output_names_the_dataset_file_whatever_its_suffix(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    """`-o out.json` made a folder `out.json/`; NeMo Gym writes that file."""
    inp = write(tmp_path / "in.jsonl", [row(f"j{i}", f"answer from A: j{i}") for i in range(2)])
    out = tmp_path / "out.json"
    res = run_cli(
        "collect", "-a", "agent_a", "-i", str(inp), "-o", str(out),
        "--head-server", nemo_gym_stack.head_url, "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert out.is_file() and [stub_of(r) for r in read_jsonl(out)] == ["A", "A"]


def test_files_of_others_at_the_published_paths_are_never_overwritten(
    run_cli, fast_sim, tmp_path: Path
) -> None:
    """An input at `<stem>_failures.jsonl` (re-collecting failures) was emptied, and NeMo Gym's own output at
    the dataset path was overwritten with no word (resume_from_cache adopts nothing of another tool)."""
    folder = tmp_path / "d"
    folder.mkdir()
    failures = write(folder / "out_failures.jsonl", [row("q", "a")])
    before = failures.read_bytes()
    res = run_cli(
        "collect", "--backend-url", fast_sim.url, f"+input_jsonl_fpath={failures}",
        f"+output_jsonl_fpath={folder / 'out.jsonl'}", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "failures sidecar" in res.stderr, res.stderr
    assert failures.read_bytes() == before
    theirs = folder / "ng.jsonl"
    theirs.write_bytes(b'{"written": "by ng_collect_rollouts"}\n')
    inp = write(tmp_path / "in.jsonl", [row("q", "a")])
    res = run_cli(
        "collect", "--backend-url", fast_sim.url, f"+input_jsonl_fpath={inp}",
        f"+output_jsonl_fpath={theirs}", "+resume_from_cache=true", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "was not written by this output" in res.stderr, res.stderr
    assert theirs.read_bytes() == b'{"written": "by ng_collect_rollouts"}\n'


def test_a_flag_carrying_a_key_is_refused_without_echoing_it(run_cli, tmp_path: Path) -> None:
    """`--model-api-key=sk-...` was echoed in 'Unrecognised argument'; gym eval run's flags that configure
    the servers NeMo Gym would start are refused by name, and no unknown argument's value is shown."""
    inp = write(tmp_path / "in.jsonl", [row("q", "a")])
    base = ["collect", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
    for extra in (
        ["--model-api-key=sk-SECRET-1"],
        ["--model-api-key", "sk-SECRET-1"],
        ["--api-tokn=sk-SECRET-1"],
    ):
        res = run_cli(*base, *extra)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "SECRET" not in res.stderr and extra[0].partition("=")[0] in res.stderr, res.stderr


def test_a_head_server_naming_a_port_that_is_none_is_one_error(run_cli, tmp_path: Path) -> None:
    """A head-server config whose agent port was not a number ended in pydantic's traceback."""
    import http.server
    import threading

    config = {
        "agent_a": {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": "eighty"}}},
    }
    body = json.dumps(json.dumps(config)).encode()  # the head server answers the YAML text as a JSON string

    class Head(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    head = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Head)
    threading.Thread(target=head.serve_forever, daemon=True).start()
    try:
        inp = write(tmp_path / "in.jsonl", [row("q", "a")])
        res = run_cli(
            "collect", "-a", "agent_a", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"),
            "--head-server", f"http://127.0.0.1:{head.server_address[1]}", "--no-progress",
        )  # fmt: skip
    finally:
        head.shutdown()
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "'agent_a'" in res.stderr and "'eighty'" in res.stderr, res.stderr


def test_per_agent_num_repeats_match_either_side_of_a_re_route_as_nemo_gym_does(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    """`agent_map={agent_a: agent_b} num_repeats={agent_a: 2}` was refused (NeMo Gym matches the row's own
    agent too); `+agent_name=agent_a num_repeats={agent_b: 3}` on rows naming no agent collected 3 each where
    NeMo Gym refuses; the override of agent_refs in the data and a misspelt key went without a warning."""
    inp = write(tmp_path / "in.jsonl", [row(f"m{i}", f"answer from B: m{i}", "agent_a") for i in range(2)])
    out = tmp_path / "mapped.jsonl"
    res = run_cli(
        "collect", "+agent_map={agent_a: agent_b}", "+num_repeats={agent_a: 2, agnet_c: 2}",
        f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}", *head_args(nemo_gym_stack),
        "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    assert len(rows) == 4 and {stub_of(r) for r in rows} == {"B"}
    assert "agent_a -> agent_b" in res.stderr and "agnet_c" in res.stderr, res.stderr
    bare = write(tmp_path / "bare.jsonl", [row("n", "answer from A: n")])
    res = run_cli(
        "collect", "+agent_name=agent_a", "+num_repeats={agent_b: 3}", f"+input_jsonl_fpath={bare}",
        f"+output_jsonl_fpath={tmp_path / 'bare_out.jsonl'}", *head_args(nemo_gym_stack), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 2 and "no entry for its routing keys agent_a" in res.stderr, res.stderr
    assert not (tmp_path / "bare_out.jsonl").exists()


def test_one_agent_server_by_url_still_writes_nemo_gyms_sidecar(
    run_cli, nemo_gym_stack: Stack, tmp_path: Path
) -> None:
    """With --backend-url at an agent server (one server, one agent) no failures sidecar was written, even
    with +route_failures_to_sidecar=true; the aggregate metrics, which need the head server, are said to be
    missing and why."""
    inp = write(
        tmp_path / "in.jsonl",
        [row(f"{FAIL_MARKER} url", "x", "agent_a"), row("ok", "answer from A: ok", "agent_a")],
    )
    out = tmp_path / "u.jsonl"
    res = run_cli(
        "collect", "--backend-url", nemo_gym_stack.environment_server("agent_a").url,
        f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}", "+route_failures_to_sidecar=true",
        "--max-retries", "0", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert len(read_jsonl(out)) == 1
    sidecar = read_jsonl(tmp_path / "u_failures.jsonl")
    assert len(sidecar) == 1 and sidecar[0]["agent_ref"] == {"name": "agent_a"}, sidecar
    assert "aggregate metrics: not written" in res.stderr and "head_server" in res.stderr, res.stderr
