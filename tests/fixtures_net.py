"""Loopback helpers shared by every fixture that starts a server (one implementation, in infra.local)."""

from infra.local import free_port, wait_http

__all__ = ["free_port", "wait_http"]
