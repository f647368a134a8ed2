"""The per-process objects of one reverify: output store and ledger, storage options, the verifier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollflow.settings import RollflowSettings, redact
from rollflow.settings.reverify import ReverifySpec
from rollflow.tasks.reverify.chunk import ReverifyContext
from rollflow.tasks.reverify.plan import ReverifyPlan
from rollflow.tasks.reverify.source import SourcePlan
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.store import Store
from rollflow.tasks.verify.verifiers import VerifierError, make_verifier


@dataclass
class ReverifyHandles:
    spec: ReverifySpec
    store: Store
    ledger: Ledger
    source_options: dict[str, Any]
    output_options: dict[str, Any]


def open_reverify(spec: ReverifySpec, settings: RollflowSettings) -> ReverifyHandles:
    redact.register(settings)
    storage = settings.storage
    output_options = storage.storage_options(spec.output)
    store = Store(spec.output, output_options)
    return ReverifyHandles(spec, store, Ledger(store), storage.storage_options(spec.source), output_options)


def reverify_context(handles: ReverifyHandles, plan: ReverifyPlan) -> ReverifyContext:
    """The collection's verifier, built from the same settings (pool, processes, timeouts)."""
    return context_for(handles, plan.source)


def context_for(handles: ReverifyHandles, source: SourcePlan, sharers: int = 1) -> ReverifyContext:
    """`sharers`: the worker processes of this node that share its verifier processes (Dask, Ray)."""
    spec = handles.spec
    verifier = make_verifier(spec.verify, sharers=sharers)
    if verifier is None:
        raise VerifierError(
            "reverify needs a verifier: pass --verifier exact_match, math, math_fast, http or "
            "module:function (`none` scores nothing)."
        )
    return ReverifyContext(
        ledger=handles.ledger,
        source_url=source.url,
        mode=source.mode,
        source_options=handles.source_options,
        verifier=verifier,
        verifier_name=spec.verify.verifier_for("responses"),
        parallelism=spec.parallelism,
    )
