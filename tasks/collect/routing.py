"""Which agent answers a row: NeMo Gym's precedence, and the check that the agent exists before any request.

Precedence, as NeMo Gym's collector applies it: agent_map[the row's agent_ref.name] >
agent_map[its task_source] > agent_map._default (which +agent_name sets) > the row's own agent_ref.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any

from rollflow.settings import BackendParams, RunSpec
from rollflow.settings.models import AgentServer
from rollflow.tasks.backends.head_server import HeadServerError, discover

DEFAULT_KEY = "_default"


def agent_map_of(agent_name: str | None, agent_map: Mapping[str, str]) -> dict[str, str]:
    """+agent_name folded into agent_map as its `_default`, as NeMo Gym does (a conflict is refused)."""
    found = dict(agent_map)
    if agent_name is None:
        return found
    default = found.get(DEFAULT_KEY)
    if default is not None and default != agent_name:
        raise ValueError(
            f"agent_name={agent_name!r} conflicts with agent_map._default={default!r}; set only one of them"
        )
    found[DEFAULT_KEY] = agent_name
    return found


def row_agent(row: Mapping[str, Any]) -> str | None:
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None


def routed(row: dict[str, Any], agent_map: Mapping[str, str]) -> dict[str, Any]:
    """The row with the agent it goes to in its agent_ref (a new dict when re-routed; the input stays)."""
    if not agent_map:
        return row
    name, source = row_agent(row), row.get("task_source")
    mapped = next((agent_map[k] for k in (name, source) if isinstance(k, str) and k in agent_map), None)
    if mapped is None:
        mapped = agent_map.get(DEFAULT_KEY)
    if mapped is None:
        return row
    return {**row, "agent_ref": {"name": mapped}}


def unknown_agent(name: str, known: Collection[str]) -> str:
    """What to say of an agent no server answers for: the known ones, and the closest."""
    close = get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"agent {name!r} is not one the agent servers answer for (known: {', '.join(sorted(known))}){hint}"


@dataclass(frozen=True)
class AgentCheck:
    """The scan's check of each row's agent: mapped by `agent_map`, then one of `known`."""

    agent_map: Mapping[str, str]
    known: frozenset[str]
    # (from, to): agent_refs already in the data that the map replaced (NeMo Gym warns of them)
    overridden: set[tuple[str, str]] = field(default_factory=set)
    used: set[str] = field(default_factory=set)  # the agents the rows go to

    def problem(self, row: dict[str, Any]) -> str | None:
        before, name = row_agent(row), row_agent(routed(row, self.agent_map))
        if before is not None and name is not None and before != name and len(self.overridden) < 100:
            self.overridden.add((before, name))
        if name is None:
            return (
                "the row names no agent (no agent_ref.name) and no +agent_name or agent_map._default "
                "routes it; rows with several agents go each to their own server"
            )
        if name not in self.known:
            return unknown_agent(name, self.known)
        self.used.add(name)
        return None


async def with_agents(spec: RunSpec) -> RunSpec:
    """An agent run given a head server and no agent servers: the spec with each agent's server as the
    head server names it; +agent_name and agent_map targets it does not know are refused here."""
    backend = spec.backend
    if backend.kind.value != "agent" or backend.agents or not backend.head_server:
        return spec
    routes, _ = await discover(backend.head_server, backend.connect_timeout_s)
    col = spec.collection
    for where, name in (("+agent_name", col.agent_name), *(("agent_map", v) for v in col.agent_map.values())):
        if name is not None and name not in routes:
            raise HeadServerError(
                f"{where}: {unknown_agent(name, routes)} at the head server {backend.head_server}. "
                "No request was sent."
            )
    agents = {
        name: AgentServer(url=r.url, server=r.server, server_type=r.server_type) for name, r in routes.items()
    }
    found = BackendParams.model_validate({**backend.model_dump(), "agents": agents})
    return spec.model_copy(update={"backend": found})


def used_agents(spec: RunSpec, used: Collection[str]) -> RunSpec:
    """The spec with only the agents the rows go to (the others would take a share of the limit)."""
    agents = spec.backend.agents
    if not agents or not used or set(used) >= set(agents):
        return spec
    kept = {name: server for name, server in agents.items() if name in used}
    backend = BackendParams.model_validate({**spec.backend.model_dump(), "agents": kept})
    return spec.model_copy(update={"backend": backend})
