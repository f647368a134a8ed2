"""CLI flags derived from the settings models: one table says which field a flag sets; its help, type,
choices and default come from the field itself, so a flag can never drift from its setting."""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rollflow.flows.cli.values import chunk_size_value, collectors_value, json_object, parallelism_value
from rollflow.settings import (
    BackendParams,
    CollectionSettings,
    RunSpec,
    TuningSettings,
    VerifySettings,
)
from rollflow.settings.reverify import ReverifySpec

GROUPS: dict[str, type[BaseModel]] = {
    "": RunSpec,
    "backend": BackendParams,
    "collection": CollectionSettings,
    "verify": VerifySettings,
    "tuning": TuningSettings,
    "reverify": ReverifySpec,
}

Table = dict[str, tuple[tuple[str, str, str], ...]]

# A command's own defaults, where they differ from the setting's: `run` tunes its parallelism, `collect`
# (ng_collect_rollouts' command) sends rows to agents. Fields no env var or .env set take them, and the
# command's --help states them (one table for both).
COMMAND_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "run": {"collection": {"parallelism": "auto"}},
    "collect": {"backend": {"kind": "agent"}},
}

# section title -> (flag, settings group ("" = RunSpec itself), field)
RUN_FLAGS: Table = {
    "input and output": (
        ("input", "", "input"),
        ("output", "", "output"),
        ("dataset", "", "dataset"),
        ("format", "", "format"),
        ("limit", "collection", "limit"),
        ("num-repeats", "collection", "num_repeats"),
        ("settle-after", "collection", "settle_after"),
        ("until-learnable", "collection", "until_learnable"),
        ("skip-bad-rows", "collection", "skip_bad_rows"),
        ("restart", "", "restart"),
        ("allow-incomplete", "", "allow_incomplete"),
        ("keep-chunks", "", "keep_chunks"),
    ),
    "backend": (
        ("backend-url", "backend", "url"),
        ("head-server", "backend", "head_server"),
        ("backend-kind", "backend", "kind"),
        ("model", "backend", "model"),
        ("timeout-s", "backend", "timeout_s"),
        ("max-retries", "backend", "max_retries"),
        ("agent-name", "collection", "agent_name"),
        ("overrides", "collection", "overrides"),
    ),
    "collection": (
        ("parallelism", "collection", "parallelism"),
        ("chunk-size", "collection", "chunk_size"),
        ("chunks-in-flight", "collection", "chunks_in_flight"),
        ("flush-interval-s", "collection", "flush_interval_s"),
        ("stall-timeout-s", "collection", "stall_timeout_s"),
        ("deadline-s", "", "deadline_s"),
        ("runner", "", "runner"),
        ("collectors", "", "collectors"),
        ("dask-address", "", "dask_address"),
        ("dask-workers", "", "dask_workers"),
        ("dask-cluster-class", "", "dask_cluster_class"),
        ("dask-cluster-kwargs", "", "dask_cluster_kwargs"),
        ("dask-adapt-min", "", "dask_adapt_min"),
        ("dask-adapt-max", "", "dask_adapt_max"),
        ("ray-address", "", "ray_address"),
        ("ray-keep-workers-s", "", "ray_keep_workers_s"),
        ("record-latency", "collection", "record_latency"),
        ("seed", "collection", "seed"),
    ),
    "verify": (
        ("verifier", "verify", "verifier"),
        ("verifier-url", "verify", "url"),
        ("verify-processes", "verify", "processes"),
        ("verify-timeout-s", "verify", "check_timeout_s"),
        ("verify-start-timeout-s", "verify", "start_timeout_s"),
        ("verify-node-processes", "verify", "node_processes"),
        ("correct-threshold", "verify", "correct_threshold"),
    ),
}
TUNING_FLAGS: Table = {
    "diagnosis and tuning": (
        ("diagnose-low", "tuning", "diagnose_low"),
        ("diagnose-high", "tuning", "diagnose_high"),
        ("diagnose-rows", "tuning", "diagnose_rows"),
        ("headroom", "tuning", "headroom"),
        ("target-share", "tuning", "target_share"),
    ),
}

# `rollflow reverify`'s flags: the verifier's settings, and the ReverifySpec's own fields.
REVERIFY_FLAGS: Table = {
    "verify": (
        ("verifier", "verify", "verifier"),
        ("verifier-url", "verify", "url"),
        ("verify-processes", "verify", "processes"),
        ("verify-timeout-s", "verify", "check_timeout_s"),
        ("correct-threshold", "verify", "correct_threshold"),
    ),
    "rescore": (
        ("failed-only", "reverify", "failed_only"),
        ("format", "reverify", "format"),
        ("chunk-size", "reverify", "chunk_size"),
        ("parallelism", "reverify", "parallelism"),
        ("chunks-in-flight", "reverify", "chunks_in_flight"),
        ("runner", "reverify", "runner"),
        ("dask-address", "reverify", "dask_address"),
        ("dask-workers", "reverify", "dask_workers"),
        ("ray-address", "reverify", "ray_address"),
        ("ray-keep-workers-s", "reverify", "ray_keep_workers_s"),
        ("restart", "reverify", "restart"),
        ("allow-incomplete", "reverify", "allow_incomplete"),
        ("keep-chunks", "reverify", "keep_chunks"),
    ),
}


# Fields whose CLI form is not their Python type: JSON text, or a number-or-word.
SPECIAL_TYPES: dict[str, Callable[[str], Any]] = {
    "overrides": str,
    "parallelism": parallelism_value,
    "chunk_size": chunk_size_value,
    "collectors": collectors_value,
    "dask_cluster_kwargs": json_object,
}


def _plain(annotation: Any) -> Any:
    """The annotation without None (Optional) and without Annotated metadata."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _plain(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _plain(args[0]) if len(args) == 1 else annotation
    return annotation


_SETTING = object()  # the field's own default


def shown_default(default: Any) -> str:
    """How --help states a default: ` (default X)`, or nothing for none, an empty value or a switch."""
    if default in (None, {}, "") or isinstance(default, bool):
        return ""
    return f" (default {default.value if isinstance(default, enum.Enum) else default})"


def _argument(field: str, info: FieldInfo, default: Any = _SETTING) -> dict[str, Any]:
    """argparse keywords for one settings field: help from its description, type or choices from its type;
    the default stated is the command's own (`default`) when it has one, else the field's. The argparse
    default stays None: a flag left out sets nothing, so env and .env still apply."""
    if default is _SETTING:
        default = None if info.is_required() else info.get_default(call_default_factory=True)
    text = f"{info.description or ''}{shown_default(default)}".replace("%", "%%")
    kwargs: dict[str, Any] = {"help": text, "default": None}
    kind = _plain(info.annotation)
    if field in SPECIAL_TYPES and kind not in (int, float):  # reverify's chunk_size is a plain int
        kwargs["type"] = SPECIAL_TYPES[field]
    elif kind is bool:
        kwargs["action"] = "store_true"
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["choices"] = [m.value for m in kind]
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = list(typing.get_args(kind))
    elif kind in (int, float):
        kwargs["type"] = kind
    return kwargs


def add_flags(parser: argparse.ArgumentParser, table: Table, command: str | None = None) -> None:
    """The table's flags, in one argument group per section; `command`'s own defaults stated."""
    own = COMMAND_DEFAULTS.get(command or "", {})
    for title, flags in table.items():
        section = parser.add_argument_group(title)
        for flag, group, field in flags:
            default = own.get(group, {}).get(field, _SETTING)
            info = GROUPS[group].model_fields[field]
            section.add_argument(f"--{flag}", **_argument(field, info, default))


def given_flags(args: argparse.Namespace, tables: tuple[Table, ...]) -> dict[str, dict[str, Any]]:
    """{group: {field: value}} for every flag the user gave (flags left out are None and set nothing)."""
    found: dict[str, dict[str, Any]] = {}
    for table in tables:
        for flags in table.values():
            for flag, group, field in flags:
                value = getattr(args, flag.replace("-", "_"), None)
                if value is not None:
                    found.setdefault(group, {})[field] = value
    return found


def flag_label(loc: list[str]) -> str:
    """A settings error's location as the user knows it: its flag (`--ray-address`), else its dotted path."""
    key = tuple(loc) if len(loc) > 1 and loc[0] in GROUPS else ("", *loc)
    flags = {(g, f): n for table in (RUN_FLAGS, TUNING_FLAGS) for rows in table.values() for n, g, f in rows}
    return f"--{flags[key]}" if key in flags else ".".join(loc)


def reverify_label(loc: list[str]) -> str:
    """A reverify settings error's location as its flag, else its dotted path."""
    key = tuple(loc) if len(loc) == 2 and loc[0] == "verify" else ("reverify", *loc)
    flags = {(g, f): n for rows in REVERIFY_FLAGS.values() for n, g, f in rows}
    return f"--{flags[key]}" if key in flags else ".".join(loc)
