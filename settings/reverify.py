"""ReverifySpec: what `rollflow reverify` rescores, with which verifier, into where (no secret in it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rollflow.settings.models import KEEP_CHUNKS, EngineSettings, VerifySettings, no_url_credentials

# What a verification failure is: only these rollouts hold a response to score again.
VERIFY_FAILURE_KINDS = ("verifier", "verifier_timeout", "verifier_crash")


class ReverifySpec(EngineSettings):
    """A published output rescored with another verifier; no request goes to any backend.

    runner local scores the chunks in this process; dask and ray send each chunk task to a worker process
    (Dask: --dask-address, a cluster class, or a local cluster; Ray: --ray-address or a local instance),
    which reads the source and commits the chunk itself under the run's lease.
    """

    source: str = Field(
        ...,
        description="A published output folder or a dataset file (rollouts.jsonl): local path or s3://...",
    )
    output: str = Field(..., description="Output directory of the rescored dataset: local path or s3://...")
    verify: VerifySettings = Field(default_factory=VerifySettings)
    failed_only: bool = Field(
        False,
        description="Rescore only the rollouts whose verification failed in the source's failures, and "
        "publish the completed dataset (SOURCE must be an output folder)",
    )
    chunk_size: int = Field(10_000, ge=1, le=10_000_000, description="Rollouts per chunk task (about)")
    parallelism: int = Field(64, ge=1, le=65536, description="Checks in flight at once in this process")
    chunks_in_flight: int = Field(2, ge=1, le=64, description="Chunk tasks running at once")
    chunk_retries: int = Field(3, ge=0, le=100, description="Prefect retries of a whole chunk task")
    format: Literal["jsonl", "parquet"] = Field(
        "jsonl", description="jsonl: OUT/rollouts.jsonl; parquet: sharded Parquet under OUT/data/"
    )
    restart: bool = Field(False, description="Discard a different reverify's committed chunks and start over")
    allow_incomplete: bool = Field(False, description="Publish even if some rollouts failed verification")
    keep_chunks: bool = Field(
        False,
        description=KEEP_CHUNKS,
    )

    @field_validator("source", "output")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return no_url_credentials(value) or value

    def dataset_url(self) -> str:
        return f"{self.output.rstrip('/')}/rollouts.jsonl"

    def data_url(self) -> str:
        """Where --format parquet writes its shards."""
        return f"{self.output.rstrip('/')}/data"
