"""``kvmesh router --backend vllm``: flags and start-up of the vLLM router mode.

Kept apart from `services.cluster_cli` so the router command gains the mode in a few lines.
"""
from __future__ import annotations

import argparse
import asyncio
import sys

__all__ = ["add_flags", "run"]


def add_flags(p: argparse.ArgumentParser) -> None:
    """Add ``--backend`` and the ``--vllm-*`` flags to the router command."""
    from kvmesh.services.vllm_compat import DEFAULT_SEED, HASH_ALGOS, SUPPORTED_VERSIONS

    g = p.add_argument_group("vLLM backend (--backend vllm; see docs/VLLM.md)")
    g.add_argument("--backend", choices=("kvmesh", "vllm"), default="kvmesh",
                   help="kvmesh: route kvmesh workers found through Redis (default); vllm: route vLLM OpenAI "
                        "servers from their own ZMQ KV events, serving OpenAI HTTP on --http-port (or --port)")
    g.add_argument("--vllm-server", action="append", default=[], metavar="[NAME=]URL,EVENTS[,REPLAY]",
                   help="a vLLM server: its base URL (http://HOST:8000), its --kv-events-config endpoint "
                        "(tcp://HOST:5557) and optionally its replay endpoint; repeat per server (default: none)")
    g.add_argument("--vllm-block-size", type=int, default=None, metavar="TOKENS",
                   help="the servers' --block-size (required: 16 is vLLM's CUDA default, 32 on its CPU backend)")
    g.add_argument("--vllm-hash-algo", default="sha256", choices=HASH_ALGOS,
                   help="the servers' --prefix-caching-hash-algo (default sha256, vLLM's default)")
    g.add_argument("--vllm-hash-seed", default=None, metavar="SEED",
                   help=f"the servers' PYTHONHASHSEED, if set (unset: vLLM seeds sha256 with {DEFAULT_SEED!r}; "
                        "xxhash then cannot be reproduced)")
    g.add_argument("--vllm-bytes-hashes", action="store_true",
                   help="the servers run with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (events carry whole digests)")
    g.add_argument("--vllm-version", default=SUPPORTED_VERSIONS[-1],
                   help=f"vLLM version whose hashing to use; each server's /version must match one of "
                        f"{', '.join(SUPPORTED_VERSIONS)} (default {SUPPORTED_VERSIONS[-1]})")
    g.add_argument("--served-model-name", default=None,
                   help="the servers' --served-model-name; requests naming another model (a LoRA adapter) are "
                        "routed by load only")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start the vLLM router mode from parsed ``router`` arguments; exits 2 on bad flags."""
    from kvmesh.services.vllm_compat import UnsupportedVllm, VllmHashConfig
    from kvmesh.services.vllm_router import parse_server_spec, serve_vllm_router

    if not args.vllm_server:
        parser.error("--backend vllm needs at least one --vllm-server URL,EVENTS")
    if args.vllm_block_size is None:
        parser.error("--backend vllm needs --vllm-block-size (the servers' --block-size)")
    for flag in ("tenant_request_limit", "tenant_token_limit"):
        if getattr(args, flag, None):  # a limit that would be silently ignored is refused
            parser.error(f"--{flag.replace('_', '-')} is not supported with --backend vllm "
                         "(its counters live in the cluster's Redis, which this mode has none of)")
    from kvmesh.workers.grpc_host import DEFAULT_MAX_CONCURRENT_RPCS

    ignored = [  # flags of kvmesh's own router that this mode would otherwise silently ignore
        ("--metrics-port", getattr(args, "metrics_port", None) not in (None, -1),
         "its metrics are at /metrics on the HTTP port (served without --api-keys)"),
        ("--metrics-token-file", getattr(args, "metrics_token_file", None) is not None,
         "its metrics are at /metrics on the HTTP port, which is not served with --api-keys"),
        ("--max-inflight-per-tenant", bool(getattr(args, "max_inflight_per_tenant", 0)),
         "bound each tenant in front of the router, or with the vLLM servers' own limits"),
        ("--max-concurrent-rpcs", getattr(args, "max_concurrent_rpcs", DEFAULT_MAX_CONCURRENT_RPCS)
         != DEFAULT_MAX_CONCURRENT_RPCS, "it serves HTTP, not gRPC"),
        ("--reflection", bool(getattr(args, "reflection", False)), "it serves HTTP, not gRPC"),
    ]
    for flag, given, instead in ignored:
        if given:
            parser.error(f"{flag} is not supported with --backend vllm ({instead})")
    port = args.http_port if args.http_port is not None else args.port
    if port is None:
        parser.error("--backend vllm serves OpenAI HTTP: give --http-port (or --port)")
    try:
        servers = [parse_server_spec(s, i) for i, s in enumerate(args.vllm_server)]
        config = VllmHashConfig(version=args.vllm_version, block_size=args.vllm_block_size,
                                hash_algo=args.vllm_hash_algo, hash_seed=args.vllm_hash_seed,
                                int_block_hashes=not args.vllm_bytes_hashes)
    except (ValueError, UnsupportedVllm) as exc:
        parser.error(str(exc))
    from kvmesh.services.security import server_gate

    try:  # a non-loopback bind without TLS, --api-keys without TLS: refused as for kvmesh's own router
        gate = server_gate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if gate.tls is not None and gate.tls.client_ca:
        print("error: --client-ca: the vLLM router mode takes API keys, not client certificates", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve_vllm_router(servers, config, port, host=args.host, model_dir=args.model,
                                      served_model=args.served_model_name, policy=args.policy, seed=args.seed,
                                      auth=gate.auth,
                                      ssl_context=gate.tls.server_ssl_context() if gate.tls is not None else None))
    except ValueError as exc:
        print(f"kvmesh router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the HTTP port could not be bound
        print(f"error: --http-port {port}: {exc.strerror or exc}; pick a free port", file=sys.stderr)
        return 2
    return 0
