"""Whether the cluster an address names answers, and as the kind of server it names, before a run starts.

Ray waits for ever on a dead address (and 13 minutes on a port that is not Ray's); Dask fails a run after
its 30-s connect timeout, or waits on its handshake with a port that is not Dask's. Each address gets a
bounded probe here instead, and a wrong one is a usage error that names it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket

from rollflow.settings.models import RAY_TAKES_NONE, no_userinfo, ray_address_words

HEAD_PROBE_S = 5.0  # how long a cluster's head may take to answer
GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # served by Ray's GCS, not by its client server


def ray_address_env() -> str:
    """RAY_ADDRESS as the flag is read ("" when unset or blank)."""
    return ray_address_words(os.environ.get("RAY_ADDRESS", ""))


def ray_head_unreachable(
    address: str | None, timeout_s: float = HEAD_PROBE_S, label: str = "--ray-address"
) -> str | None:
    """Why no Ray cluster answers at `address` (host:port, ray://host:port, or auto: RAY_ADDRESS, else the
    cluster `ray start` recorded on this machine), or None (also for None and local: a local instance).
    Ray itself waits for ever on a dead address; prefect-ray starts a throwaway local instance for auto."""
    given = address
    if address == "auto":
        env = ray_address_env()
        address = env if env not in ("", "auto") else _recorded_ray_address()
        if address is None:
            return (
                f"{label} auto: no running Ray cluster to join (no RAY_ADDRESS, and no cluster started on "
                "this machine). Start one here (`ray start --head`), set RAY_ADDRESS, or give its head's "
                "address: host:port or ray://host:10001."
            )
    if address is None or address.lower() in ("local", "auto"):
        return None
    try:  # RAY_ADDRESS: the flag's value was refused as the settings read it
        no_userinfo(address, label, RAY_TAKES_NONE)
    except ValueError as exc:
        return str(exc)
    host, _, port = address.removeprefix("ray://").rpartition(":")
    found = f" (found at {address})" if given != address else ""
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "://" in host:  # http://, tcp://
        return (
            f"{label} {given}{found}: not a Ray cluster's address; give its head's host:port, "
            "ray://host:10001, auto or local."
        )
    client = address.startswith("ray://")
    if reason := _silent(host, int(port), client, timeout_s):
        return (
            f"{label} {given}{found}: nothing answers there ({reason}). Start the cluster "
            "(`ray start --head`) or give its head's address: host:port, ray://host:10001 or auto."
        )
    if reason := _other_ray_port(host, int(port), client, timeout_s):
        return f"{label} {given}{found}: {reason}."
    return None


def _silent(host: str, port: int, client: bool, timeout_s: float) -> str | None:
    """Why no Ray server answers at host:port, or None. Both Ray's GCS and its client server speak gRPC: a
    port that only accepts a connection (a web server, the dashboard) made Ray retry for 13 minutes. The
    GCS gets a TCP connect first, whose error names the cause; the client server only the handshake, as
    its own clients do: after bare TCP connects there, the next client's server failed to start (one
    client in three after two connects, two in two after five; none in three after five handshakes)."""
    if not client:
        try:
            socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
        except OSError as exc:
            return exc.strerror or str(exc)
    import grpc  # Ray's own dependency

    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        return f"no Ray server: no gRPC answer within {timeout_s:g} s"
    finally:
        channel.close()
    return None


def _other_ray_port(host: str, port: int, client: bool, timeout_s: float) -> str | None:
    """Why a Ray server answers there but not the kind the address names, or None. Ray's client port given
    as a GCS address, or the GCS port as ray://, failed after 22-32 s with Ray's own error. Only the GCS
    serves GetClusterId (read-only); the client server, as any other gRPC server, answers it UNIMPLEMENTED."""
    import grpc

    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            channel.unary_unary(GCS_PROBE)(b"", timeout=timeout_s)
        gcs = True
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            return None  # no verdict: Ray's own connect says more
        gcs = False
    if client and gcs:
        return "the head's GCS port, not Ray's client server: give it without ray://, or ray://host:10001"
    if not client and not gcs:
        return (
            "a gRPC server, but not Ray's GCS (Ray's client port? give that as ray://host:port; the GCS "
            "is the head's host:6379)"
        )
    return None


def _recorded_ray_address() -> str | None:
    """The cluster `ray start` recorded on this machine (or one running here), as Ray's `auto` finds it."""
    import ray  # its private modules expect the package loaded

    try:
        return ray._private.services.get_ray_address_from_environment("auto", None)
    except ConnectionError:
        return None


def dask_unreachable(address: str, timeout_s: float = HEAD_PROBE_S) -> str | None:
    """Why no Dask scheduler answers at `address` (tcp://host:port, tls://..., or host:port), or None: an
    address Dask cannot parse, a port nothing listens on, or one that does not answer Dask's handshake
    (made with Dask's configured security, as the run's client makes it)."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    label = f"--dask-address {address}"
    try:
        scheme, location = parse_address(address)
        get_backend(scheme)  # http:// and the like: Dask has no such comm
        host, port = parse_host_port(location) if scheme in ("tcp", "tls") else (None, 1)
        if not 0 < port < 65536:
            raise ValueError(port)
    except ValueError:
        return f"{label}: not a Dask scheduler's address; give tcp://host:8786 (port 1 to 65535)"
    if host is not None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            return (
                f"{label}: nothing answers there ({exc.strerror or exc}). Start the scheduler "
                "(`dask scheduler`) or give its address, tcp://host:8786."
            )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the caller may be on an event loop
        if (failed := pool.submit(asyncio.run, _dask_handshake(address, timeout_s)).result()) is None:
            return None
    return (
        f"{label}: no Dask scheduler answers there ({failed}); give the scheduler's address, "
        "tcp://host:8786 (tls:// with Dask's TLS settings)."
    )


async def _dask_handshake(address: str, timeout_s: float) -> str | None:
    """Why Dask's comm handshake failed, or None (Dask's own connect waits on it unbounded)."""
    from distributed.comm import connect
    from distributed.security import Security

    try:
        args = Security().get_connection_args("client")
        comm = await asyncio.wait_for(connect(address, timeout=timeout_s, **args), timeout_s)
    except TimeoutError:
        return f"no Dask handshake within {timeout_s:g} s"
    except Exception as exc:  # a web server's reply read as a frame length raised MemoryError, for one
        return f"{type(exc).__name__}: {exc}"[:300]
    await comm.close()
    return None
