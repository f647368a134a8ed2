"""rollflow's flows: Prefect's `Flow`, minus two costs every command paid for at start-up.

Prefect builds a flow's parameter schema (the UI form) when the flow is declared, and encodes a run's
parameters with FastAPI's `jsonable_encoder`. For rollflow's flows, whose parameters are pydantic
sections, that was about 0.07 s of schema building and 0.1 s of importing
FastAPI in every command, for a schema only `serve` and the UI read. Here the schema is built when first
read, and parameters of JSON values and pydantic sections are encoded here, to the values Prefect gives.
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
from pydantic_core import PydanticSerializationError

_DECLARING = threading.Lock()
_declaring: tuple[int, Callable[..., Any]] | None = None  # (thread, function) of the LeanFlow declared now


class LeanFlow(Flow[..., Any]):
    """A Prefect flow whose parameter schema is built on first read; encodes parameters without FastAPI."""

    @property
    def parameters(self) -> ParameterSchema:
        schema = self.__dict__.get("_schema")
        if schema is None:  # deferred at declaration (None survives pickling, as Prefect's runner does)
            schema = self.__dict__["_schema"] = parameter_schema(self.fn)
        return schema

    @parameters.setter
    def parameters(self, schema: ParameterSchema | None) -> None:
        self.__dict__["_schema"] = schema

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """JSON values for the API, as Prefect's own gives them: JSON values and pydantic sections are
        encoded here; any other type by Prefect (`jsonable_encoder`, the only reason to import FastAPI).
        One difference, on purpose: a key starting with `_sa` (in a section's `overrides`, say) is kept where
        FastAPI drops it, so a run started again from the UI gets what this one was given."""
        encoded: dict[str, Any] = {}
        for key, value in parameters.items():
            try:
                encoded[key] = _encoded(value)
            except _UNENCODABLE:  # not plain, a model pydantic cannot dump, a list that holds itself
                encoded[key] = super().serialize_parameters({key: value})[key]
        return encoded


_SCALARS = (str, int, float, bool, type(None))


class _NotPlain(Exception):
    """A value `_encoded` leaves to Prefect's encoder."""


def _encoded(value: Any) -> Any:
    """As `jsonable_encoder` encodes JSON values and pydantic models, all the way down (a model by its JSON
    dump by alias, a tuple as a list); anything else (an enum, a subclass of str, a key that is not a
    str) raises _NotPlain."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if type(value) is dict and all(type(k) is str for k in value):
        return {k: _encoded(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [_encoded(v) for v in value]
    raise _NotPlain(type(value).__name__)


_UNENCODABLE = (_NotPlain, PydanticSerializationError, TypeError, ValueError, RecursionError)


def _deferring(fn: Callable[..., Any]) -> ParameterSchema | None:
    """prefect.flows.parameter_schema while a LeanFlow is declared: None (later) for that declaration,
    the schema for any other flow, on this thread or another."""
    if _declaring == (threading.get_ident(), fn):
        return None
    return parameter_schema(fn)


@contextmanager
def _schema_deferred(fn: Callable[..., Any]) -> Iterator[None]:
    """Flow.__init__ calls prefect.flows.parameter_schema(fn): while `fn` is declared, it defers."""
    global _declaring
    with _DECLARING:
        eager, _declaring = prefect.flows.parameter_schema, (threading.get_ident(), fn)
        prefect.flows.parameter_schema = _deferring
        try:
            yield
        finally:
            prefect.flows.parameter_schema, _declaring = eager, None


def flow(**options: Any) -> Callable[[Callable[..., Any]], LeanFlow]:
    """`@prefect.flow(**options)`, declaring a LeanFlow."""

    def declare(fn: Callable[..., Any]) -> LeanFlow:
        with _schema_deferred(fn):
            return LeanFlow(fn=fn, **options)

    return declare
