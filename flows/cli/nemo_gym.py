"""NeMo Gym's rollout-collection arguments: `ng_collect_rollouts`' Hydra `+key=value` overrides and the
`gym eval run` flags, mapped onto rollflow's fields. Every key of NeMo Gym 0.7.0's collection config is
in KEYS: honoured, accepted because rollflow already behaves so, or refused with the reason.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any

from rollflow.flows.cli.errors import UsageError
from rollflow.flows.cli.hydra_values import HydraValueError, parse

ATTEMPTS_ENV = "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS"


@dataclass(frozen=True)
class Key:
    """One NeMo Gym key: `apply(value, groups)` sets rollflow's fields (None: refused), and why."""

    what: str
    apply: Callable[[Any, dict[str, dict[str, Any]]], None] | None = None


def _set(group: str, field: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[..., None]:
    def apply(value: Any, groups: dict[str, dict[str, Any]]) -> None:
        groups[group][field] = convert(value)

    return apply


def _accept(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    """Accepted as it is: rollflow already behaves so (see the key's text)."""


def _overrides(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    if not isinstance(value, dict):
        raise UsageError(
            f"+responses_create_params must be a mapping, e.g. '{{temperature: 0.7}}', not {value!r}."
        )
    collection = groups["collection"]
    collection["overrides"] = {**collection["overrides"], **value}


def _agent_map(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise UsageError(
            f"+agent_map must map names to agent names, e.g. '{{old_agent: new_agent}}', not {value!r}."
        )
    groups["collection"]["agent_map"] = {str(k): v for k, v in value.items()}


def _num_repeats(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    """An int, or NeMo Gym's per-agent dict when it gives the run one count (rollflow runs one count);
    the scan then checks that each row's agent has an entry (or `_default`), as NeMo Gym does."""
    collection = groups["collection"]
    if not isinstance(value, dict):
        collection["num_repeats"] = value
        return
    agent = collection.get("agent_name")
    counts = {value[agent]} if agent in value else set(value.values())
    if len(counts) != 1:
        raise UsageError(
            f"+num_repeats={value}: rollflow collects one number of rollouts per row in a run, and this "
            "gives several. Collect each agent as its own run (+agent_name=NAME +num_repeats=N, each "
            "with its own +output_jsonl_fpath)."
        )
    collection["num_repeats"] = counts.pop()
    collection["num_repeats_by_agent"] = {str(k): v for k, v in value.items()}  # each row checked by it


def _sidecar(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    if _bool(value, "route_failures_to_sidecar"):
        groups[""]["allow_incomplete"] = True


def _deadline(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    groups[""]["deadline_s"] = value


def _no_aggregation(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    groups["collection"]["aggregate_metrics"] = not _bool(value, "disable_aggregation")


def _routing_mode(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    if value != "agent":
        raise UsageError(
            f"+environment_routing_mode={value}: rollflow routes each row by its agent (mode 'agent'); "
            "legacy and taskset routing are not supported."
        )


def _no_upload(value: Any, groups: dict[str, dict[str, Any]]) -> None:
    if _bool(value, "upload_rollouts"):
        raise UsageError(
            "+upload_rollouts=true: rollflow has no NeMo Gym exporters; it publishes the dataset to the "
            "output you give (a local path or s3://...). Leave the key out or set it to false."
        )


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"+{key} takes true or false, not {value!r}.")
    return value


ALWAYS_RESUMES = "accepted: rollflow always resumes a stopped run from what it committed, exactly once"
KEYS: dict[str, Key] = {
    "input_jsonl_fpath": Key("the input (--input)", _set("", "input")),
    "output_jsonl_fpath": Key(
        "the dataset file (--dataset); rollflow's own files go to <file>.rollflow/", _set("", "dataset")
    ),
    "num_samples_in_parallel": Key("requests in flight (--parallelism)", _set("collection", "parallelism")),
    "limit": Key("the first N rows (--limit)", _set("collection", "limit")),
    "num_repeats": Key(
        "rollouts per row (--num-repeats); a per-agent dict when it gives the run one count", _num_repeats
    ),
    "agent_name": Key(
        "every row goes to this agent, as NeMo Gym routes it (--agent-name)", _set("collection", "agent_name")
    ),
    "agent_map": Key("re-routes rows by agent_ref.name or task_source; '_default' for the rest", _agent_map),
    "num_repeats_add_seed": Key(
        "each rollout's index as its seed in metadata.extra_body", _set("collection", "repeat_seed")
    ),
    "responses_create_params": Key(
        "merged into every row's responses_create_params (--overrides)", _overrides
    ),
    "resume_from_cache": Key(ALWAYS_RESUMES, _accept),
    "route_failures_to_sidecar": Key(
        "true: the dataset is published with the rollouts that succeeded, and each failure is in the "
        "sidecar (--allow-incomplete); false: rollflow's default, a dataset is published only when "
        "complete (failed rollouts are retried first, and the run goes on either way)",
        _sidecar,
    ),
    "require_complete": Key(
        "accepted: rollflow publishes only a complete dataset unless --allow-incomplete", _accept
    ),
    "retain_results_in_memory": Key("accepted: rollflow streams every row and holds none in memory", _accept),
    "max_resident_rollout_tasks": Key(
        "accepted: at most --parallelism rollouts are resident at once", _accept
    ),
    "interleave_repeats": Key("accepted: the dataset is ordered by task and rollout either way", _accept),
    "disable_aggregation": Key("skips <stem>_aggregate_metrics.json", _no_aggregation),
    "disable_health_check": Key(
        "accepted: rollflow runs its own audit, not NeMo Gym's health checks", _accept
    ),
    "dispatch_budget_s": Key(
        "stop cleanly after this many seconds, keeping all committed work (--deadline-s)", _deadline
    ),
    "environment_routing_mode": Key("'agent' only: each row by its agent", _routing_mode),
    "upload_rollouts": Key("false only: rollflow has no NeMo Gym exporters", _no_upload),
    "health_check_workers": Key(
        "refused: rollflow does not run NeMo Gym's health checks; run them on the dataset"
    ),
    "health_check_ignored_checks": Key(
        "refused: rollflow does not run NeMo Gym's health checks; run them on the dataset"
    ),
    "count_failure_classes_as_zero": Key(
        "refused: rollflow never scores a failure as 0; the failures sidecar lists each one"
    ),
    "count_missing_rollouts_as_zero": Key(
        "refused: rollflow never scores a missing rollout as 0; every one has a reason"
    ),
    "rollout_collection_driver": Key(
        "refused: rollflow runs its own collection; a custom driver cannot replace it"
    ),
    "environment_server_name": Key("refused: legacy routing is not supported; rows route by agent"),
    "environment_server_routes": Key("refused: materialized tasksets are not supported; rows route by agent"),
    "fan_out": Key(
        "refused: one row to several agents gives rows different rollout counts; run each agent on its own"
    ),
    "prompt_config": Key("refused: build responses_create_params.input first (ng_materialize_prompts)"),
    "skills": Key("refused: run-level skills are not supported"),
    "drain_margin_s": Key(
        "refused: --deadline-s stops dispatch and keeps finished rollouts; there is no margin"
    ),
    "dispatch_longest_first": Key("refused: rollflow has no record of earlier runtimes to order by"),
    "retry_terminal_timeouts": Key(
        "refused: rollflow retries within the run (--max-retries); nothing is terminal"
    ),
    "retry_invalid_judge_responses": Key("refused: use `rollflow reverify` to rescore a dataset"),
}
HEAD_SERVER_ROWS = (
    ("+head_server.host", "the head server's host (default 127.0.0.1); --head-server URL too"),
    ("+head_server.port", "the head server's port (default 11000)"),
)
# `gym eval run` flags: (flags, Hydra key, argparse keywords)
EVAL_FLAGS: tuple[tuple[tuple[str, ...], str, dict[str, Any]], ...] = (
    (("-a", "--agent"), "agent_name", {"help": "gym eval run: the agent every row goes to"}),
    (("--concurrency",), "num_samples_in_parallel", {"help": "gym eval run: requests in flight"}),
    (
        ("--temperature",),
        "responses_create_params.temperature",
        {"help": "gym eval run: sampling temperature"},
    ),
    (("--top-p",), "responses_create_params.top_p", {"help": "gym eval run: nucleus sampling top-p"}),
    (
        ("--max-output-tokens",),
        "responses_create_params.max_output_tokens",
        {"help": "gym eval run: output tokens"},
    ),
    (
        ("--resume",),
        "resume_from_cache",
        {"action": "store_true", "help": "gym eval run: accepted; runs always resume"},
    ),
    (
        ("--no-serve",),
        "",
        {"action": "store_true", "help": "gym eval run: accepted; rollflow starts no servers"},
    ),
    (
        ("--disable-aggregation",),
        "disable_aggregation",
        {"action": "store_true", "help": "gym eval run: no aggregate metrics"},
    ),
    (
        ("--no-health-check",),
        "disable_health_check",
        {"action": "store_true", "help": "gym eval run: accepted"},
    ),
    (
        ("--interleave-repeats",),
        "interleave_repeats",
        {"action": "store_true", "help": "gym eval run: accepted"},
    ),
)

# gym eval run's flags that configure what NeMo Gym starts: rollflow starts nothing, so each is refused by
# name with the reason (its value, which may be a key, is never echoed).
_STARTS_NOTHING = "rollflow starts no servers; configure the model in the NeMo Gym servers it talks to"
REFUSED_EVAL_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--model-url",), _STARTS_NOTHING),
    (("--model-api-key",), _STARTS_NOTHING),
    (("--split",), "rollflow collects the rows of the input file; give the split's file with -i"),
    (("--prompt-config",), "build responses_create_params.input first (ng_materialize_prompts)"),
    (("--health-check-workers",), "rollflow does not run NeMo Gym's health checks; run them on the dataset"),
)


def _refused_dest(names: tuple[str, ...]) -> str:
    return "ng_refused_" + names[-1].lstrip("-").replace("-", "_")


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "NeMo Gym",
        "ng_collect_rollouts' +key=value arguments (listed at the end) and gym eval run's flags",
    )
    group.add_argument("-i", dest="ng_input", default=None, help="gym eval run: the input")
    group.add_argument("-o", dest="ng_output", default=None, help="gym eval run: the dataset file (x.jsonl)")
    for names, _key, kwargs in EVAL_FLAGS:
        group.add_argument(
            *names, dest=f"ng_{names[-1].lstrip('-').replace('-', '_')}", default=None, **kwargs
        )
    for names, why in REFUSED_EVAL_FLAGS:
        group.add_argument(*names, dest=_refused_dest(names), default=None, help=f"refused: {why}")


def overrides_epilog(width: int | None = None) -> str:
    """`--help`'s list of the `+key=value` arguments, from KEYS, the table the parser reads them by."""
    import shutil
    import textwrap

    width = width or max(60, min(shutil.get_terminal_size().columns - 2, 118))

    def wrap(text: str, **indents: str) -> list[str]:  # a flag (--max-retries) is never split
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **indents)

    taken = [(f"+{key}", entry.what) for key, entry in KEYS.items() if entry.apply is not None]
    taken += list(HEAD_SERVER_ROWS)
    refused = [f"+{key}" for key, entry in KEYS.items() if entry.apply is None]
    name_width = max(len(name) for name, _ in taken) + 2
    lines = wrap(
        "NeMo Gym's +key=value arguments (ng_collect_rollouts' Hydra overrides; ++key=value and key=value "
        "too). Values read as Hydra reads them: numbers, true/false/null, {a: 1, b: x}, [a, b]; a dotted "
        "key sets one field: +responses_create_params.temperature=0.7, +agent_map.old=new.",
    )
    lines.append("")
    for name, what in taken:
        lines += wrap(
            what,
            initial_indent=f"  {name:<{name_width}}",
            subsequent_indent=" " * (name_width + 2),
        )
    lines += ["", *wrap(f"Refused, each with its reason when given: {', '.join(refused)}.")]
    lines += wrap(
        f"{ATTEMPTS_ENV}=N in the environment: each rollout is tried at most N times (--max-retries N-1)."
    )
    return "\n".join(lines)


def hydra_value(text: str) -> Any:
    """A Hydra override's value: numbers, true/false/null, {a: b} and [a, b] as Hydra reads them."""
    try:
        return parse(text)
    except HydraValueError as exc:
        raise UsageError(f"The value {text!r} cannot be read: {exc}. Quote it or fix its braces.") from None


def _unrecognised(token: str) -> str:
    """Names the argument, never its value: a misspelt key flag may carry a secret."""
    name, sep, _ = token.partition("=")
    if token.startswith(("-", "+")):
        shown = f"argument {name!r}" + (" (its value not shown)" if sep else "")
    else:
        shown = "argument: a value that follows no known flag (not shown)"
    return f"Unrecognised {shown}. See `rollflow collect --help`."


def overrides_of(tokens: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The Hydra overrides (`+k=v`, `++k=v`, `k=v`) and gym eval run flags as {dotted key: value}."""
    found: dict[str, Any] = {}
    refused = [
        f"{names[-1]}: {why}"
        for names, why in REFUSED_EVAL_FLAGS
        if getattr(args, _refused_dest(names), None)
    ]
    if refused:
        raise UsageError(
            "Not supported: "
            + "; ".join(refused)
            + (". Leave it out." if len(refused) == 1 else ". Leave them out.")
        )
    for names, key, _ in EVAL_FLAGS:
        value = getattr(args, f"ng_{names[-1].lstrip('-').replace('-', '_')}", None)
        if key and value not in (None, False):
            found[key] = value if value is True else hydra_value(value)
    for token in tokens:
        key, sep, text = token.lstrip("+").partition("=")
        if not sep or not key or (token.startswith("-") and not token.startswith("+")):
            raise UsageError(_unrecognised(token))
        found[key] = hydra_value(text)
    return found


def nested(found: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys nest as Hydra nests them: `+responses_create_params.reasoning.effort=low` is
    {responses_create_params: {reasoning: {effort: low}}}, `+agent_map.a=b` is {agent_map: {a: b}}."""
    out: dict[str, Any] = {}
    for key, value in found.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = {**node[last], **value}
        else:
            node[last] = value
    return out


def apply_nemo_gym(found: dict[str, Any], groups: dict[str, dict[str, Any]]) -> bool:
    """Map NeMo Gym's keys onto `groups`; True when any was given (an agent run). Unknown or refused
    keys are one error naming each, with the reason."""
    config = nested(found)
    problems = []
    for key in config:
        entry = KEYS.get(key)
        if entry is None and key != "head_server":
            close = get_close_matches(key, list(KEYS), n=1)
            hint = f" (did you mean +{close[0]}?)" if close else ""
            problems.append(f"+{key} is not a key of NeMo Gym's rollout collection{hint}")
        elif entry is not None and entry.apply is None:
            problems.append(f"+{key}: {entry.what.removeprefix('refused: ')}")
    if problems:
        raise UsageError(
            "NeMo Gym arguments rollflow cannot honour: " + "; ".join(problems) + ". The keys rollflow "
            "takes: " + ", ".join(f"+{k}" for k, e in KEYS.items() if e.apply is not None) + "."
        )
    if "agent_name" in config:  # num_repeats' per-agent form reads it
        KEYS["agent_name"].apply(config["agent_name"], groups)  # type: ignore[misc]
    for key, value in config.items():
        entry = KEYS.get(key)
        if entry is not None and entry.apply is not None:
            entry.apply(value, groups)
    _head_server(config, groups)
    _attempts(groups)
    return bool(config)


def _head_server(config: dict[str, Any], groups: dict[str, dict[str, Any]]) -> None:
    head = config.get("head_server") or {}
    if not isinstance(head, dict):
        raise UsageError("+head_server takes host and port: +head_server.host=H +head_server.port=P.")
    unknown = set(head) - {"host", "port"}
    if unknown:
        raise UsageError(f"+head_server takes host and port, not {', '.join(sorted(unknown))}.")
    if head:
        host, port = head.get("host", "127.0.0.1"), head.get("port", 11000)
        groups["backend"]["head_server"] = f"http://{host}:{port}"


def _attempts(groups: dict[str, dict[str, Any]]) -> None:
    """NEMO_GYM_MAX_ROLLOUT_ATTEMPTS=N: each rollout is tried N times at most (N-1 retries)."""
    raw = os.environ.get(ATTEMPTS_ENV)
    if raw in (None, ""):
        return
    try:
        attempts = int(raw)
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise UsageError(f"{ATTEMPTS_ENV}={raw!r}: expected a whole number of at least 1.")
    groups["backend"]["max_retries"] = attempts - 1


def compatibility_rows() -> list[tuple[str, str]]:
    """(NeMo Gym key or flag, what rollflow does): the docs' compatibility table, from KEYS itself."""
    rows = [(f"+{key}", entry.what) for key, entry in KEYS.items()] + list(HEAD_SERVER_ROWS)
    rows += [
        ("-i / --input", "the input"),
        (
            "-o / --output FILE",
            "the dataset file whatever its suffix, as NeMo Gym writes it (`-o DIR/` names an output folder); "
            "rollflow's own files go to FILE.rollflow/",
        ),
    ]
    rows += [(" / ".join(names), f"+{key}" if key else "accepted") for names, key, _ in EVAL_FLAGS]
    rows += [(" / ".join(names), f"refused: {why}") for names, why in REFUSED_EVAL_FLAGS]
    rows.append((ATTEMPTS_ENV, "each rollout is tried at most N times (N-1 retries, --max-retries)"))
    return rows
