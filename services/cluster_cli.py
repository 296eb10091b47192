"""Cluster sub-commands of the `kvmesh` CLI: router, up, demo (bench is in bench/)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from kvmesh.services.cli_checks import cluster_name
from kvmesh.services.security import redact_url


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
        raise argparse.ArgumentTypeError(f"{redact_url(text)!r} is not a Redis URL ({redact_url(exc)}); "
                                         "e.g. redis://:PASSWORD@127.0.0.1:6379/0")
    return text


def _env_redis_url() -> str | None:
    """``KVMESH_REDIS_URL``: a Redis URL with its password kept out of ``ps``."""
    return os.environ.get("KVMESH_REDIS_URL") or None


def cmd_router(args: argparse.Namespace) -> int:
    if args.backend == "vllm":
        from kvmesh.services import vllm_cli

        return vllm_cli.run(args, args.router_parser)
    if args.port is None or not args.redis_url:
        args.router_parser.error("the router needs --port and --redis-url (or env KVMESH_REDIS_URL), "
                                 "or --backend vllm")
    from kvmesh.services.cli_checks import policy_problem, run_server, server_ports_problem
    from kvmesh.services.observability import server_ports
    from kvmesh.services.router import model_dir_problem, serve_router
    from kvmesh.services.security import server_gate

    try:  # first: a non-loopback bind without TLS is refused whatever else is wrong
        gate = server_gate(args)
        ports = server_ports(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # the router reads --model's config and tokenizer, never its weights
    problem = (policy_problem(args.policy) or model_dir_problem(args.model)
               or server_ports_problem(args.host, args))  # --port, --http-port, --metrics-port free
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # a port taken since it was checked is still a usage error naming its flag
    return run_server(serve_router(args.port, args.redis_url, policy=args.policy, host=args.host, model_dir=args.model,
                                   cluster=args.cluster, seed=args.seed, gate=gate, reflection=args.reflection,
                                   max_concurrent_rpcs=args.max_concurrent_rpcs,
                                   max_inflight_per_tenant=args.max_inflight_per_tenant,
                                   tenant_request_limit=args.tenant_request_limit,
                                   tenant_token_limit=args.tenant_token_limit, **ports), args.port)


#: engine flags of `up` that `ClusterSpec` carries itself (``--disk-dir``: one subfolder per worker)
_SPEC_ENGINE_FLAGS = ("model", "block_size", "num_blocks", "max_batched_tokens", "threads", "disk_dir")


def _spec_from_args(args: argparse.Namespace, policy: str | None = None):
    """The `ClusterSpec` of parsed `up` flags: every worker flag `up --help` lists reaches
    each worker (`services.cli.engine_worker_args`)."""
    from kvmesh.services.cli import engine_worker_args
    from kvmesh.services.launcher import ClusterSpec

    return ClusterSpec(num_workers=args.workers, router_port=getattr(args, "port", 0) or 0,
                       redis_url=args.redis_url, policy=policy or args.policy, model=args.model,
                       block_size=args.block_size, num_blocks=args.num_blocks,
                       max_batched_tokens=args.max_batched_tokens, threads_per_worker=args.threads,
                       extra_worker_args=engine_worker_args(args, skip=_SPEC_ENGINE_FLAGS),
                       disk_dir=args.disk_dir, cluster=getattr(args, "cluster", None),
                       http_port=None if getattr(args, "http_port", -1) in (None, -1) else args.http_port,
                       secure=not getattr(args, "insecure", True), extra_router_args=_tenant_limit_args(args))


def _tenant_limit_args(args: argparse.Namespace) -> list[str]:
    """The router flags of `up`'s per-tenant limits that were given (`add_tenant_limit_flags`)."""
    out: list[str] = []
    for flag in TENANT_LIMIT_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value:
            out += [flag, str(value)]
    return out


def _tier_flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the tier flags every worker would get, checked before anything starts."""
    import dataclasses

    from kvmesh.services.cli import tier_config

    try:
        cfg = tier_config(args)
        if cfg.remote_bytes and not cfg.remote_url:
            cfg = dataclasses.replace(cfg, remote_url="redis://started-by-up")  # up provides the Redis
        cfg.validate()
    except ValueError as exc:
        return str(exc)
    return None


def _supervise(cluster, policy, stop: threading.Event, poll_s: float = 0.5) -> int:
    """`kvmesh up`'s watch over its children until ``stop`` is set: a worker or the router
    that exits is started again on its port after the `RestartPolicy`'s backoff; one that
    crash-loops past the policy, or redis-server exiting (the index and leases are gone),
    ends the watch. Returns 0 when stopped, 1 when a part of the cluster is lost."""
    from kvmesh.services.cli_checks import exited_message

    due: dict[str, float] = {}  # name -> monotonic time of its restart
    while not stop.wait(poll_s):
        now = time.monotonic()
        for name, proc in cluster.exited():
            if name in due:
                continue
            delay = None if name == "redis-server" else policy.next_delay(name, now)
            if delay is None:  # a cluster missing a part is not "up"
                why = ("" if name == "redis-server" or policy.max_restarts == 0
                       else f"; not restarted: {policy.count(name)} restarts within {policy.window_s:g} s")
                print(f"error: {exited_message(name, proc)}{why}", file=sys.stderr, flush=True)
                return 1
            print(f"warning: {exited_message(name, proc)}; restarting it in {delay:g} s "
                  f"(restart {policy.count(name)}{'' if policy.max_restarts < 0 else f' of {policy.max_restarts}'})",
                  file=sys.stderr, flush=True)
            due[name] = now + delay
        for name, at in sorted(due.items()):
            if now >= at:
                del due[name]
                try:
                    proc = cluster.restart(name)
                except (OSError, RuntimeError, ValueError) as exc:
                    print(f"error: cannot restart {name}: {exc}", file=sys.stderr, flush=True)
                    return 1
                print(f"{name} restarted (pid {proc.pid})", flush=True)
    return 0


def startup_warnings(log_dir: str, names) -> list[str]:
    """The WARNING lines the processes ``names`` wrote to their logs in ``log_dir`` so far
    (a sizing that silently loses cache, say), each distinct message once, prefixed with the
    first process that logged it: `up` prints them, so they are not found only in a log."""
    seen: set[str] = set()
    out: list[str] = []
    for name in names:
        try:
            with open(os.path.join(log_dir, f"{name}.log"), encoding="utf-8", errors="replace") as fh:
                lines = fh.read().splitlines()
        except OSError:
            continue
        for line in lines:
            _, sep, message = line.partition(" WARNING ")
            if sep and message not in seen:
                seen.add(message)
                out.append(f"{name}: {message}")
    return out


def cmd_up(args: argparse.Namespace) -> int:
    from kvmesh.services.cli_checks import up_problem
    from kvmesh.services.launcher import LocalCluster, RestartPolicy

    problem = up_problem(args, _tier_flag_problem(args))  # before anything starts
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.insecure:
        print("WARNING: kvmesh up --insecure: security is OFF (no TLS, no API keys, every caller may read and "
              "clear every tenant's cache); for local development only", flush=True)
    from kvmesh.services.procs import SignalEvent, StartCancelled

    rc = 0
    stop = SignalEvent()  # set by the signal handler: a threading.Event could deadlock there
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: terminal closed
        signal.signal(sig, on_signal)
    cluster = LocalCluster(_spec_from_args(args))
    try:
        cluster.start(cancel=stop)  # a signal during start-up stops what started, no summary
        if stop.is_set():
            raise StartCancelled("start-up interrupted")
        print(f"kvmesh cluster up: router {cluster.router_address} (policy {args.policy}), "
              f"{len(cluster.workers)} workers, redis {redact_url(cluster.redis_url)}, logs in {cluster.log_dir}",
              flush=True)
        print(cluster.router_address, flush=True)
        for warning in startup_warnings(cluster.log_dir, cluster.workers):  # stderr: stdout's lines are fixed
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        for line in ([cluster.http_url] if cluster.http_url else []) + list(cluster.metrics_urls.values()):
            print(line, flush=True)
        if cluster.credentials is not None:
            c = cluster.credentials
            print(f"secure: mTLS between processes, TLS + API key for clients (credentials in {c.run_dir}).\n"
                  f"clients: set -a; . {c.client_env}; set +a   (or pass --tls-ca {c.ca} --tls-cert "
                  f"{c.client_cert} --tls-key {c.client_key} --api-key KEY; the key is in {c.client_env})\n"
                  f"  e.g. kvmesh generate --target {cluster.router_address} --prompt hello\n"
                  f"metrics: send 'Authorization: Bearer TOKEN', TOKEN in {c.metrics_token}\n"
                  f"  e.g. curl -H \"Authorization: Bearer $(cat {c.metrics_token})\" URL", flush=True)
        rc = _supervise(cluster, RestartPolicy(args.max_restarts), stop)
    except StartCancelled:  # as `kvmesh bench` interrupted: 130, whichever signal
        name = signal.Signals(received[0]).name if received else "a signal"
        print(f"interrupted by {name} while starting: stopping what had started", file=sys.stderr, flush=True)
        rc = 130
    except RuntimeError as exc:  # a process that did not start: its reason, then stop the rest
        print(f"error: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        cluster.stop()
        print("kvmesh cluster stopped", flush=True)
    return rc


def cmd_demo(args: argparse.Namespace) -> int:
    from kvmesh.bench.demo import run_demo
    from kvmesh.services.cli_checks import demo_problem

    problem = demo_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    result = run_demo(workers=args.workers, max_requests=args.max_requests, tokens_per_block=args.tokens_per_block,
                      max_output_tokens=args.max_output_tokens, concurrency=args.concurrency,
                      num_blocks=args.num_blocks, out_dir=args.out, trace=args.trace,
                      policies=args.policies.split(","))
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if result.get("ok", True) else 1


def add_worker_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=_env_redis_url(), type=redis_url, help="publish KV events and a lease to "
                   "this Redis, redis://:PASSWORD@HOST:PORT/DB (default env KVMESH_REDIS_URL; omit for a standalone "
                   "worker)")
    p.add_argument("--cluster", default="default", type=cluster_name,
                   help="Redis key namespace of the cluster: 1-64 of A-Z a-z 0-9 . _ - (default 'default')")


def _budget(flag: str):
    """argparse type of a ``N/PERIOD`` budget flag (`services.rate_limit.parse_limit`)."""
    def parse(text: str) -> str:
        from kvmesh.services.rate_limit import parse_limit

        try:
            parse_limit(flag, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()
    return parse


#: `up`'s and `router`'s per-tenant limit flags (`add_tenant_limit_flags`)
TENANT_LIMIT_FLAGS = ("--tenant-request-limit", "--tenant-token-limit")


def add_tenant_limit_flags(p: argparse.ArgumentParser, what: str = "router") -> None:
    """The router's per-tenant rate limits (`services.rate_limit`), on ``router`` and ``up``."""
    p.add_argument("--tenant-request-limit", type=_budget("--tenant-request-limit"), default=None,
                   metavar="N/PERIOD",
                   help=f"most Generate requests one tenant (from its API key or certificate) may send per period "
                        f"to the {what}, e.g. 600/minute (PERIOD: second, minute, hour or day), counted in the "
                        "cluster's Redis for every router of the cluster; more get RESOURCE_EXHAUSTED with a "
                        "retry-after (default: none)")
    p.add_argument("--tenant-token-limit", type=_budget("--tenant-token-limit"), default=None,
                   metavar="N/PERIOD",
                   help="most prompt tokens one tenant may send per period, e.g. 2000000/minute, as "
                        "--tenant-request-limit (default: none)")


def register(sub) -> None:
    from kvmesh.services.cli import _add_engine_args

    from kvmesh.services.cli_checks import policy_names, port_number

    policies = ", ".join(policy_names())
    p = sub.add_parser("router", help="serve the KV-aware router (kvmesh.v1.Router)")
    p.add_argument("--port", type=port_number, default=None,
                   help="TCP port to serve gRPC on, 1-65535 (0: a free one); required unless --backend vllm")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--redis-url", default=_env_redis_url(), type=redis_url,
                   help="the cluster's Redis, where workers publish leases and KV events, "
                        "redis://:PASSWORD@HOST:PORT/DB (default env KVMESH_REDIS_URL)")
    p.add_argument("--cluster", default="default", type=cluster_name,
                   help="Redis key namespace shared with the workers' --cluster: 1-64 of A-Z a-z 0-9 . _ - "
                        "(default 'default')")
    p.add_argument("--policy", default="kv_aware", metavar="NAME",
                   help=f"routing policy, one of: {policies} (default kv_aware)")
    p.add_argument("--model", default=None, help="model directory (for its tokenizer); default built-in")
    p.add_argument("--seed", type=int, default=None, help="seed of the router's tie-breaking")
    add_tenant_limit_flags(p)
    from kvmesh.services.observability import add_server_flags

    add_server_flags(p, "router")
    from kvmesh.services.security import add_server_args

    add_server_args(p)
    from kvmesh.services.vllm_cli import add_flags as add_vllm_flags

    add_vllm_flags(p)
    p.set_defaults(func=cmd_router, router_parser=p)

    p = sub.add_parser("up", help="start redis-server, a router and N workers on loopback")
    p.add_argument("--workers", type=int, default=2, help="worker processes to start, >= 1 (default 2)")
    p.add_argument("--port", type=port_number, default=0, help="router port, 1-65535 (default: a free one)")
    p.add_argument("--redis-url", default=None, type=redis_url, help="use this Redis instead of starting one")
    p.add_argument("--cluster", default=None, type=cluster_name,
                   help="Redis key namespace, 1-64 of A-Z a-z 0-9 . _ - (default: a new one per run; name one to "
                        "share a --redis-url's remote tier across runs)")
    p.add_argument("--policy", default="kv_aware", metavar="NAME",
                   help=f"routing policy of the router, one of: {policies} (default kv_aware)")
    p.add_argument("--http-port", type=int, default=0, metavar="PORT",
                   help="port of the router's OpenAI-compatible HTTP front on 127.0.0.1, checked free before "
                        "anything starts (default 0: a free one; -1: off)")
    p.add_argument("--insecure", action="store_true",
                   help="no TLS and no API keys (default: mTLS and keys generated in the cluster's run directory)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="a worker or the router that dies is started again on its port after 1, 2, 4, ... s, "
                        "up to N times per process in 10 minutes; past that, or if redis-server dies, up stops "
                        "the cluster and exits 1 (default 5; 0: never restart; -1: always)")
    add_tenant_limit_flags(p, "cluster's router")
    _add_engine_args(p)
    p.set_defaults(func=cmd_up)

    from kvmesh.bench.demo import DEFAULT_POLICIES

    p = sub.add_parser("demo", help="replay the bundled Mooncake trace sample on a local cluster, "
                       "round_robin vs kv_aware")
    p.add_argument("--workers", type=int, default=2, help="workers per cluster (default 2)")
    p.add_argument("--max-requests", type=int, default=None, help="replay the first N trace requests (default: all)")
    p.add_argument("--tokens-per-block", type=int, default=16,
                   help="tokens synthesized per trace block, K (default 16)")
    p.add_argument("--max-output-tokens", type=int, default=4, help="cap on output tokens per request (default 4)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight, closed loop (default 4)")
    p.add_argument("--num-blocks", type=int, default=None, help="blocks per worker (default: sized to the trace)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated routing policies, a fresh cluster each "
                        f"(default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL (default: the bundled sample)")
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="output folder (default runs/demo)")
    p.add_argument("--json", action="store_true", help="also print the result as JSON on stdout")
    p.set_defaults(func=cmd_demo)

    from kvmesh.bench import harness

    harness.register(sub)

    from kvmesh.bench import sim

    sim.register(sub)

    from kvmesh.services import ray_cli

    ray_cli.register(sub)
