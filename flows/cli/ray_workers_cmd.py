"""`rollflow ray-workers --keep-s S`: starts the warm Ray chunk workers with the cluster, as `dask worker`
processes are started before a Dask run; runs with `--ray-keep-workers-s` then find them started."""

from __future__ import annotations

import argparse
import math
from typing import Any

from rollflow.flows.cli.errors import EXIT_INCOMPLETE, EXIT_OK, UsageError, check_engine

START_TIMEOUT_S = 120.0


def add_ray_workers_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ray-workers",
        help="start warm Ray chunk workers, one per CPU of the cluster, for runs with --ray-keep-workers-s",
    )
    p.add_argument(
        "--ray-address", required=True, help="the lasting Ray cluster (auto, head:6379 or ray://head:10001)"
    )
    p.add_argument(
        "--keep-s", type=float, required=True, help="each worker ends after this many seconds without a chunk"
    )
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=START_TIMEOUT_S,
        help="how long to wait for them to start (default %(default)s)",
    )


def cmd_ray_workers(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rollflow.flows.engines import keeps_warm_workers, start_warm_workers
    from rollflow.settings.models import EngineSettings

    if not (args.ray_address or "").strip():
        raise UsageError("--ray-address: give the cluster's address (host:port of its head, or ray://...)")
    try:
        spec = EngineSettings(runner="ray", ray_address=args.ray_address, ray_keep_workers_s=args.keep_s)
    except ValidationError as exc:
        error = exc.errors()[0]
        flag = "--ray-address" if error["loc"][:1] == ("ray_address",) else "--keep-s"
        raise UsageError(f"{flag}: {error['msg'].removeprefix('Value error, ')}") from None
    if not spec.ray_keep_workers_s > 0 or not 0 < args.start_timeout_s < math.inf:
        raise UsageError("--keep-s and --start-timeout-s must be numbers above 0")
    if not keeps_warm_workers(spec):
        raise UsageError(
            "--ray-address local: warm workers would end with the local instance this command starts; "
            "give the lasting cluster's address (auto, head:6379 or ray://head:10001)"
        )
    check_engine(spec)
    up, count = start_warm_workers(spec, args.start_timeout_s)
    print(
        f"{up} of {count} warm Ray chunk workers up (one per CPU of the cluster); each ends after "
        f"{spec.ray_keep_workers_s:g} s without a chunk"
    )
    return EXIT_OK if up == count else EXIT_INCOMPLETE
