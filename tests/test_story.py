"""The run's story counted row by row: finish reasons and truncation, exact token percentiles, parameters
sent, merged over chunks in any order."""

from __future__ import annotations

import pytest

from rollflow.tasks.publish.row_stats import MAX_DISTINCT, OTHER, RowStory, finish_reason

pytestmark = pytest.mark.concurrent


def row(response: dict, **params: object) -> dict:
    return {"responses_create_params": {"input": [], **params}, "response": response}


def test_finish_reasons_and_truncation() -> None:
    assert finish_reason({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}) == (
        "max_output_tokens"
    )
    assert finish_reason({"status": "incomplete", "incomplete_details": {"reason": "content_filter"}}) == (
        "content_filter"
    )
    assert finish_reason({"finish_reason": "length", "output": []}) == "length"
    refusal = {"output": [{"type": "message", "content": [{"type": "refusal", "refusal": "no"}]}]}
    assert finish_reason(refusal) == "refusal"
    assert finish_reason({"status": "completed", "output": []}) == "stop"
    story = RowStory()
    for response in (
        {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}},
        {"finish_reason": "length"},
        {"finish_reason": "stop"},
        {"status": "incomplete", "incomplete_details": {"reason": "content_filter"}},
    ):
        story.add(row(response))
    d = story.as_dict()
    assert d["truncated"] == 2 and d["truncation_rate"] == 0.5
    assert d["finish_reasons"] == {"max_output_tokens": 1, "length": 1, "stop": 1, "content_filter": 1}


def test_tokens_are_exact_and_chunks_merge_in_any_order() -> None:
    outs = [5, 1, 9, 9, 3, 7, 2, 8, 6, 4] * 3
    parts = [RowStory(), RowStory(), RowStory()]
    for i, n in enumerate(outs):
        usage = (
            {"input_tokens": 10, "output_tokens": n}
            if i % 2
            else {"prompt_tokens": 10, "completion_tokens": n}
        )
        parts[i % 3].add(row({"usage": usage, "model": "m"}, temperature=0.5 if i < 25 else 1.0))
    merged = RowStory.from_state(parts[2].state())
    merged.merge(parts[0])
    merged.merge(RowStory.from_state(parts[1].state()))
    t = merged.as_dict()["tokens_out"]
    ordered = sorted(outs)
    assert t["total"] == sum(outs) and t["max"] == 9 and t["rollouts"] == 30
    assert t["p50"] == ordered[14] and t["p95"] == ordered[28]  # nearest rank: 15th and 29th of 30
    d = merged.as_dict()
    assert d["tokens_in"]["mean"] == 10 and d["models"] == {"m": 30}
    assert d["sampling_params"] == {"temperature": {"0.5": 25, "1.0": 5}}


def test_a_parameter_keeps_at_most_max_distinct_values() -> None:
    story = RowStory()
    for i in range(MAX_DISTINCT + 5):
        story.add(row({}, seed=i))
    seeds = story.as_dict()["sampling_params"]["seed"]
    assert len(seeds) == MAX_DISTINCT + 1 and seeds[OTHER] == 5
