"""`rollflow serve`: the pipeline, diagnose and tune flows as deployments, with schedules and defaults.

Defaults for the run form come from settings (ROLLFLOW_* / .env); secrets never become parameters: a
served run reads API and S3 keys from the serving process's environment, like any other run.
"""

from __future__ import annotations

from typing import Any

from prefect.utilities.callables import ParameterSchema

from rollflow.flows.pipeline import rollflow_run
from rollflow.flows.reverify import rollflow_reverify
from rollflow.flows.tuning import rollflow_diagnose, rollflow_tune
from rollflow.settings import RollflowSettings, RunSpec

DEPLOYMENT = "rollflow"


# Fields the run fills itself (each agent's server, read from the head server): not the user's to set, so
# not on the UI's form, and refused in a run's parameters (their model takes no other field).
INTERNAL_FIELDS = {"BackendParams": ("agents", "sources")}


def default_parameters(settings: RollflowSettings) -> dict[str, Any]:
    """rollflow-run's parameters as served: the spec's sections whole, from settings (no secrets).

    They fill the run form, and a scheduled run runs with them. A run started with some of them changed
    gets the rest as served: Prefect keeps the sections it was not given, and the flow merges a given
    section with the served one field by field. Without input or output in settings they are left out:
    Prefect accepts a deployment default that lacks required fields, and the form asks for them.
    """
    fields = RunSpec.fields_from(settings)
    placeholders = {"input": fields["input"] or "-", "output": fields["output"] or "-"}
    params = RunSpec.model_validate({**fields, **placeholders}).parameters()
    for key in ("input", "output"):
        if not fields[key]:
            del params[key]
    for name in INTERNAL_FIELDS["BackendParams"]:  # filled by the run itself, never served
        params.get("backend", {}).pop(name, None)
    return params


def stage_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """The same defaults for the diagnose and tune flows, which take the run's parameters but its
    publishing and deadline ones."""
    return {k: v for k, v in params.items() if k in rollflow_tune.parameters.properties}


class ClosedParameters(ParameterSchema):
    """A flow's parameter schema that names every parameter it takes: the API refuses another (409)."""

    additionalProperties: bool = False


def closed(deployment: Any) -> Any:
    """The deployment with its parameter schema closed, so a misspelt parameter (`colection`) is refused
    by name when the run is created, instead of the run crashing on a keyword the flow does not take; the
    fields a run fills itself are left off the form."""
    schema = deployment._parameter_openapi_schema.model_dump(exclude_unset=True)
    for model, names in INTERNAL_FIELDS.items():
        found = (schema.get("definitions") or {}).get(model, {})
        for name in names:
            found.get("properties", {}).pop(name, None)
        if "required" in found:
            found["required"] = [r for r in found["required"] if r not in names]
    schema.get("definitions", {}).pop("AgentServer", None)
    for name in INTERNAL_FIELDS["BackendParams"]:
        (schema.get("properties", {}).get("backend", {}).get("default") or {}).pop(name, None)
    deployment._parameter_openapi_schema = ClosedParameters(**schema, additionalProperties=False)
    return deployment


def deployments(name: str, params: dict[str, Any], schedule: dict[str, Any]) -> list[Any]:
    """rollflow-run (with its schedule, if any), rollflow-diagnose, rollflow-tune and rollflow-reverify."""
    tags = ["rollflow"]
    stage = stage_parameters(params)
    return [closed(d) for d in [
        rollflow_run.to_deployment(
            name=name, parameters=params, tags=tags, description="diagnose, tune, collect, publish",
            **schedule,
        ),
        rollflow_diagnose.to_deployment(name=name, parameters=stage, tags=tags),
        rollflow_tune.to_deployment(name=name, parameters=stage, tags=tags),
        rollflow_reverify.to_deployment(name=name, tags=tags, description="rescore a published output"),
    ]]  # fmt: skip
