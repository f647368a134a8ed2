"""rollflow's flows build their parameter schema when read and encode parameters as Prefect itself does."""

from __future__ import annotations

import datetime
import enum
import inspect
from pathlib import Path

import pytest
from prefect import Flow
from prefect.utilities.callables import ParameterSchema, parameter_schema
from pydantic import SecretStr

from rollflow.flows.flow_type import LeanFlow, flow
from rollflow.flows.pipeline import rollflow_run
from rollflow.flows.reverify import rollflow_reverify
from rollflow.flows.tuning import rollflow_diagnose, rollflow_tune
from rollflow.settings import RollflowSettings
from rollflow.settings.spec import RunSpec

FLOWS = [rollflow_run, rollflow_diagnose, rollflow_tune, rollflow_reverify]


def _spec() -> RunSpec:
    return RunSpec.from_settings(
        RollflowSettings(),
        input="s3://bucket/in.jsonl",
        output="/tmp/out/{date}",
        backend={"url": "http://127.0.0.1:9/v1", "kind": "chat", "model": "m", "max_retries": 2},
        collection={"limit": 4, "num_repeats": 3, "overrides": {"temperature": 0.25, "top_p": None}},
        deadline_s=12.5,
    )


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize("declared", FLOWS, ids=lambda f: f.name)
def test_the_schema_is_built_when_read_and_is_prefects(declared: LeanFlow) -> None:
    fresh = flow(name="fresh-" + declared.name)(declared.fn)
    assert not isinstance(fresh.__dict__["_schema"], ParameterSchema), "declaring built no schema"
    assert fresh.parameters.model_dump() == parameter_schema(declared.fn).model_dump()
    assert fresh.parameters is fresh.parameters, "built once"
    # what a deployment (serve, the UI's form) reads: Prefect builds it from the flow itself
    assert parameter_schema(fresh).model_dump() == parameter_schema(declared.fn).model_dump()
    first = next(iter(inspect.signature(declared.fn).parameters))
    assert fresh.parameters.properties[first]["title"] == first


def test_parameters_are_encoded_as_prefect_encodes_them() -> None:
    spec = _spec()
    as_given = spec.parameters()  # what the CLI passes: JSON values
    validated = rollflow_run.validate_parameters(as_given)  # what a run holds: pydantic sections
    odd = {
        "when": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "path": Path("/a/b"),
        "secret": SecretStr("hunter2"),
        "colour": Colour.RED,
        "nested": {"t": (1, 2.5, None), "s": {3}},
        "unencodable": object(),
        "int_big": 2**70,
        "float": 0.1,
    }
    for parameters in (as_given, validated, odd):
        mine = rollflow_run.serialize_parameters(parameters)
        prefects = Flow.serialize_parameters(rollflow_run, parameters)
        assert mine == prefects
        assert [type(v) for v in mine.values()] == [type(v) for v in prefects.values()]
    assert rollflow_run.serialize_parameters(odd)["secret"] == "**********"
    assert rollflow_run.serialize_parameters(validated)["collection"]["limit"] == 4
