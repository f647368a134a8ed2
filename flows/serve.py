"""`rollflow serve`: the pipeline, diagnose and tune flows as deployments, with schedules and defaults.

Defaults for the run form come from settings (ROLLFLOW_* / .env); secrets never become parameters: a
served run reads API and S3 keys from the serving process's environment, like any other run.
"""

from __future__ import annotations

from typing import Any

from rollflow.flows.pipeline import rollflow_run
from rollflow.flows.reverify import rollflow_reverify
from rollflow.flows.tuning import rollflow_diagnose, rollflow_tune
from rollflow.settings import RollflowSettings, RunSpec

DEPLOYMENT = "rollflow"


def default_parameters(settings: RollflowSettings) -> dict[str, Any]:
    """The spec's defaults from settings, for the run form and for scheduled runs.

    Without input or output in settings the spec is partial: Prefect accepts a deployment default that
    lacks required fields, and the form then asks for them while showing the other defaults filled in.
    """
    fields = RunSpec.fields_from(settings)
    placeholders = {"input": fields["input"] or "-", "output": fields["output"] or "-"}
    spec = RunSpec.model_validate({**fields, **placeholders}).model_dump(mode="json")
    for key in ("input", "output"):
        if not fields[key]:
            del spec[key]
    return {"spec": spec}


def deployments(name: str, params: dict[str, Any], schedule: dict[str, Any]) -> list[Any]:
    """rollflow-run (with its schedule, if any), rollflow-diagnose, rollflow-tune and rollflow-reverify."""
    tags = ["rollflow"]
    return [
        rollflow_run.to_deployment(
            name=name, parameters=params, tags=tags, description="diagnose, tune, collect, publish",
            **schedule,
        ),
        rollflow_diagnose.to_deployment(name=name, parameters=params, tags=tags),
        rollflow_tune.to_deployment(name=name, parameters=params, tags=tags),
        rollflow_reverify.to_deployment(name=name, tags=tags, description="rescore a published output"),
    ]  # fmt: skip
