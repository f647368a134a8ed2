"""RunSpec: the whole description of a run that may travel as a Prefect parameter (it holds no secret)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from rollflow.settings.models import (
    MAX_SECONDS,
    BackendParams,
    BackendSettings,
    CollectionSettings,
    RollflowSettings,
    Settings,
    TuningSettings,
    VerifySettings,
)


class RunSpec(Settings):
    """What to collect, from where, into where. Secrets are resolved from the environment at run time."""

    input: str = Field(..., description="Input JSONL of NeMo Gym rows: local path or s3://...")
    output: str = Field(..., description="Output directory (ledger, reports): local path or s3://...")
    dataset: str | None = Field(
        None, description="Where to publish the dataset; default rollouts.jsonl in the output directory"
    )
    backend: BackendParams = Field(default_factory=BackendParams)
    collection: CollectionSettings = Field(default_factory=CollectionSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)
    tuning: TuningSettings = Field(default_factory=TuningSettings)
    restart: bool = Field(False, description="Discard a different run's committed chunks and start over")
    allow_incomplete: bool = Field(False, description="Publish even if the audit found gaps")
    deadline_s: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="Stop cleanly after this many seconds; run again to resume"
    )
    runner: Literal["local", "dask", "ray"] = Field(
        "local", description="Where chunks run: this process, or a Dask or Ray cluster's workers"
    )
    dask_address: str | None = Field(None, description="Existing Dask scheduler; default a local cluster")
    dask_workers: int = Field(2, ge=1, le=1024, description="Worker processes of a local Dask cluster")
    dask_cluster_class: str | None = Field(
        None, description="A Dask cluster class that starts its own workers (dask_jobqueue.SLURMCluster)"
    )
    dask_cluster_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="JSON keyword arguments of --dask-cluster-class"
    )
    dask_adapt_min: int | None = Field(None, ge=0, le=100_000, description="Fewest workers adapt keeps")
    dask_adapt_max: int | None = Field(None, ge=1, le=100_000, description="Most workers adapt starts")
    ray_address: str | None = Field(
        None, description="An existing Ray cluster (ray://head:10001 or auto); default a local instance"
    )

    @model_validator(mode="after")
    def _runner_supports_parallelism(self) -> RunSpec:
        if self.runner != "local" and self.collection.parallelism == "adaptive":
            raise ValueError(
                f"--parallelism adaptive is not supported with --runner {self.runner}: the adaptive "
                "controller steers one process's limit, and the workers share a tuned one. Use "
                f"--parallelism auto (tuned once, then shared by the workers) or a number with --runner "
                f"{self.runner}, or --runner local with adaptive"
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
            "deadline_s": pipeline.deadline_s,
            "runner": pipeline.runner,
            "dask_address": pipeline.dask_address,
            "dask_workers": pipeline.dask_workers,
            "dask_cluster_class": pipeline.dask_cluster_class,
            "dask_cluster_kwargs": pipeline.dask_cluster_kwargs,
            "dask_adapt_min": pipeline.dask_adapt_min,
            "dask_adapt_max": pipeline.dask_adapt_max,
            "ray_address": pipeline.ray_address,
        }

    @classmethod
    def from_settings(cls, settings: RollflowSettings, **changes: object) -> RunSpec:
        """A spec from env/.env settings; `changes` (e.g. CLI flags) win."""
        return cls.model_validate({**cls.fields_from(settings), **changes})

    def backend_settings(self, api_key: SecretStr | None) -> BackendSettings:
        return BackendSettings(**self.backend.model_dump(), api_key=api_key)

    def dataset_url(self) -> str:
        return self.dataset or f"{self.output.rstrip('/')}/rollouts.jsonl"
