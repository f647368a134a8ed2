"""rollflow configuration: pydantic-settings models, read from ROLLFLOW_* env vars, .env and CLI flags."""

from rollflow.settings.models import (
    BackendKind,
    BackendParams,
    BackendSettings,
    CollectionSettings,
    PipelineSettings,
    RollflowSettings,
    StorageSettings,
    TuningSettings,
    VerifySettings,
)

__all__ = [
    "BackendKind",
    "BackendParams",
    "BackendSettings",
    "CollectionSettings",
    "PipelineSettings",
    "RollflowSettings",
    "RunSpec",
    "StorageSettings",
    "TuningSettings",
    "VerifySettings",
]
from rollflow.settings.spec import RunSpec
