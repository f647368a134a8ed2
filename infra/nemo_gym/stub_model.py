"""A deterministic OpenAI-compatible stub model, so a real NeMo Gym stack runs offline and says who answered.

NeMo Gym's `openai_model` server calls `POST {openai_base_url}/responses` (the simple agent's path) and
`POST {openai_base_url}/chat/completions`; `gym env start` probes `GET {openai_base_url}/models` before it
marks the head server ready. This stub answers all three with "answer from NAME: <last user text>", the
same reply for the same request, and keeps the last request bodies (`GET /requests`) so a test can check
what reached the model (for example a seed in `extra_body`).

A request whose last user text contains FAIL_MARKER gets HTTP 400, which NeMo Gym does not retry: a cheap,
deterministic way to make one rollout fail.

Standard library only: `python stub_model.py --port 0 --name A` prints `listening on http://127.0.0.1:PORT`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAIL_MARKER = "stub:fail"
CREATED_AT = 1_700_000_000
KEEP_BODIES = 50


def _text_of(content: Any) -> str:
    """The plain text of a message's content, whether a string or a list of typed parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict)).strip()
    return ""


def last_user_text(body: dict[str, Any]) -> str:
    """The last user message's text, from a Responses `input` or a Chat Completions `messages` list."""
    items = body.get("input", body.get("messages", []))
    if isinstance(items, str):
        return items
    for item in reversed(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            return _text_of(item.get("content"))
    return ""


def _digest(body: dict[str, Any]) -> str:
    """A stable id for a request, so the same request always gets the same reply id."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


def _usage(prompt: str, reply: str) -> tuple[int, int]:
    """Token counts as whitespace words: deterministic and good enough for a stub."""
    return max(1, len(prompt.split())), max(1, len(reply.split()))


def responses_reply(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A complete Responses API object, as NeMoGymResponse.model_validate wants it."""
    prompt = last_user_text(body)
    text = f"answer from {name}: {prompt}"
    digest = _digest(body)
    input_tokens, output_tokens = _usage(prompt, text)
    return {
        "id": f"resp_{digest}",
        "object": "response",
        "created_at": CREATED_AT,
        "model": str(body.get("model") or f"stub-{name}"),
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "output": [
            {
                "id": f"msg_{digest}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }
        ],
        "parallel_tool_calls": True,
        "temperature": body.get("temperature"),
        "tool_choice": "auto",
        "tools": [],
        "top_p": body.get("top_p"),
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def chat_reply(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A complete Chat Completions object with one choice."""
    prompt = last_user_text(body)
    text = f"answer from {name}: {prompt}"
    prompt_tokens, completion_tokens = _usage(prompt, text)
    return {
        "id": f"chatcmpl-{_digest(body)}",
        "object": "chat.completion",
        "created": CREATED_AT,
        "model": str(body.get("model") or f"stub-{name}"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class StubState:
    """What the stub saw: a request count and the last few bodies, under a lock (the server is threaded)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.count = 0
        self.bodies: deque[dict[str, Any]] = deque(maxlen=KEEP_BODIES)

    def record(self, path: str, body: dict[str, Any]) -> None:
        """Keep one model request for GET /requests."""
        with self.lock:
            self.count += 1
            self.bodies.append({"path": path, "body": body})

    def snapshot(self) -> dict[str, Any]:
        """The count and the kept bodies, oldest first."""
        with self.lock:
            return {"name": self.name, "count": self.count, "last": list(self.bodies)}


def make_handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    """A request handler bound to one stub's state."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the stack's log is for NeMo Gym."""

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/v1/models", "/models"):
                model = {
                    "id": f"stub-{state.name}",
                    "object": "model",
                    "created": CREATED_AT,
                    "owned_by": "stub",
                }
                self._send(200, {"object": "list", "data": [model]})
            elif path == "/requests":
                self._send(200, state.snapshot())
            elif path in ("", "/health", "/v1"):
                self._send(200, {"status": "ok", "name": state.name})
            else:
                self._send(404, {"error": {"message": f"no route {path}", "type": "not_found"}})

        def do_DELETE(self) -> None:
            if self.path.rstrip("/") == "/requests":
                with state.lock:
                    state.count = 0
                    state.bodies.clear()
                self._send(200, {"cleared": True})
            else:
                self._send(404, {"error": {"message": "no route", "type": "not_found"}})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                self._send(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
                return
            if path in ("/v1/responses", "/responses"):
                make = responses_reply
            elif path in ("/v1/chat/completions", "/chat/completions"):
                make = chat_reply
            else:
                self._send(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
                return
            state.record(path, body)
            if FAIL_MARKER in last_user_text(body):
                message = f"stub {state.name} refuses: the prompt asks it to fail"
                self._send(400, {"error": {"message": message, "type": "invalid_request_error"}})
                return
            self._send(200, make(state.name, body))

    return Handler


def serve(port: int, name: str, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Bind the stub (port 0 picks a free one); the caller runs serve_forever."""
    server = ThreadingHTTPServer((host, port), make_handler(StubState(name)))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    """Serve until killed, after printing where."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server = serve(args.port, args.name, args.host)
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
