"""Writes docs/nemo-gym.md: switching from NeMo Gym, with the compatibility table generated from the CLI's
own table of NeMo Gym keys (`python docs/gen_nemo_gym.py`; `--check` fails when the page is stale)."""

from __future__ import annotations

import sys
from pathlib import Path

PAGE = Path(__file__).with_name("nemo-gym.md")
INTRO = """# Switching from NeMo Gym

`rollflow collect` takes `ng_collect_rollouts`' own words. With NeMo Gym's servers running (`ng_run` or
`gym env start`), change only the command name:

```bash
rollflow collect +agent_name=math_simple_agent +input_jsonl_fpath=data/train.jsonl \\
  +output_jsonl_fpath=results/rollouts.jsonl +num_samples_in_parallel=64 +num_repeats=4
```

- **Always agents.** `rollflow collect` is an agent run whichever of NeMo Gym's forms is used (`+key=value`,
  `-i/-o`, `--input/--output`): its rows never go to a model server directly.
- **The head server.** With no `--backend-url`, rollflow asks NeMo Gym's head server
  (`GET /global_config_dict_yaml`, at 127.0.0.1:11000 unless `+head_server.host/port` or `--head-server`
  say otherwise) where each agent runs, and posts each row to `/run` of the environment server that fronts
  its agent, as NeMo Gym does. A head server that does not answer is one error naming its address.
- **Each row to its own agent.** A row goes to the agent its `agent_ref.name` names, after `agent_map`
  and `+agent_name` (which overrides every row's agent, as in NeMo Gym). Each agent's server is its own
  endpoint: a row is never answered by another agent's server. A row whose agent no server answers for
  is refused before any request, with its file and line and the known agents.
- **The same files.** The dataset at `+output_jsonl_fpath` (or `-o x.jsonl`), its failures sidecar
  `<stem>_failures.jsonl` in NeMo Gym's row format, and `<stem>_aggregate_metrics.json` from each
  environment server's `/aggregate_metrics`, written when the dataset is published. Rows carry
  `_ng_task_index`, `_ng_rollout_index`, `agent_ref`, `_ng_environment_server` and `_ng_result_type`.
  Beside the dataset rollflow adds its card (`<stem>.README.md`) and per-task rewards
  (`<stem>.tasks.jsonl`); its ledger and report sit in `<file>.rollflow/`. With one agent server given by
  `--backend-url` the sidecar is written too; the aggregate metrics need the resources servers that only
  the head server names, and the run says so. The report, the card and the summary give each agent's
  rollouts, failed rollouts and reward mean.
- **One server, one agent.** `--backend-url URL` sends every row to that one server: rows naming
  several agents are refused there (line and agents named), so that no row is answered by another
  agent's server. A `--backend-url` at the head server itself is taken as the head server.
- **Where rollflow differs on purpose:** a run always resumes exactly once from what it committed
  (`resume_from_cache` is how it always works); a failed request is retried with backoff (its own
  agent's servers only) before it goes to the sidecar; a changed configuration is refused instead of
  mixed into one dataset; without `+route_failures_to_sidecar=true` a dataset with failed rollouts is
  not published (with it, what succeeded is, as in NeMo Gym). Rows keep every field of the input row
  (NeMo Gym keeps only what the agent echoes) and rollflow's `_rf` (attempts; the seed with `--seed`).
  Each input line is its own task: NeMo Gym gives identical lines one task index, rollflow one each
  (deduplicate the input, or use `num_repeats`), and an `_ng_task_index` already in an input row is
  replaced by the line's own (split an input across machines with the Dask or Ray runners, which keep one
  numbering, rather than by hand). A file rollflow did not write is never replaced: NeMo Gym's own output
  at the dataset path, or an input at the sidecar's path, is refused before any request, not resumed.
  `+num_repeats` per agent matches keys as NeMo Gym does (the agent a row goes to, else its own
  `agent_ref` or `task_source`, else `_default`), but a run collects one count per row: a mix of counts is
  refused (collect each agent as its own run).
- **Seeds.** `+num_repeats_add_seed=true` sends each rollout's index as `seed` in
  `metadata.extra_body`, as NeMo Gym does; `--seed N` sends a stable hash of (N, task, rollout) there.

## Compatibility table

Every key of NeMo Gym 0.7.0's rollout-collection config and every `gym eval run` flag, and what rollflow
does with it. Nested (`+responses_create_params.reasoning.effort=low`) and `++key=value` overrides and
`{...}` / `[...]` values are read as Hydra reads them.

| NeMo Gym | rollflow |
|---|---|
"""


def render() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
    from rollflow.flows.cli.nemo_gym import compatibility_rows

    rows = "".join(f"| `{key}` | {what} |\n" for key, what in compatibility_rows())
    return INTRO + rows


def main() -> int:
    args = sys.argv[1:]
    if args not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    text = render()
    if args == ["--check"]:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run `python docs/gen_nemo_gym.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
