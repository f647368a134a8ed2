"""A stand-in for NeMo Gym's head server, so `ng_collect_rollouts` can reach an agent it did not start.

NeMo Gym's collector asks the head server (`GET /global_config_dict_yaml`) for the global config that names
each agent's host and port; `ng_run` would start the real one together with the agent servers. Here the
agent is rollflow's simulator, so this process serves only that config, naming the simulator as the agent.
Standard library only: `python bench/ng_head.py --port P --agent NAME --agent-url URL` (0 picks a port,
printed as `listening on http://...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


def global_config(head_port: int, agent: str, agent_url: str) -> dict:
    """The least config the collector's lookups need: the head server, the agent, and the environment
    server in front of it (the one `/run` goes to), both at `agent_url`."""
    url = urlsplit(agent_url)
    at = {"entrypoint": "app.py", "host": url.hostname, "port": url.port}
    return {
        "head_server": {"host": "127.0.0.1", "port": head_port},
        agent: {"responses_api_agents": {"simple_agent": at}},
        f"{agent}_environment": {
            "environment_servers": {
                "simple_environment": {**at, "agent_server": {"type": "responses_api_agents", "name": agent}}
            }
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--agent", required=True)
    p.add_argument("--agent-url", required=True)
    args = p.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b""
            if self.path.startswith("/global_config_dict_yaml"):
                body = json.dumps(json.dumps(cfg)).encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    cfg = global_config(server.server_address[1], args.agent, args.agent_url)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
