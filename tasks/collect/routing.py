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
from rollflow.tasks.backends.head_server import HeadServerError, discover, head_config_at

DEFAULT_KEY = "_default"
# How each of the scan's routing problems begins, so the error says "cannot be routed", not "bad JSON".
AGENT_PROBLEMS = ("agent ", "its agent", "its task_source", "it names no agent", "+num_repeats ")


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
    # dict checked first: the ABC's own check is slow, and every rollout's row passes here
    name = ref.get("name") if isinstance(ref, (dict, Mapping)) else None
    return name if isinstance(name, str) else None


def routed(
    row: dict[str, Any], agent_map: Mapping[str, str], sources: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The row with the agent it goes to in its agent_ref (a new dict when re-routed; the input stays).
    A row that names no agent and no map entry goes by its task_source (`sources`, from the head server)."""
    name, source = row_agent(row), row.get("task_source")
    if not agent_map and (name is not None or not sources):
        return row
    mapped = next((agent_map[k] for k in (name, source) if isinstance(k, str) and k in agent_map), None)
    if mapped is None:
        mapped = agent_map.get(DEFAULT_KEY)
    if mapped is None and name is None and isinstance(source, str) and sources:
        mapped = sources.get(source)
    if mapped is None:
        return row
    return {**row, "agent_ref": {"name": mapped}}


def unknown_agent(name: str, known: Collection[str]) -> str:
    """What to say of an agent no server answers for: the known ones, and the closest."""
    close = get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r})" if close else ""
    return f"agent {name!r}{hint} is not one the agent servers answer for (known: {', '.join(sorted(known))})"


@dataclass(frozen=True)
class AgentCheck:
    """The scan's check of each row's agent: routed by `agent_map` (and task_source), then one of `known`;
    with no known agents (one agent server given by URL), every row must go to the same one agent."""

    agent_map: Mapping[str, str]
    known: frozenset[str] | None
    sources: Mapping[str, str] = field(default_factory=dict)
    repeats: Mapping[str, int] = field(default_factory=dict)  # NeMo Gym's per-agent num_repeats, if given
    run_repeats: int | None = None  # the one count the run collects per row (with `repeats`)
    repeat_keys_seen: set[str] = field(default_factory=set)
    # (from, to): agent_refs already in the data that the map replaced (NeMo Gym warns of them)
    overridden: set[tuple[str, str]] = field(default_factory=set)
    used: dict[str, int] = field(default_factory=dict)  # the agents the rows go to, and their rows

    def problem(self, row: dict[str, Any]) -> str | None:
        before, name = row_agent(row), row_agent(routed(row, self.agent_map, self.sources))
        if before is not None and name is not None and before != name and len(self.overridden) < 100:
            self.overridden.add((before, name))
        if name is None:
            if self.known is None:
                return None
            source = row.get("task_source")
            if isinstance(source, str):
                return (
                    f"its task_source {source!r} names no agent of the head server (nor one agent bound "
                    f"to it); route it with +agent_map={{{source}: AGENT}}"
                )
            return "it names no agent (no agent_ref.name), and no +agent_name or agent_map._default routes it"
        if self.known is not None and name not in self.known:
            return unknown_agent(name, self.known)
        if self.known is None and self.used and name not in self.used:
            first = next(iter(self.used))
            return (
                f"its agent {name!r} differs from {first!r} of the rows before it, and one agent server URL "
                "was given: each agent needs its own server. Leave out --backend-url to find each agent "
                "through NeMo Gym's head server (or +head_server.host/port)"
            )
        if self.repeats:
            basis = before if before is not None else row.get("task_source")
            problem = self._repeats_problem(name, basis if isinstance(basis, str) else None)
            if problem:
                return problem
        self.used[name] = self.used.get(name, 0) + 1
        return None

    def _repeats_problem(self, target: str, basis: str | None) -> str | None:
        """NeMo Gym's rule: a key matches the agent the row goes to, else its agent_ref or task_source as
        written, else '_default'; rollflow collects one count per run, so another count is refused."""
        keys = list(dict.fromkeys(k for k in (target, basis) if k is not None))
        self.repeat_keys_seen.update(keys)
        matched = next((k for k in keys if k in self.repeats and k != DEFAULT_KEY), None)
        count = self.repeats[matched] if matched is not None else self.repeats.get(DEFAULT_KEY)
        if count is None:
            return (
                f"+num_repeats has no entry for its routing keys {' / '.join(keys)} and no '_default' "
                f"(entries: {', '.join(sorted(self.repeats))})"
            )
        if self.run_repeats is not None and count != self.run_repeats:
            return (
                f"+num_repeats gives it {count} rollouts ({matched or DEFAULT_KEY}), other rows "
                f"{self.run_repeats}; rollflow collects one count per run: collect each agent as its own run"
            )
        return None

    def warnings(self) -> list[str]:
        """What NeMo Gym warns of: agent_refs in the data that routing replaced, unknown num_repeats keys."""
        said = []
        if self.overridden:
            pairs = ", ".join(f"{a} -> {b}" for a, b in sorted(self.overridden))
            said.append(f"agent_map (or +agent_name) overrode agent_ref values already in the data: {pairs}")
        unseen = sorted(set(self.repeats) - self.repeat_keys_seen - {DEFAULT_KEY})
        if unseen:
            said.append(f"+num_repeats names agents no row routes by (a typo?): {', '.join(unseen)}")
        return said


async def with_agents(spec: RunSpec) -> RunSpec:
    """An agent run given a head server and no agent servers: the spec with each agent's server as the
    head server names it; +agent_name and agent_map targets it does not know are refused here."""
    backend = spec.backend
    if backend.kind.value != "agent" or backend.agents:
        return spec
    if not backend.head_server:
        urls = backend.urls
        if len(urls) != 1 or await head_config_at(urls[0], min(5.0, backend.connect_timeout_s)) is None:
            return spec
        # the URL given is NeMo Gym's head server, not an agent's: find the agents through it
        backend = backend.model_copy(update={"head_server": urls[0]})
    routes, _, sources = await discover(backend.head_server, backend.connect_timeout_s)
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
    found = BackendParams.model_validate({**backend.model_dump(), "agents": agents, "sources": sources})
    return spec.model_copy(update={"backend": found})


def used_agents(spec: RunSpec, used: Mapping[str, int]) -> RunSpec:
    """The spec with only the agents the rows go to (the others would take a share of the limit)."""
    agents = spec.backend.agents
    if not agents or not used or set(used) >= set(agents):
        return spec
    kept = {name: server for name, server in agents.items() if name in used}
    backend = BackendParams.model_validate({**spec.backend.model_dump(), "agents": kept})
    return spec.model_copy(update={"backend": backend})
