"""Loopback helpers shared by each fixture that starts a server (one implementation, rollflow.infra.local)."""

from rollflow.infra.local import free_port, wait_http

__all__ = ["free_port", "wait_http"]
