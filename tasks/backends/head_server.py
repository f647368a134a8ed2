"""NeMo Gym's head server: where each agent's rows go, read from its `GET /global_config_dict_yaml`.

NeMo Gym's collector posts an agent's rows to `/run` of the environment server that fronts the agent
(`environment_servers`, whose `agent_server` or `type: responses_api_agents` fields name agents); an agent
no environment server fronts is posted to directly, as older NeMo Gym versions did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import yaml

AGENTS_KEY = "responses_api_agents"
ENVIRONMENTS_KEY = "environment_servers"
CONFIG_PATH = "/global_config_dict_yaml"


class HeadServerError(Exception):
    """The head server could not be read, or its config names no agent: one paragraph, what to do."""


@dataclass(frozen=True)
class AgentRoute:
    """One agent's server: its base URL, NeMo Gym's name for that server, and its implementation."""

    url: str
    server: str
    server_type: str


def _address(block: Any, name: str) -> str | None:
    """A server's base URL from its host and port; a port that is not one is refused, naming the server."""
    if not (isinstance(block, dict) and block.get("host") is not None and block.get("port") is not None):
        return None
    host, port = str(block["host"]).strip(), str(block["port"]).strip()
    if (
        not host
        or any(c.isspace() or c in "/@?#" for c in host)
        or not port.isdigit()
        or not 0 < int(port) < 65536
    ):
        raise HeadServerError(
            f"The head server's config gives the server {name!r} host {block['host']!r} and port "
            f"{block['port']!r}, which is not an address (a host name and a port from 1 to 65535). Fix that "
            f"server's config and start it again. No request was sent."
        )
    return f"http://{host}:{int(port)}"


def _instances(config: dict[str, Any], kind: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Top-level instances of `kind`: name -> (implementation, its config)."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, block in config.items():
        servers = block.get(kind) if isinstance(block, dict) else None
        if isinstance(servers, dict) and servers:
            impl, server = next(iter(servers.items()))
            if isinstance(server, dict):
                found[str(name)] = (str(impl), server)
    return found


def _fronted(server: dict[str, Any]) -> list[str]:
    """The agents one environment server's config references (NeMo Gym's environment_server_agent_refs)."""
    return [
        str(ref["name"])
        for key, ref in server.items()
        if isinstance(ref, dict)
        and ref.get("name") is not None
        and (ref.get("type") == AGENTS_KEY or (key == "agent_server" and ref.get("type") is None))
    ]


def agent_routes(config: dict[str, Any]) -> dict[str, AgentRoute]:
    """Each agent of the config and the one server its rows go to; an agent fronted by several
    environment servers is left out (NeMo Gym refuses to choose between them too)."""
    fronts: dict[str, list[AgentRoute]] = {}
    for name, (impl, server) in _instances(config, ENVIRONMENTS_KEY).items():
        url = _address(server, name)
        for agent in _fronted(server) if url else []:
            fronts.setdefault(agent, []).append(AgentRoute(url, name, impl))  # type: ignore[arg-type]
    routes: dict[str, AgentRoute] = {}
    for name, (impl, server) in _instances(config, AGENTS_KEY).items():
        if name in fronts:
            if len(fronts[name]) == 1:
                routes[name] = fronts[name][0]
            continue
        url = _address(server, name)
        if url:
            routes[name] = AgentRoute(url, name, impl)
    return routes


def task_sources(config: dict[str, Any], routes: dict[str, AgentRoute]) -> dict[str, str]:
    """task_source -> agent, for rows that name no agent: an agent instance is its own source; a
    resources server is the source of the one agent bound to it (several: none, the row must be mapped)."""
    bound: dict[str, list[str]] = {}
    for name, (_impl, server) in _instances(config, AGENTS_KEY).items():
        ref = server.get("resources_server")
        if name in routes and isinstance(ref, dict) and isinstance(ref.get("name"), str):
            bound.setdefault(ref["name"], []).append(name)
    found = {source: agents[0] for source, agents in bound.items() if len(agents) == 1}
    return {**found, **{name: name for name in routes}}


def environment_servers(config: dict[str, Any]) -> dict[str, str]:
    """Environment server name -> its base URL (where `/aggregate_metrics` is asked)."""
    found = {}
    for name, (_impl, server) in _instances(config, ENVIRONMENTS_KEY).items():
        url = _address(server, name)
        if url:
            found[name] = url
    return found


async def read_config(head_url: str, timeout_s: float) -> dict[str, Any]:
    """The head server's global config as a dict (its body is a JSON string of the config)."""
    url = head_url.rstrip("/") + CONFIG_PATH
    what = f"NeMo Gym's head server at {head_url.rstrip('/')}"
    todo = (
        "Start the NeMo Gym servers (`ng_run` / `gym env start`), or point rollflow at the head server "
        "with +head_server.host=H +head_server.port=P (or --head-server URL), or give each agent's "
        "server with --backend-url. No request was sent."
    )
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            body = await resp.read()
            status = resp.status
    except TimeoutError:
        raise HeadServerError(f"{what} did not answer within {timeout_s:g} s. {todo}") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise HeadServerError(f"{what} could not be reached ({type(exc).__name__}: {exc}). {todo}") from None
    if status != 200:
        raise HeadServerError(f"{what} answered HTTP {status} to GET {CONFIG_PATH}. {todo}")
    try:  # a JSON string whose text is the config as YAML
        config = json.loads(body)
        config = yaml.safe_load(config) if isinstance(config, str) else config
    except (ValueError, yaml.YAMLError):
        config = None
    if not isinstance(config, dict):
        raise HeadServerError(f"{what} answered GET {CONFIG_PATH} with something that is not its config.")
    return config


async def discover(
    head_url: str, timeout_s: float
) -> tuple[dict[str, AgentRoute], dict[str, str], dict[str, str]]:
    """(agent routes, environment servers, task sources) of the running NeMo Gym servers."""
    config = await read_config(head_url, timeout_s)
    routes = agent_routes(config)
    if not routes:
        raise HeadServerError(
            f"NeMo Gym's head server at {head_url.rstrip('/')} names no agent server with a host and port. "
            "Start the agents with it (their configs in `ng_run` / `gym env start`). No request was sent."
        )
    return routes, environment_servers(config), task_sources(config, routes)


async def head_config_at(url: str, timeout_s: float) -> dict[str, Any] | None:
    """The config if `url` is a NeMo Gym head server (an agent URL given as --backend-url often is the
    head server's, port 11000), else None; never raises."""
    try:
        return await read_config(url, timeout_s)
    except HeadServerError:
        return None
