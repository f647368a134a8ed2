"""The card beside a published dataset (README.md in the output's own folder, else `<stem>.README.md`): a
Hugging Face dataset card (YAML front matter: configs, features, size category; then the run's story in
prose and tables), built from report.json alone. The front matter is written as huggingface_hub's
`DatasetCard` writes it (its fields first, then the rest, dumped by `yaml.dump`), so the Hub reads it as
it reads the cards it writes, without importing huggingface_hub (0.3 s) on every run (tests hold the two
equal)."""

from __future__ import annotations

import posixpath
from typing import Any

import orjson
import yaml

from rollflow.tasks.collect.paths import card_url
from rollflow.tasks.collect.percentiles import shown
from rollflow.tasks.publish.concat import split_url
from rollflow.tasks.publish.endpoints import agents_markdown
from rollflow.tasks.publish.rewards import pass_at_k_tasks
from rollflow.tasks.storage import owned
from rollflow.tasks.storage.store import Store

SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
         (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"))  # fmt: skip
_DTYPES = {"string": "string", "int64": "int64", "double": "float64", "bool": "bool"}


def size_category(rows: int) -> str:
    """The Hub's size_categories bucket for a dataset of `rows` rows (what its search filters on)."""
    return next((name for limit, name in SIZES if rows < limit), "n>1T")


def _facts(report: dict[str, Any]) -> dict[str, Any]:
    """The card's figures from either report: a collection's (`story`) or a reverify's."""
    if report.get("kind") == "reverify":
        source = report["source"]
        return {
            "what": "Rollouts rescored by `rollflow reverify`",
            "rows": report["rows_written"],
            "rewards": report["after"],
            "previous": report["before"],
            "failed": report["failed"],
            "missing": report.get("missing"),
            "failures_by_kind": report["failures_by_kind"],
            "scored_by": report["verifier"],
            "origin": {
                "input": source["url"],
                "input_sha256": source["sha256"],
                "input_rows": source["rows"],
                "rollflow_version": report.get("rollflow_version"),
            },
            "returned": report.get("returned"),
            "sent": None,
            "settling": report.get("settling"),
        }
    story = report.get("story") or {}
    return {
        "what": "Rollouts collected by rollflow",
        "rows": report["rows_written"],
        "rewards": report.get("rewards"),
        "previous": None,
        "failed": report["failed"],
        "missing": report.get("missing"),
        "failures_by_kind": (story.get("returned") or {}).get("failures_by_kind", {}),
        "scored_by": story.get("scored_by"),
        "origin": story.get("origin") or {"input": report["input"]},
        "returned": story.get("returned"),
        "sent": story.get("sent"),
        "settling": report.get("settling"),
        "until_learnable": report.get("until_learnable"),
    }


def _figures(facts: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, in the front matter too (under `rollflow`), each equal to report.json's."""
    rewards, returned = facts["rewards"] or {}, facts["returned"] or {}
    return {
        "rollouts": facts["rows"],
        "tasks": rewards.get("tasks"),
        "reward_mean": rewards.get("mean"),
        "reward_std": rewards.get("std"),
        "pass_at_k": rewards.get("pass_at_k"),
        "failed": facts["failed"],
        **({"missing": facts["missing"]} if facts.get("missing") else {}),
        "truncation_rate": returned.get("truncation_rate"),
        "tokens_out_mean": (returned.get("tokens_out") or {}).get("mean"),
        "tokens_in_mean": (returned.get("tokens_in") or {}).get("mean"),
    }


def card_data(
    report: dict[str, Any], data_files: str, features: list[dict[str, str]] | None
) -> dict[str, Any]:
    """The front matter in the Hub's DatasetCardData order: its own fields set (license only once a run
    records one), then the rest as extra keys."""
    facts = _facts(report)
    info: dict[str, Any] = {"splits": [{"name": "train", "num_examples": facts["rows"]}]}
    if features:
        info = {"features": features, **info}
    meta = {
        "license": report.get("license"),
        "size_categories": [size_category(facts["rows"])],
        "task_categories": ["text-generation"],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": data_files}]}],
        "dataset_info": info,
        "tags": ["rollflow", "rollouts", "reinforcement-learning"],
        "rollflow": _figures(facts),
    }
    # as JSON first: yaml.dump would tag a tuple or an enum as a Python object
    return orjson.loads(orjson.dumps({key: value for key, value in meta.items() if value is not None}))


def _num(value: Any, fmt: str = ",.4g") -> str:
    """A count as an exact integer with separators (10,003, never 1e+04); other numbers to 4 figures."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:,.1f}"
    return format(value, fmt)


def _story(facts: dict[str, Any]) -> list[str]:
    """The card's opening paragraph: where the rows came from, what answered and what scored them."""
    origin, scored, sent = facts["origin"], facts["scored_by"], facts["sent"]
    lines = [f"{facts['what']} from `{origin.get('input')}`"]
    if origin.get("input_sha256"):
        lines[0] += f" (sha256 `{origin['input_sha256']}`, {origin.get('input_rows', 0):,} rows)"
    if origin.get("rollflow_version"):
        lines[0] += f" with rollflow {origin['rollflow_version']}"
    lines[0] += "."
    if sent:
        models = ", ".join(f"`{m}`" for m in sent.get("models_answered") or {}) or f"`{sent.get('model')}`"
        lines.append(
            f"Backend `{sent['backend_kind']}` at {', '.join(f'`{u}`' for u in sent['endpoints'])}, models "
            f"{models}; {sent['num_repeats']} rollouts per prompt; seed "
            f"{shown(sent['seed'], missing='not set')}; overrides "
            f"`{orjson.dumps(sent['overrides']).decode()}`."
        )
    if scored:
        lib = f" ({scored['library']} {scored['library_version']})" if scored.get("library") else ""
        lines.append(
            f"Rewards by the `{scored['name']}` verifier{lib}; a rollout is correct at reward >= "
            f"{scored['correct_threshold']:g}."
        )
    else:
        lines.append("Rewards as the agent server returned them.")
    out = [" ".join(lines)]
    settling = facts.get("settling")
    if settling:
        out += [
            "",
            f"**Settling (--settle-after {settling['settle_after']})**: {settling['rule']}. "
            f"{settling['settled_tasks']:,} tasks were settled, and their "
            f"{settling['rollouts_not_requested']:,} later rollouts never requested; the tasks file marks "
            "each with `settled_after`. Statistics are over the rollouts that exist; a settled task counts "
            "at its one outcome in pass@k.",
        ]
        if settling.get("settled_split"):
            out[-1] += (
                f" {settling['settled_split']:,} settled tasks have split rewards under this verifier: they "
                "count as mixed and are left out of pass@k."
            )
    if facts.get("until_learnable"):
        out += ["", f"**Until learnable**: {facts['until_learnable']['reason']}."]
    return out


def _tables(facts: dict[str, Any]) -> list[str]:
    """The Figures table and its companions: tokens, finish reasons, failures, sampling parameters."""
    fig = _figures(facts)
    rewards = facts["rewards"] or {}
    out = ["## Figures", "", "| figure | value |", "|---|---:|"]
    for key, value in fig.items():
        if key == "pass_at_k" and value:
            out += [f"| pass@{k} | {v:.4f} |" for k, v in value.items()]
            out.append(f"| pass@k over | {pass_at_k_tasks(rewards)} |")
        elif key == "pass_at_k":  # no task scored (every rollout failed): no figure
            out.append("| pass at k | - |")
        else:
            out.append(f"| {key.replace('_', ' ')} | {_num(value)} |")
    rewards = facts["rewards"] or {}
    for key in ("all_correct", "none_correct", "mixed"):
        if rewards.get(key):
            out.append(f"| tasks {key.replace('_', ' ')} | {rewards[key]['tasks']:,} |")
    if facts["previous"]:
        out.append(f"| previous reward mean | {_num(facts['previous'].get('mean'))} |")
    returned = facts["returned"] or {}
    for side in ("tokens_in", "tokens_out"):
        t = returned.get(side)
        if t and t["rollouts"]:
            out += [
                "",
                f"**{side.replace('_', ' ')} per rollout**: mean {_num(t['mean'])}, p50 {t['p50']}, p95 "
                f"{t['p95']}, max {t['max']}, total {t['total']:,} ({t['rollouts']:,} rollouts with usage)",
            ]
    if returned.get("finish_reasons"):
        out += ["", "| finish reason | rollouts |", "|---|---:|"]
        out += [f"| {k} | {n:,} |" for k, n in returned["finish_reasons"].items()]
    if facts["failures_by_kind"]:
        out += ["", "| failure kind | rollouts |", "|---|---:|"]
        out += [f"| {k} | {n:,} |" for k, n in facts["failures_by_kind"].items()]
    sent = facts["sent"] or {}
    if sent.get("sampling_params"):
        out += ["", "## Sampling parameters sent", "", "| parameter | value | rollouts |", "|---|---|---:|"]
        for key, values in sent["sampling_params"].items():
            out += [f"| {key} | `{v}` | {n:,} |" for v, n in values.items()]
    return out


def _body(report: dict[str, Any], data_files: str) -> list[str]:
    """The card's Markdown below the front matter: the story, the figures, how to load it, the spec."""
    facts = _facts(report)
    body = [
        "# rollflow dataset",
        "",
        *_story(facts),
        "",
        *_tables(facts),
        *(["", agents_markdown(report["agents"])] if report.get("agents") else []),
        "",
        "## Loading",
        "",
        f'`datasets.load_dataset("{"parquet" if data_files.endswith(".parquet") else "json"}", '
        f'data_files="{data_files}")`. One row per rollout: the input row, `response`, `reward`, '
        "`_ng_task_index`, `_ng_rollout_index` and rollflow's own fields under `_rf`.",
    ]
    if data_files.endswith(".parquet"):
        body.append(
            "In Parquet, columns whose shape varies (`response`, `responses_create_params`, `_rf`, ...) hold "
            "JSON text, listed in the schema metadata `rollflow.json_columns`: read them with `json.loads`."
        )
    origin = facts["origin"]
    if origin.get("spec"):
        spec = orjson.dumps(origin["spec"], option=orjson.OPT_INDENT_2).decode()
        body += ["", "## The run's settings (secrets removed)", "", "```json", spec, "```"]
    return body


def render_card(report: dict[str, Any], data_files: str, features: list[dict[str, str]] | None = None) -> str:
    """README.md's text: the front matter dumped as the Hub's `CardData.to_yaml` dumps it, then the body."""
    meta = yaml.dump(card_data(report, data_files, features), allow_unicode=True, sort_keys=False).strip()
    return f"---\n{meta}\n---\n\n" + "\n".join(_body(report, data_files)) + "\n"


def parquet_features(store: Store, shard: str) -> list[dict[str, str]]:
    """The card's `features`, from one shard's schema (every shard has the same)."""
    import pyarrow.parquet as pq

    with store.open_read(shard) as fh:
        schema = pq.read_schema(fh)
    return [{"name": f.name, "dtype": _DTYPES.get(str(f.type), str(f.type))} for f in schema]


def write_card(dataset_url: str, options: dict[str, Any], report: dict[str, Any], output: Store) -> str:
    """The card in the dataset's folder (for Parquet, the folder above data/); returns its URL.

    The card is recorded in the output before it is written, so a --restart removes it and nothing else."""
    parent, name = split_url(dataset_url)
    card = card_url(dataset_url, output.root_url)
    owned.add(output, owned.CARDS, [card], options)
    store = Store(parent, options)
    features = None
    if report.get("format") == "parquet":
        shards = sorted(n for n in store.list(name) if n.endswith(".parquet"))
        features = parquet_features(store, f"{name}/{shards[0]}") if shards else None
        data_files = f"{name}/*.parquet"
    else:
        data_files = name
    card_name = posixpath.basename(card)
    store.write_bytes(card_name, render_card(report, data_files, features).encode())
    return posixpath.join(store.root_url, card_name)
