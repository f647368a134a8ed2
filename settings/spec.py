"""RunSpec: the whole description of a run that may travel as Prefect parameters (it holds no secret).

A served flow takes the spec as sections (backend, collection, ...) rather than one object, because
Prefect merges a run's parameters with the deployment's one top-level key at a time: a run that gives
one field of a section is merged here with the served section, field by field (`RunSpec.merged`).
"""

from __future__ import annotations

import hashlib
import re
import string
from typing import Any, Literal

import orjson
from pydantic import Field, SecretStr, field_validator, model_validator

from rollflow.settings.models import (
    KEEP_CHUNKS,
    MAX_SECONDS,
    BackendParams,
    BackendSettings,
    CollectionSettings,
    EngineSettings,
    RollflowSettings,
    TuningSettings,
    VerifySettings,
    no_url_credentials,
)

# What an output may name, filled once when the run starts (a retry of the flow run fills them alike).
PLACEHOLDERS = ("date", "datetime", "flow_run_name", "flow_run_id", "deployment", "params_hash")


def template_fields(text: str) -> set[str]:
    """The placeholders of an output; a format spec or conversion (`{date:x}`, `{date!r}`) is refused."""
    found = set()
    for _, name, spec, conversion in string.Formatter().parse(text):
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(f"{{{name}}} takes no format or conversion in an output, as in {text!r}")
        found.add(name)
    return found


def fill(text: str, values: dict[str, str]) -> str:
    """The template with each placeholder's value as one path segment: a name such as `..` or `a/b` (a
    deployment's) can neither climb out of the folder the template names nor add folders to it."""
    return text.format_map({k: path_segment(values.get(k, "")) for k in template_fields(text)})


def path_segment(value: str) -> str:
    segment = re.sub(r"[/\\]+", "-", value).strip()
    return "none" if segment.strip(".") == "" else segment


# The spec's sections: models whose fields a run may change one at a time.
SECTIONS = ("backend", "collection", "verify", "tuning")


class RunSpec(EngineSettings):
    """What to collect, from where, into where. Secrets are resolved from the environment at run time."""

    input: str = Field(..., description="Input JSONL of NeMo Gym rows: local path or s3://...")
    output: str = Field(
        ...,
        description="Output directory (ledger, reports): local path or s3://...; may hold {date}, "
        "{datetime}, {flow_run_name}, {flow_run_id}, {deployment} or {params_hash}, filled once when the "
        "run starts",
    )
    dataset: str | None = Field(
        None, description="Where to publish the dataset; default rollouts.jsonl in the output directory"
    )
    format: Literal["jsonl", "parquet"] = Field(
        "jsonl",
        description="jsonl: one rollouts.jsonl (NeMo RL reads it); parquet: Parquet shards in <output>/data/",
    )
    backend: BackendParams = Field(default_factory=BackendParams)
    collection: CollectionSettings = Field(default_factory=CollectionSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)
    tuning: TuningSettings = Field(default_factory=TuningSettings)
    restart: bool = Field(False, description="Discard a different run's committed chunks and start over")
    allow_incomplete: bool = Field(False, description="Publish even if the audit found gaps")
    keep_chunks: bool = Field(
        False,
        description=KEEP_CHUNKS,
    )
    deadline_s: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="Stop cleanly after this many seconds; run again to resume"
    )

    @field_validator("input", "output", "dataset")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        return no_url_credentials(value)

    @field_validator("output", "dataset")
    @classmethod
    def _known_placeholders(cls, value: str | None) -> str | None:
        if value is not None:
            unknown = template_fields(value) - set(PLACEHOLDERS)
            if unknown:
                named = ", ".join("{" + u + "}" for u in sorted(unknown))
                allowed = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                raise ValueError(f"{value!r} names {named}; an output may hold {allowed}")
        return value

    def expanded(self, values: dict[str, str]) -> RunSpec:
        """The spec with its output (and dataset) placeholders filled; {params_hash} from the spec itself."""
        if not template_fields(self.output) and not template_fields(self.dataset or ""):
            return self
        values = {**values, "params_hash": self.params_hash()}
        return self.model_copy(
            update={
                "output": fill(self.output, values),
                "dataset": fill(self.dataset, values) if self.dataset else None,
            }
        )

    def params_hash(self) -> str:
        """12 hex of what the run collects: the input and the fields that change a rollout (as its run
        identity has them), never parallelism, timeouts, retries, the deadline or where it writes."""
        col = self.collection
        collects = {
            "input": self.input,
            "format": self.format,
            "backend": self.backend.model_dump(mode="json", include={"kind", "model"}),
            "collection": col.model_dump(
                mode="json",
                include={"overrides", "agent_name", "agent_map", "repeat_seed", "limit", "skip_bad_rows"}
                | {"seed", "num_repeats"},
            ),
            "verifier": self.verify.verifier,
        }
        return hashlib.sha256(orjson.dumps(collects, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]

    @model_validator(mode="after")
    def _runner_supports_parallelism(self) -> RunSpec:
        if self.runner != "local" and self.collection.parallelism == "adaptive":
            raise ValueError(
                f"--parallelism adaptive is not supported with --runner {self.runner}: the adaptive "
                "controller steers one process's limit, and the workers share a tuned one. Use "
                f"--parallelism auto (tuned once, then shared by the workers) or a number with --runner "
                f"{self.runner}, or --runner local with adaptive"
            )
        several = isinstance(self.collectors, int) and self.collectors > 1
        if self.runner == "local" and several and self.collection.parallelism == "adaptive":
            raise ValueError(
                f"--parallelism adaptive is not supported with --collectors {self.collectors}: the adaptive "
                "controller steers one process's limit. Use --parallelism auto (tuned once, then shared by "
                "the collector processes) or a number, or --collectors 1 with adaptive"
            )
        if self.dask_address and self.dask_cluster_class:
            raise ValueError(
                "--dask-address and --dask-cluster-class exclude each other: attach to a running "
                "scheduler, or let the cluster class start one"
            )
        return self

    @staticmethod
    def fields_from(settings: RollflowSettings) -> dict[str, Any]:
        """The spec's fields from env/.env settings as plain dicts (no secrets), to edit, then validate."""
        pipeline = settings.pipeline
        return {
            "input": pipeline.input,
            "output": pipeline.output,
            "backend": settings.backend.params().model_dump(),
            "collection": settings.collection.model_dump(),
            "verify": settings.verify.model_dump(),
            "tuning": settings.tuning.model_dump(),
            "restart": pipeline.restart,
            "allow_incomplete": pipeline.allow_incomplete,
            "keep_chunks": pipeline.keep_chunks,
            "deadline_s": pipeline.deadline_s,
            **pipeline.model_dump(include=set(EngineSettings.model_fields)),
        }

    @classmethod
    def from_settings(cls, settings: RollflowSettings, **changes: object) -> RunSpec:
        """A spec from env/.env settings; `changes` (e.g. CLI flags) win."""
        return cls.model_validate({**cls.fields_from(settings), **changes})

    def parameters(self) -> dict[str, Any]:
        """The flow's parameters (JSON values): top-level fields, and every section whole."""
        data = self.model_dump(mode="json")
        engine = {key: data.pop(key) for key in EngineSettings.model_fields}
        return {**data, "engine": engine}

    @classmethod
    def merged(cls, served: dict[str, Any], changes: dict[str, Any]) -> RunSpec:
        """`served` (fields_from's shape) with `changes` on top: a top-level value replaces the served
        one; a section's fields ({"collection": {"limit": 4}}) replace only those fields of it."""
        fields = {key: dict(value) if key in SECTIONS else value for key, value in served.items()}
        for key, value in changes.items():
            if key == "engine":
                fields.update(value)
            elif key in SECTIONS:
                fields[key] = {**fields[key], **value}
            else:
                fields[key] = value
        return cls.model_validate(fields)

    def differences(self, other: RunSpec) -> list[str]:
        """`section.field a -> b` for each field where `other` differs from this spec."""
        mine, theirs = self.parameters(), other.parameters()
        found: list[str] = []
        for key, a in mine.items():
            b = theirs[key]
            if key in (*SECTIONS, "engine"):
                found += [f"{key}.{k} {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]
            elif a != b:
                found.append(f"{key} {a!r} -> {b!r}")
        return found

    def backend_settings(self, api_key: SecretStr | None) -> BackendSettings:
        return BackendSettings(**self.backend.model_dump(), api_key=api_key)

    def dataset_url(self) -> str:
        return self.dataset or f"{self.output.rstrip('/')}/rollouts.jsonl"

    def published_url(self) -> str:
        """Where the dataset is published: the JSONL file, or the folder of Parquet shards."""
        return f"{self.output.rstrip('/')}/data" if self.format == "parquet" else self.dataset_url()
