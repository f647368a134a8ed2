"""rollflow's flows build their parameter schema when read and encode parameters as Prefect itself does."""

from __future__ import annotations

import datetime
import enum
import inspect
import threading
from pathlib import Path
from typing import Any

import cloudpickle
import prefect.flows
import pytest
from prefect import Flow
from prefect.utilities.callables import ParameterSchema, parameter_schema
from pydantic import BaseModel, Field, SecretStr

from rollflow.flows.flow_type import LeanFlow, flow
from rollflow.flows.pipeline import rollflow_run
from rollflow.flows.reverify import rollflow_reverify
from rollflow.flows.tuning import rollflow_diagnose, rollflow_tune
from rollflow.settings import RollflowSettings
from rollflow.settings.spec import RunSpec

FLOWS = [rollflow_run, rollflow_diagnose, rollflow_tune, rollflow_reverify]


class Colour(enum.StrEnum):
    RED = "red"


class Aliased(BaseModel):
    max_tokens: int = Field(alias="maxTokens")
    where: Path = Path("/a")
    when: datetime.datetime = datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC)


class Unencodable(BaseModel, arbitrary_types_allowed=True):
    thing: object = Field(default_factory=object)


def typed(value: Any) -> Any:
    """The value with every type spelled out: a tuple is not a list, an enum not its string."""
    if isinstance(value, dict):
        return ("dict", [(typed(k), typed(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [typed(v) for v in value])
    return (type(value).__name__, value)


def _spec() -> RunSpec:
    return RunSpec.from_settings(
        RollflowSettings(),
        input="s3://bucket/in.jsonl",
        output="/tmp/out/{date}",
        backend={"url": "http://127.0.0.1:9/v1", "kind": "chat", "model": "m", "max_retries": 2},
        collection={"limit": 4, "num_repeats": 3, "overrides": {"temperature": 0.25, "top_p": None}},
        deadline_s=12.5,
    )


@pytest.mark.parametrize("declared", FLOWS, ids=lambda f: f.name)
def test_the_schema_is_built_when_read_and_is_prefects(declared: LeanFlow) -> None:
    fresh = flow(name="fresh-" + declared.name)(declared.fn)
    assert not isinstance(fresh.__dict__["_schema"], ParameterSchema), "declaring built no schema"
    assert prefect.flows.parameter_schema is parameter_schema, "Prefect's own is back after declaring"
    expected = parameter_schema(declared.fn).model_dump()
    assert fresh.parameters.model_dump() == expected
    assert fresh.parameters is fresh.parameters, "built once"
    # what a deployment (serve, the UI's form) reads: Prefect builds it from the flow itself
    assert parameter_schema(fresh).model_dump() == expected
    first = next(iter(inspect.signature(declared.fn).parameters))
    assert fresh.parameters.properties[first]["title"] == first


def test_the_schema_survives_pickling_deferred_or_built() -> None:
    """Prefect's runner cloudpickles a flow for the process that runs it; one not importable by name
    travels by value, its deferred schema with it."""

    def local(count: int, name: str = "x") -> None: ...

    for read_first in (False, True):
        lean = flow(name="local")(local)
        if read_first:
            assert lean.parameters.properties["count"]["type"] == "integer"
        copy = cloudpickle.loads(cloudpickle.dumps(lean))
        assert copy is not lean and isinstance(copy.parameters, ParameterSchema)
        assert copy.parameters.model_dump() == parameter_schema(local).model_dump()


def test_other_flows_declared_meanwhile_get_their_schema() -> None:
    """The deferral is for the LeanFlow being declared only: a plain Flow built on another thread at the
    same time gets its schema."""

    def other(x: int, y: str = "a") -> None: ...

    plain: list[Flow] = []
    stop = threading.Event()

    def build() -> None:
        while not stop.is_set():
            plain.append(Flow(other, name="plain"))

    builder = threading.Thread(target=build)
    builder.start()
    try:
        for _ in range(50):
            flow(name="lean")(rollflow_run.fn)
    finally:
        stop.set()
        builder.join()
    assert plain and all(isinstance(f.parameters, ParameterSchema) for f in plain)
    assert Flow(other, name="after").parameters.properties["x"]["type"] == "integer"


def test_parameters_are_encoded_as_prefect_encodes_them() -> None:
    spec = _spec()
    as_given = spec.parameters()  # what the CLI passes: JSON values
    validated = rollflow_run.validate_parameters(as_given)  # what a run holds: pydantic sections
    looped: list[Any] = [1]
    looped.append(looped)
    odd = {
        "when": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "path": Path("/a/b"),
        "secret": SecretStr("hunter2"),
        "colour": Colour.RED,
        "colours": [Colour.RED, "red"],
        "tuple": (1, 2.5, None, "x"),
        "nested": {"t": (1, 2.5, None), "s": {3}},
        "enum_keys": {Colour.RED: 1},
        "int_keys": {1: "a"},
        "aliased": Aliased(maxTokens=7),
        "in_a_list": [Aliased(maxTokens=8)],
        "unencodable": object(),
        "unencodable_model": Unencodable(),
        "looped": looped,
        "int_big": 2**70,
        "float": 0.1,
        "inf": float("inf"),
    }
    for parameters in (as_given, validated, odd):
        mine = rollflow_run.serialize_parameters(parameters)
        prefects = Flow.serialize_parameters(rollflow_run, parameters)
        assert typed(mine) == typed(prefects)
    encoded = rollflow_run.serialize_parameters(odd)
    assert encoded["secret"] == "**********" and encoded["aliased"]["maxTokens"] == 7
    assert rollflow_run.serialize_parameters(validated)["collection"]["limit"] == 4


def test_keys_fastapi_would_drop_are_kept() -> None:
    """FastAPI's encoder drops keys starting with `_sa` (SQLAlchemy's): a run started again from the UI
    would lose them. The flows keep them."""
    spec = _spec().parameters()
    spec["collection"]["overrides"] = {"_sampler": "top-k", "temperature": 0.5}
    assert Flow.serialize_parameters(rollflow_run, spec)["collection"]["overrides"] == {"temperature": 0.5}
    assert (
        rollflow_run.serialize_parameters(spec)["collection"]["overrides"] == spec["collection"]["overrides"]
    )
