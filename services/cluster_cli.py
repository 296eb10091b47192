"""Cluster sub-commands of the `kvmesh` CLI: router, up, demo (bench is in bench/)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading


def redis_url(text: str) -> str:
    """argparse type of ``--redis-url``: a URL redis-py accepts (``redis://host:port/db``,
    ``rediss://...``, ``unix:///path``), checked before anything starts.

    Raises:
        argparse.ArgumentTypeError: not such a URL.
    """
    from redis.connection import parse_url

    try:
        parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Redis URL ({exc}); e.g. redis://127.0.0.1:6379/0")
    return text


def cmd_router(args: argparse.Namespace) -> int:
    if args.backend == "vllm":
        from kvmesh.services import vllm_cli

        return vllm_cli.run(args, args.router_parser)
    if args.port is None or args.redis_url is None:
        args.router_parser.error("the router needs --port and --redis-url (or --backend vllm)")
    from kvmesh.services.observability import server_ports
    from kvmesh.services.router import serve_router

    asyncio.run(serve_router(args.port, args.redis_url, policy=args.policy, host=args.host, model_dir=args.model,
                             cluster=args.cluster, seed=args.seed, **server_ports(args)))
    return 0


def _spec_from_args(args: argparse.Namespace, policy: str | None = None):
    from kvmesh.services.launcher import ClusterSpec

    return ClusterSpec(num_workers=args.workers, router_port=getattr(args, "port", 0) or 0,
                       redis_url=args.redis_url, policy=policy or args.policy, model=args.model,
                       block_size=args.block_size, num_blocks=args.num_blocks,
                       max_batched_tokens=args.max_batched_tokens, threads_per_worker=args.threads,
                       extra_worker_args=["--device", args.device, "--max-seqs", str(args.max_seqs),
                                          *(["--max-model-len", str(args.max_model_len)]
                                            if args.max_model_len else []),
                                          *_tier_worker_args(args)],
                       disk_dir=args.disk_dir, cluster=getattr(args, "cluster", None),
                       http_port=None if getattr(args, "http_port", -1) in (None, -1) else args.http_port)


def _tier_worker_args(args: argparse.Namespace) -> list[str]:
    """Tier flags passed through to every worker (each gets its own --disk-dir subdirectory)."""
    out = ["--host-bytes", str(args.host_bytes), "--host-codec", args.host_codec, "--disk-codec", args.disk_codec,
           "--disk-write-mode", args.disk_write_mode, "--peer-bytes", str(args.peer_bytes),
           "--peer-fetch", args.peer_fetch, "--peer-fetch-max-s", str(args.peer_fetch_max_s)]
    if args.disk_dir:
        out += ["--disk-bytes", str(args.disk_bytes)]
    if args.remote_bytes:
        out += ["--remote-bytes", str(args.remote_bytes), "--remote-codec", args.remote_codec]
    return out


def _tier_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the tier flags every worker would get, checked before anything starts."""
    import dataclasses

    from kvmesh.services.cli import tier_config

    cfg = tier_config(args)
    if cfg.remote_bytes and not cfg.remote_url:
        cfg = dataclasses.replace(cfg, remote_url="redis://started-by-up")  # up provides the Redis
    try:
        cfg.validate()
    except ValueError as exc:
        return str(exc)
    return None


def cmd_up(args: argparse.Namespace) -> int:
    from kvmesh.services.launcher import LocalCluster

    problem = _tier_flag_problem(args)
    if not -1 <= args.http_port < 65536:
        problem = f"--http-port must be a port in [0, 65535], or -1 for no HTTP front (got {args.http_port})"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: terminal closed
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(_spec_from_args(args))
    try:
        cluster.start()
        print(f"kvmesh cluster up: router {cluster.router_address} (policy {args.policy}), "
              f"{len(cluster.workers)} workers, redis {cluster.redis_url}, logs in {cluster.log_dir}", flush=True)
        print(cluster.router_address, flush=True)
        for line in ([cluster.http_url] if cluster.http_url else []) + list(cluster.metrics_urls.values()):
            print(line, flush=True)
        while not stop.is_set():
            stop.wait(0.5)
            dead = [wid for wid, (_, p) in cluster.workers.items() if p.poll() is not None]
            if dead:
                print(f"warning: workers exited: {', '.join(dead)} (see {cluster.log_dir})", file=sys.stderr)
                for wid in dead:
                    cluster.workers.pop(wid)
    finally:
        cluster.stop()
        print("kvmesh cluster stopped", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvmesh.bench.demo import run_demo

    result = run_demo(workers=args.workers, max_requests=args.max_requests, tokens_per_block=args.tokens_per_block,
                      max_output_tokens=args.max_output_tokens, concurrency=args.concurrency,
                      num_blocks=args.num_blocks, out_dir=args.out, trace=args.trace,
                      policies=args.policies.split(","))
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if result.get("ok", True) else 1


def add_worker_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, type=redis_url, help="publish KV events and a lease to this Redis "
                   "(omit for a standalone worker)")
    p.add_argument("--cluster", default="default", help="Redis key namespace of the cluster")


def register(sub) -> None:
    from kvmesh.services.cli import _add_engine_args

    p = sub.add_parser("router", help="serve the KV-aware router (kvmesh.v1.Router)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (required unless --backend vllm)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--redis-url", default=None, type=redis_url, help="the cluster's Redis (required unless "
                   "--backend vllm)")
    p.add_argument("--cluster", default="default")
    p.add_argument("--policy", default="kv_aware")
    p.add_argument("--model", default=None, help="model directory (for its tokenizer); default built-in")
    p.add_argument("--seed", type=int, default=None, help="seed of the router's tie-breaking")
    from kvmesh.services.observability import add_server_flags

    add_server_flags(p, "router")
    from kvmesh.services.vllm_cli import add_flags as add_vllm_flags

    add_vllm_flags(p)
    p.set_defaults(func=cmd_router, router_parser=p)

    p = sub.add_parser("up", help="start redis-server, a router and N workers on loopback")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    p.add_argument("--redis-url", default=None, type=redis_url, help="use this Redis instead of starting one")
    p.add_argument("--cluster", default=None,
                   help="Redis key namespace (default: a new one per run; name one to share a --redis-url's "
                        "remote tier across runs)")
    p.add_argument("--policy", default="kv_aware")
    p.add_argument("--http-port", type=int, default=0, metavar="PORT",
                   help="port of the router's OpenAI-compatible HTTP front (default 0: a free one; -1: off)")
    _add_engine_args(p)
    p.set_defaults(func=cmd_up)

    from kvmesh.bench.demo import DEFAULT_POLICIES

    p = sub.add_parser("demo", help="replay the bundled Mooncake trace sample on a local cluster, "
                       "round_robin vs kv_aware")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--max-output-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=None, help="blocks per worker (default: sized to the trace)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL (default: the bundled sample)")
    p.add_argument("--out", default=os.path.join("runs", "demo"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    from kvmesh.bench import harness

    harness.register(sub)

    from kvmesh.bench import sim

    sim.register(sub)
