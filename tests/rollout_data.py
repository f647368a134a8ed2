"""Test inputs and the exactly-once check every end-to-end test applies to a dataset."""

from __future__ import annotations

from pathlib import Path

import orjson


def write_rows(path: Path, rows: int, start: int = 0) -> Path:
    with path.open("wb") as fh:
        for i in range(start, start + rows):
            row = {
                "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + {i}?"}]},
                "agent_ref": {"type": "responses_api_agents", "name": "math"},
                "expected_answer": str(2 * i),
            }
            fh.write(orjson.dumps(row) + b"\n")
    return path


def assert_complete(lines: list[bytes], rows: int, repeats: int) -> None:
    """Every (task, rollout) exactly once, in order, each with a numeric reward."""
    keys = []
    for line in lines:
        row = orjson.loads(line)
        keys.append((row["_ng_task_index"], row["_ng_rollout_index"]))
        assert isinstance(row["reward"], int | float) and not isinstance(row["reward"], bool)
        assert "response" in row and "responses_create_params" in row
    assert keys == [(i, r) for i in range(rows) for r in range(repeats)]


def flaky_verifier(failing_digits: str) -> str:
    """A verifier module's source that raises (a `verifier` failure, its reply kept) for every task whose
    expected answer ends in one of `failing_digits`, and scores the rest by their last \\boxed{}."""
    return f'''
def verify(row, text):
    """Raises for answers ending in one of {failing_digits!r}: their checks fail as kind `verifier`."""
    if row["expected_answer"].split(".")[0][-1] in {failing_digits!r}:
        raise ValueError("this check always fails")
    return 1.0 if text.rstrip().endswith("\\\\boxed{{" + row["expected_answer"] + "}}") else 0.0
'''


def write_sum_rows(path: Path, tasks: int) -> Path:
    """Questions the simulator answers (i + (i + 1)); half the expected answers written as 7.0, which only
    math-aware verifiers (math_fast, math) take for 7, so a reverify with one changes rewards."""
    with path.open("wb") as fh:
        for i in range(tasks):
            answer = str(2 * i + 1)
            row = {
                "responses_create_params": {
                    "input": [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
                },
                "expected_answer": answer if i % 2 else f"{answer}.0",
            }
            fh.write(orjson.dumps(row) + b"\n")
    return path
