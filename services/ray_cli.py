"""`kvmesh ray`: place a kvmesh cluster on an existing Ray cluster.

The command line only; the placement itself is `kvmesh.services.ray_cluster`, which
imports ``ray`` (lazily, so no other kvmesh command pays for it).
"""
from __future__ import annotations

import argparse
import sys

STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")


def register(sub) -> argparse.ArgumentParser:
    from kvmesh.services.cli import _add_engine_args
    from kvmesh.services.cli_checks import cluster_name, policy_names
    from kvmesh.services.cluster_cli import redis_url

    p = sub.add_parser(
        "ray", help="place a router and N workers as actors on an existing Ray cluster",
        description="Connect to a running Ray cluster and place the kvmesh router (on the head node) and N "
                    "workers (one per GPU, or one per --cpus-per-worker bundle) as Ray actors in one "
                    "placement group. Runs until interrupted; then removes every actor and the placement "
                    "group.")
    p.add_argument("--address", default="auto",
                   help="Ray cluster: auto (the cluster this node belongs to, default), HOST:6379 or "
                        "ray://HOST:10001 (Ray Client)")
    p.add_argument("--workers", type=int, default=2, help="kvmesh workers to place (default 2)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0,
                   help="GPUs reserved per worker (default 0: CPU workers; 1 = one worker per GPU)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs reserved per worker (default 1)")
    p.add_argument("--strategy", default="SPREAD", type=str.upper, choices=STRATEGIES,
                   help="placement group strategy of the worker bundles (default SPREAD: across nodes; "
                        "PACK: as few nodes as possible)")
    p.add_argument("--router-port", type=int, default=50050,
                   help="port of the router on the head node (default 50050; 0 = a free one)")
    p.add_argument("--worker-port", type=int, default=0,
                   help="port of every worker on its node (default 0: a free one per worker)")
    p.add_argument("--redis-url", default=None, type=redis_url,
                   help="Redis of the cluster (default: start redis-server on the head node)")
    p.add_argument("--cluster", default="default", type=cluster_name,
                   help="Redis key namespace of the kvmesh cluster: 1-64 of A-Z a-z 0-9 . _ - (default 'default')")
    p.add_argument("--policy", default="kv_aware", metavar="NAME",
                   help=f"routing policy of the router, one of: {', '.join(policy_names())} (default kv_aware)")
    p.add_argument("--max-restarts", type=int, default=-1,
                   help="times Ray restarts a failed router or worker actor (default -1: always)")
    p.add_argument("--status-interval", type=float, default=10.0,
                   help="seconds between status lines (one per actor, with its node); default 10")
    p.add_argument("--status-file", default=None,
                   help="rewrite this file with the status lines every interval, once every actor serves "
                        "(for a liveness probe)")
    p.add_argument("--log-dir", default=None,
                   help="folder for each process's log, on its node (default $TMPDIR/kvmesh-ray-logs)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the placement group and every actor to serve (default 600)")
    p.add_argument("--insecure", action="store_true",
                   help="run without TLS and API keys (default: generate credentials as `kvmesh up` does; "
                        "docs/SECURITY.md)")
    p.add_argument("--allow-unauthenticated-ray", action="store_true",
                   help="place a secure cluster on a Ray cluster without token authentication whose nodes are "
                        "reachable from other machines (refused by default: Ray access would be peer access; "
                        "docs/SECURITY.md)")
    p.add_argument("--run-dir", default=None,
                   help="folder on the driver's machine for the generated credentials (RUN_DIR/credentials: CA "
                        "certificates, keys, api-keys, client.env; the CA keys are deleted once the certificates "
                        "are issued, the rest at stop); default a new temporary folder, removed at stop")
    p.add_argument("--cert-dns", action="append", default=[], metavar="NAME",
                   help="another DNS name clients reach the router by, added to its certificate (repeatable; "
                        "e.g. the Kubernetes Service kvmesh-router; default none)")
    _add_engine_args(p)
    p.set_defaults(func=cmd_ray)
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` (naming the flag), or None; checked before connecting."""
    if args.workers < 1:
        return f"--workers must be >= 1 (got {args.workers})"
    if args.gpus_per_worker < 0 or args.cpus_per_worker < 0:
        return "--gpus-per-worker and --cpus-per-worker must be >= 0"
    if args.gpus_per_worker == 0 and args.cpus_per_worker == 0:
        return "a worker bundle needs --cpus-per-worker > 0 or --gpus-per-worker > 0"
    if args.gpus_per_worker and not str(args.device).startswith("cuda"):
        return f"--gpus-per-worker {args.gpus_per_worker:g} needs --device cuda (got --device {args.device})"
    for flag in ("router_port", "worker_port"):
        if not 0 <= getattr(args, flag) < 65536:
            return f"--{flag.replace('_', '-')} must be in 0..65535"
    if args.address != "auto" and _host_port(args.address) is None:
        return f"--address {args.address!r} is not auto, HOST:PORT or ray://HOST:PORT (e.g. 10.0.0.5:6379)"
    if args.status_interval <= 0:
        return "--status-interval must be > 0 seconds"
    from kvmesh.services.cluster_cli import _tier_flag_problem

    return _tier_flag_problem(args)


#: Seconds `ray_address_problem` waits for a TCP connection to the cluster's address.
CONNECT_TIMEOUT_S = 5.0


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT``, ``[V6]:PORT`` or ``ray://HOST:PORT``; None when it is none of them."""
    rest = address.removeprefix("ray://")
    if rest != address and not rest.rpartition(":")[2].isdigit():
        rest += ":10001"  # Ray Client's default port
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def resolve_address(address: str) -> str:
    """The ``HOST:PORT`` (or ``ray://HOST:PORT``) ``ray.init(address=...)`` would dial: for
    ``auto``, ``RAY_ADDRESS`` when set, else the cluster this node last started (Ray's own lookup;
    "auto" itself when this Ray version does not offer that lookup).

    Raises:
        ConnectionError: ``auto`` finds no running Ray cluster.
    """
    import os

    env = os.environ.get("RAY_ADDRESS")
    if env and address == "auto":  # as ray.init: the variable stands in for auto
        address = env
    if address != "auto":
        return address
    try:  # Ray's own lookup of the cluster this node started; not a public API, so guarded
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return "auto"  # this Ray version moved it: leave the lookup to ray.init
    found = canonicalize_bootstrap_address("auto")
    if not found:
        raise ConnectionError("found no running Ray cluster on this node")
    return found


def ray_address_problem(address: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why the Ray cluster at ``--address`` cannot be reached, or None: a plain TCP connect
    to its GCS (or Ray Client) port within ``timeout`` seconds, before ``ray.init``, which
    retries an unreachable GCS for minutes."""
    import socket

    try:
        target = resolve_address(address)
    except (ConnectionError, ValueError) as exc:
        return (f"--address {address}: {str(exc).rstrip('.')}; start one (ray start --head) or pass --address "
                "HOST:PORT of its head")
    if target == "auto":  # not resolvable before ray.init with this Ray version: no pre-check
        return None
    hp = _host_port(target)
    shown = address if target == address else f"{address} ({target})"
    if hp is None:
        return f"--address {shown} is not auto, HOST:PORT or ray://HOST:PORT (e.g. 10.0.0.5:6379)"
    try:
        with socket.create_connection(hp, timeout=timeout):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        return (f"--address {shown}: could not reach the Ray cluster there ({reason} within {timeout:g} s); "
                "check that its head node is running (ray status) and the address and port")
    return None


def cmd_ray(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    problem = ray_address_problem(args.address)  # ray.init would retry an unreachable GCS for minutes
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    from kvmesh.services.ray_cluster import RaySpec, run_until_stopped

    return run_until_stopped(RaySpec.from_args(args))
