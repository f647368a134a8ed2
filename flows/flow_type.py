"""rollflow's flows: Prefect's `Flow`, minus two costs every command paid for at start-up.

Prefect builds a flow's parameter schema (the UI form) when the flow is declared, and encodes a run's
parameters with FastAPI's `jsonable_encoder`. For rollflow's flows, whose parameters are pydantic
sections, that was about 0.1 s of schema building (and pydantic.v1's import) and 0.1 s of importing
FastAPI in every command, for a schema only `serve` and the UI read. Here the schema is built when first
read, and parameters of JSON values and pydantic sections are encoded here, with the same result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import prefect.flows
from prefect import Flow
from prefect.utilities.callables import ParameterSchema, parameter_schema
from pydantic import BaseModel

_DEFERRED: Any = object()  # what Flow.__init__ stores while the schema is left for later
_DECLARING = threading.Lock()


class LeanFlow(Flow[..., Any]):
    """A Prefect flow whose parameter schema is built on first read; encodes parameters without FastAPI."""

    @property
    def parameters(self) -> ParameterSchema:
        schema = self.__dict__.get("_schema", _DEFERRED)
        if schema is _DEFERRED:
            schema = self.__dict__["_schema"] = parameter_schema(self.fn)
        return schema

    @parameters.setter
    def parameters(self, schema: ParameterSchema) -> None:
        self.__dict__["_schema"] = schema

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """JSON values for the API, as Prefect's own gives them: JSON values and pydantic sections are
        encoded here; any other type by Prefect (`jsonable_encoder`, the only reason to import FastAPI)."""
        prefects = super().serialize_parameters
        return {
            key: _encoded(value) if _plain(value) else prefects({key: value})[key]
            for key, value in parameters.items()
        }


_SCALARS = (str, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """JSON values and pydantic models, all the way down (an enum or a subclass of str is not plain)."""
    if type(value) in _SCALARS or isinstance(value, BaseModel):
        return True
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    return False


def _encoded(value: Any) -> Any:
    """As `jsonable_encoder` encodes a plain value: a model by its JSON dump by alias, a tuple as a list."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if type(value) is dict:
        return {k: _encoded(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [_encoded(v) for v in value]
    return value


@contextmanager
def _schema_deferred() -> Iterator[None]:
    """Flow.__init__ calls prefect.flows.parameter_schema: while a LeanFlow is declared, it defers."""
    with _DECLARING:
        eager = prefect.flows.parameter_schema
        prefect.flows.parameter_schema = lambda fn: _DEFERRED
        try:
            yield
        finally:
            prefect.flows.parameter_schema = eager


def flow(**options: Any) -> Callable[[Callable[..., Any]], LeanFlow]:
    """`@prefect.flow(**options)`, declaring a LeanFlow."""

    def declare(fn: Callable[..., Any]) -> LeanFlow:
        with _schema_deferred():
            return LeanFlow(fn=fn, **options)

    return declare
