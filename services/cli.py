"""The `kvmesh` command line: worker, generate, kv-size (and the cluster commands).

Every sub-command is a thin shell over a library call so that tests can call the same
code. Errors from a server exit with status 1 and print the gRPC status code name.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import sys
import time
import uuid

# gRPC's C core logs failed TLS handshakes and the like to stderr on its own (read when grpc
# is imported); the CLI reports each error once, with a hint, so only gRPC's errors are shown
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402

from kvmesh.services.security import add_client_args, add_server_args, client_options, server_gate
from kvmesh.services.cli_checks import host_port, port_number, positive_float, positive_int
from kvmesh.workers.request import DEFAULT_DEADLINE_SHED_FACTOR


#: How long a starting worker waits for another process renewing a lease under its
#: --worker-id to stop (a predecessor still serving; one that drains has withdrawn its
#: lease already) before it refuses to start (seconds);
#: environment variable ``KVMESH_DUPLICATE_ID_WAIT_S`` overrides it.
DUPLICATE_ID_WAIT_S = 60.0


def _int_at_least(low: int, flag: str, below: int | None = None):
    """argparse type: an integer >= ``low`` (and < ``below`` when given); the error names ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer, got {text!r}") from None
        if below is not None and not low <= value < below:
            raise argparse.ArgumentTypeError(f"{flag} must be in [{low}, {below}), got {value}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}, got {value}")
        return value
    return parse


def _float_at_least(low: float, flag: str):
    """argparse type: a finite number >= ``low``; the error names ``flag``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, got {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number >= {low:g}, got {text!r}")
        return value
    return parse


def _gc_grace(text: str) -> float:
    """argparse type of ``--remote-gc-grace-s``: 0 (off) or a finite number of seconds of at
    least `cache_store.remote_gc.MIN_GRACE_S`."""
    from kvmesh.cache_store.remote_gc import MIN_GRACE_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--remote-gc-grace-s takes a number of seconds, got {text!r}") from None
    if value == 0:
        return 0.0
    if not math.isfinite(value) or value < MIN_GRACE_S:
        why = ("" if not math.isfinite(value) or value < 0 else
               ": a shorter grace could delete the remote blocks of workers that are only restarting")
        raise argparse.ArgumentTypeError(f"--remote-gc-grace-s must be 0 (off) or a finite number of seconds >= "
                                         f"{MIN_GRACE_S:g}, got {text!r}{why}")
    return value


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite IEEE 754 binary32 value


def _temperature(text: str) -> float:
    """argparse type of ``generate --temperature``: a finite number >= 0 (0 = greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature takes a number, got {text!r}") from None
    # the wire format carries a float32: 1e308 would arrive as inf and be refused by the server
    if not 0 <= value <= FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"--temperature must be a finite number >= 0 (0 = greedy) that fits a "
                                         f"32-bit float (at most {FLOAT32_MAX:.4g}), got {text}")
    return value


def _top_p(text: str) -> float:
    """argparse type of ``generate --top-p``: a number in (0, 1]. 1 turns nucleus sampling
    off; 0 is refused, since the wire format reads a top_p of 0 as 1 (off), and so is a value
    its 32-bit float holds as 0 (under about 1.4e-45)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--top-p takes a number, got {text!r}") from None
    from kvmesh.workers.limits import as_float32

    if not 0 < value <= 1 or as_float32(value) == 0.0:  # the wire's 32-bit float would carry 0 (off)
        raise argparse.ArgumentTypeError(f"--top-p must be in (0, 1], got {text} (1 keeps every token: nucleus "
                                         "sampling off; a small P such as 0.01 keeps only the likeliest)")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF model directory (config.json + *.safetensors); "
                   "default: the built-in tiny Llama with seeded random weights")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks in the device pool (default 4096)")
    p.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:N] (default cpu)")
    p.add_argument("--max-batched-tokens", type=int, default=1024, help="token budget per step (default 1024)")
    p.add_argument("--max-seqs", type=int, default=32, help="max running requests (default 32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens, at most the model's max_position_embeddings (default: the model's)")
    p.add_argument("--max-waiting", type=positive_int("--max-waiting"), default=512,
                   help="most queued requests before new ones get RESOURCE_EXHAUSTED (default 512)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch default, which depends on the node). On a CPU the count is "
                   "part of the KV producer: workers that share KV (remote tier, peer fetch, a disk folder across "
                   "restarts) need the same count")
    p.add_argument("--compute-dtype", choices=["auto", "model", "float32", "bfloat16", "float16"], default="auto",
                   help="dtype of the forward pass; the KV pool keeps the checkpoint's (default auto: the "
                   "checkpoint's, except float32 for a bf16/fp16 checkpoint on a CPU, so that a cached prefix "
                   "gives the cold run's tokens; model: the checkpoint's, faster where bf16 GEMMs are, but a cached "
                   "prefix may then change an output)")
    p.add_argument("--long-prefill-token-threshold", type=_int_at_least(0, "--long-prefill-token-threshold"),
                   default=None, help="most prompt tokens one request prefills per step while other requests "
                   "run or wait, so short requests are not queued behind a long prompt (0 = no cap; default: a "
                   "quarter of --max-batched-tokens)")
    p.add_argument("--max-num-partial-prefills", type=_int_at_least(1, "--max-num-partial-prefills"),
                   default=2, help="most requests with a partly computed prompt at once (default 2)")
    p.add_argument("--deadline-shed-factor", type=_float_at_least(0.0, "--deadline-shed-factor"),
                   default=DEFAULT_DEADLINE_SHED_FACTOR, metavar="F",
                   help="a request whose gRPC deadline leaves less than F x its estimated time to first token "
                   "(its uncached tokens and the least that running requests compute before it, over the fastest "
                   "recent prefill rate) is failed DEADLINE_EXCEEDED before computing its prompt, as is one whose "
                   "deadline passed while it waited (0 = only those). F is a floor: a caller's is raised, up to 16x, "
                   "while its admitted requests miss their deadlines, and decays back with a 10 s half-life "
                   f"(default {DEFAULT_DEADLINE_SHED_FACTOR:g})")
    # the built-in names (tier_config imports no torch; the codec registry does)
    from kvmesh.cache_store.tier_config import BUILTIN_CODECS as codecs, DEFAULT_PEER_BYTES
    t = p.add_argument_group("cache tiers (sizes in bytes; K/M/G/T suffixes are powers of 1024)")
    t.add_argument("--host-bytes", type=parse_bytes, default=0,
                   help="host-memory tier for blocks evicted from the device pool (default 0: off)")
    t.add_argument("--host-codec", choices=codecs, default="none", help="host tier codec (default none)")
    t.add_argument("--disk-dir", default=None, help="directory of the disk tier (needs --host-bytes)")
    t.add_argument("--disk-bytes", type=parse_bytes, default=0,
                   help="disk tier capacity (default 0; needed with --disk-dir)")
    t.add_argument("--disk-codec", choices=codecs, default="none", help="disk tier codec (default none)")
    t.add_argument("--disk-write-mode", choices=("through", "back"), default="through",
                   help="through: write each block to disk as it enters the host tier (default; survives a "
                        "restart); back: only when the host tier evicts it")
    t.add_argument("--tier-load-policy", choices=("auto", "cost", "always"), default="auto",
                   help="cost: load a cached block from a lower tier only while that tier has measured faster "
                        "than recomputing it (a disk slower than a GPU's prefill is skipped); always: load "
                        "whatever is found; auto (default): cost with --device cuda, always on the CPU")
    t.add_argument("--remote-bytes", type=parse_bytes, default=0,
                   help="share blocks through the cluster's Redis (--redis-url), capped at this many bytes for "
                        "the whole cluster (default 0: off; needs --host-bytes)")
    t.add_argument("--remote-codec", choices=codecs, default="none",
                   help="codec of the blocks this worker puts in the remote tier (default none)")
    t.add_argument("--remote-record-key-file", default=None, metavar="PATH",
                   help="secret (at least 32 characters) keying the MAC of every remote-tier record, the same "
                        "file on every worker: a record without it is never loaded (kvmesh up and kvmesh ray make "
                        "one unless --insecure)")
    t.add_argument("--peer-bytes", type=parse_bytes, default=DEFAULT_PEER_BYTES,
                   help="staging memory for blocks fetched from peers or read from the remote tier "
                        "(default 64M; 0 disables peer fetch, and a remote tier needs it)")
    t.add_argument("--peer-fetch", choices=("auto", "never", "always"), default="auto",
                   help="fetch a prefix from the peer the router names: auto = only when the measured "
                        "transfer time beats the measured recompute time (default)")
    t.add_argument("--peer-fetch-max-s", type=float, default=2.0,
                   help="longest a peer fetch may take before the request recomputes (seconds, default 2)")


def engine_worker_args(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """The `kvmesh worker` flags that give a worker the engine and tier options in ``args``:
    every flag `_add_engine_args` defines whose parsed value differs from its default (the
    worker's default is the same), in definition order. For launchers (`kvmesh up`,
    `kvmesh ray`) that parse the same flags and start the workers; ``skip`` names
    destinations (e.g. ``"model"``, ``"disk_dir"``) the launcher passes its own way.

    Raises:
        TypeError: a flag kind this function cannot write back as command-line text.
    """
    probe = argparse.ArgumentParser(add_help=False)
    _add_engine_args(probe)
    out: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in skip or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreConstAction):  # store_true / store_false / store_const
            out.append(flag)
        elif isinstance(action, argparse._StoreAction) and action.nargs is None:
            out += [flag, str(value)]
        else:
            raise TypeError(f"{flag}: cannot pass a {type(action).__name__} flag on to a worker")
    return out


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parse "4096", "64M", "2G", "1.5GiB" into bytes (binary units).

    Raises:
        argparse.ArgumentTypeError: not a non-negative size.
    """
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in _BYTE_UNITS and s[-1:] else ""
    num = s[: len(s) - len(unit)]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 4096, 512M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return int(value * _BYTE_UNITS[unit])


def tier_config(args: argparse.Namespace):
    """`TierConfig` from parsed worker options (validated by the engine).

    Raises:
        ValueError: an unreadable or too short ``--remote-record-key-file`` (with a remote tier).
    """
    from kvmesh.cache_store.tier_config import TierConfig, record_key_from_file

    key_file = getattr(args, "remote_record_key_file", None)
    try:
        record_key = record_key_from_file(key_file) if key_file and args.remote_bytes else None
    except ValueError as exc:
        raise ValueError(f"--remote-record-key-file: {exc}") from None
    return TierConfig(remote_record_key=record_key, host_bytes=args.host_bytes, host_codec=args.host_codec, disk_dir=args.disk_dir,
                      disk_bytes=args.disk_bytes, disk_codec=args.disk_codec, write_mode=args.disk_write_mode,
                      load_policy=args.tier_load_policy,
                      peer_bytes=args.peer_bytes, remote_bytes=args.remote_bytes, remote_codec=args.remote_codec,
                      remote_url=getattr(args, "redis_url", None), remote_cluster=getattr(args, "cluster", "default"))


def make_engine(args: argparse.Namespace, event_sink=None):
    """Build an `Engine` from parsed worker options.

    Raises:
        ValueError: inconsistent options (e.g. --disk-dir without --disk-bytes).
    """
    import torch

    from kvmesh.workers.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(model_dir=args.model, device=args.device, block_size=args.block_size,
                    num_blocks=args.num_blocks, max_num_batched_tokens=args.max_batched_tokens,
                    max_num_seqs=args.max_seqs, max_model_len=args.max_model_len, event_sink=event_sink,
                    max_waiting=getattr(args, "max_waiting", 512), tiers=tier_config(args),
                    long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", None),
                    max_num_partial_prefills=getattr(args, "max_num_partial_prefills", 2),
                    deadline_shed_factor=getattr(args, "deadline_shed_factor", DEFAULT_DEADLINE_SHED_FACTOR),
                    compute_dtype=getattr(args, "compute_dtype", "auto"))
    if engine.pool_capped:
        logging.getLogger("kvmesh.worker").warning(
            "context limited to %d tokens, what --num-blocks %d x --block-size %d holds (the model's own is %d): "
            "longer prompts are refused with INVALID_ARGUMENT; raise --num-blocks for a longer context",
            engine.max_model_len, engine.num_blocks, engine.block_size, engine.config.max_position_embeddings)
    tiers = engine.tiers
    if tiers is not None and tiers.host is not None and (tiers.disk is not None or tiers.remote is not None) \
            and tiers.host.num_slots < engine.num_blocks:
        # disk and remote writes are made from host slots: what finds none is not cached below
        logging.getLogger("kvmesh.worker").warning(
            "--host-bytes holds %d blocks, fewer than the device pool's %d: blocks evicted while every host slot "
            "is taken (or pinned by a pending disk write) are not written to disk or the remote tier either "
            "(metric kvmesh:tier_blocks_not_stored_total{reason=\"offload\"}); give --host-bytes at least %d bytes",
            tiers.host.num_slots, engine.num_blocks, engine.num_blocks * tiers.host.codec.payload_bytes)
    return engine


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """The ``HOST:PORT`` a worker puts in its lease: ``advertise``, else ``host:port``.

    Raises:
        ValueError: ``advertise`` is not ``HOST:PORT`` with a port in 1..65535, or it is
            missing while ``host`` is a wildcard (0.0.0.0, ::), which nobody can dial.
    """
    if advertise:
        h, sep, p = advertise.rpartition(":")
        if not sep or not h or not p.isdigit() or not 0 < int(p) < 65536:
            raise ValueError(f"--advertise {advertise!r} is not HOST:PORT (e.g. 10.0.3.7:50051)")
        return advertise
    if host in ("0.0.0.0", "::", "[::]", ""):
        raise ValueError(f"--host {host or repr(host)} binds every interface; pass --advertise HOST:PORT "
                         "with the address the router and peers should dial")
    return f"{host}:{port}"


def cmd_worker(args: argparse.Namespace) -> int:
    import socket

    from kvmesh.workers.server import serve_worker

    from kvmesh.services.cli_checks import (device_problem, engine_flag_problem, model_problem, pool_fit_problem,
                                            with_flag_names)

    problem = (engine_flag_problem(args) or device_problem(args.device)
               or model_problem(args.model, args.max_model_len) or pool_fit_problem(args))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from kvmesh.services.cli_checks import server_ports_problem, worker_resource_problem
    from kvmesh.services.procs import free_port

    bind_host = args.host if args.host not in ("", "::", "[::]") else "0.0.0.0"
    # every port before the model loads and a lease names this one (--http-port, --metrics-port too)
    problem = server_ports_problem(bind_host, args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.port == 0:  # pick a free port now, so the lease and the peers get the real one
        args.port = free_port(bind_host)
    worker_id = args.worker_id or f"{socket.gethostname()}:{args.port}"
    try:
        tier_config(args).validate()
    except ValueError as exc:
        print(f"error: {with_flag_names(exc)}", file=sys.stderr)
        return 2
    problem = worker_resource_problem(args)  # disk folder, tier sizes, KV pool memory: before allocating
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    peer = peer_options(args)
    from kvmesh.services.observability import server_ports

    try:
        ports = server_ports(args)
        advertise = advertised_address(args.host, args.port, args.advertise)
        gate = server_gate(args, worker=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    secure = {"tls": gate.tls, "gate": gate, "reflection": args.reflection}

    def serve(engine, on_stopper=None, on_drain=None) -> int:
        """Serve until SIGINT/SIGTERM, then drain; ``on_stopper(fn)`` receives a thread-safe
        ``fn()`` that stops the server too; ``on_drain()`` (blocking) runs as the drain starts."""
        import asyncio

        from kvmesh.services.cli_checks import run_server

        async def main():
            stop = asyncio.Event()
            if on_stopper is not None:
                loop = asyncio.get_running_loop()
                on_stopper(lambda: loop.call_soon_threadsafe(stop.set))
            await serve_worker(engine, args.port, host=args.host, worker_id=worker_id, peer=peer,
                               advertise=advertise, stop=stop, max_concurrent_rpcs=args.max_concurrent_rpcs,
                               max_inflight_per_tenant=args.max_inflight_per_tenant,
                               drain_timeout_s=args.drain_timeout_s, on_drain=on_drain,
                               remote_gc_grace_s=args.remote_gc_grace_s, **ports, **secure)

        return run_server(main(), args.port)  # a port taken since it was checked: exit 2 naming its flag

    if not args.redis_url:
        try:
            engine = make_engine(args)
        except ValueError as exc:  # a setting that only the model's shape can check
            print(f"error: {with_flag_names(exc)}", file=sys.stderr)
            return 2
        return serve(engine)
    from kvmesh.workers.kv_publisher import KVEventPublisher, WorkerLease, live_lease_holder

    # Two processes under one id would overwrite each other's lease and KV event stream. A
    # predecessor that still renews its lease (Ray restarts an actor while the old process has
    # not yet been told to stop) may be about to stop: wait for that, refuse only a worker that
    # outlives it. One that drains withdrew its lease at the signal, and the lease fencing keeps
    # its last events off the stream once this one holds the lease.
    wlog = logging.getLogger("kvmesh.worker")
    wait_s = float(os.environ.get("KVMESH_DUPLICATE_ID_WAIT_S", DUPLICATE_ID_WAIT_S))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = live_lease_holder(args.redis_url, worker_id, cluster=args.cluster)
        except Exception as exc:  # Redis down at start: the publisher and the lease retry on their own
            wlog.warning("could not check whether worker id %s is in use (%s)", worker_id, exc)
            holder = None
        if holder is None or time.monotonic() >= deadline:
            break
        wlog.warning("worker id %s: a worker at %s still renews its lease; waiting up to %.0f s for it to stop",
                     worker_id, holder.get("address", "?"), max(0.0, deadline - time.monotonic()))
    if holder is not None:
        print(f"error: --worker-id {worker_id} is in use in cluster {args.cluster!r}: a live worker at "
              f"{holder.get('address', '?')} has renewed its lease for {wait_s:.0f} s; give this "
              "worker another --worker-id, or stop that one first (two `kvmesh up` on one --redis-url need "
              "different --cluster names: each names its workers worker-0, worker-1, ...)", file=sys.stderr)
        return 2
    instance = uuid.uuid4().hex  # this process's token: its lease and its stream writes are fenced with it
    publisher = KVEventPublisher(args.redis_url, worker_id, cluster=args.cluster, instance=instance)
    try:
        engine = make_engine(args, event_sink=publisher.sink)
    except ValueError as exc:
        publisher.close()
        print(f"error: {with_flag_names(exc)}", file=sys.stderr)
        return 2
    engine.snapshot_seq_fn = publisher.flush_now
    from kvmesh.workers.model_identity import tokenizer_fingerprint

    # tokenizer_id: what a router compares its own tokenizer with before it sends text's token
    # ids here, without reading the weights that model_id covers
    from kvmesh.workers.grpc_host import KEEPALIVE_LEASE_FIELD, SERVER_MIN_PING_INTERVAL_S

    info = {"model_id": engine.kv_model_id, "block_size": engine.block_size, "num_blocks": engine.num_blocks,
            "max_model_len": engine.max_model_len, "kv_producer": engine.kv_producer,
            # routers send keepalive PINGs only to workers that say their server takes them
            KEEPALIVE_LEASE_FIELD: SERVER_MIN_PING_INTERVAL_S}
    try:
        info["tokenizer_id"] = tokenizer_fingerprint(args.model)
    except OSError as exc:  # read a moment ago by the engine; without it routers compare model ids
        wlog.warning("tokenizer files not hashed for the lease (%s): routers compare model ids instead", exc)
    stopper: dict = {"stop": None, "lost": False}

    def lost(holder: dict) -> None:  # another process took this id's lease: stop serving under it
        publisher.abandon()  # nothing more of ours goes into the stream the holder owns
        stopper["lost"] = True
        if stopper["stop"] is not None:
            stopper["stop"]()

    def on_stopper(stop) -> None:  # whichever of the two runs second stops the server
        stopper["stop"] = stop
        if stopper["lost"]:
            stop()

    lease = WorkerLease(args.redis_url, worker_id, advertise, info, engine.load, cluster=args.cluster,
                        fields_fn=publisher.lease_fields, on_lost=lost, instance=instance)
    if gate.tls is not None:  # fetch only from holders with a current lease (written with the cluster's Redis password)
        from kvmesh.workers.kv_publisher import LeaseCheck

        peer["holder_check"] = LeaseCheck(args.redis_url, cluster=args.cluster)
    try:
        # draining: the lease goes at once (routers stop choosing this worker), not at exit
        rc = serve(engine, on_stopper, on_drain=lease.close)
    finally:
        # the server's signal handlers went with its event loop: a further SIGTERM/SIGINT
        # would kill these last, bounded steps (lease and event stream closed cleanly)
        _ignore_stop_signals()
        lease.close()
        publisher.close()
        if "holder_check" in peer:
            peer["holder_check"].close()
    if lease.lost_to is not None:
        print(f"error: another process took --worker-id {worker_id}'s lease in cluster {args.cluster!r} (a worker "
              f"at {lease.lost_to.get('address', '?')}); this worker stopped so that the two do not serve and "
              "publish KV events under one id. Give each worker its own --worker-id", file=sys.stderr)
        return 1
    return rc


def _ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT from here on (main thread only; elsewhere a no-op)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def peer_options(args: argparse.Namespace) -> dict:
    """Peer-fetch options of `serve_worker` from parsed worker options."""
    return {"mode": args.peer_fetch, "max_fetch_s": args.peer_fetch_max_s}


def parse_token_ids(text: str) -> list[int]:
    """Parse "1,2,3" into [1, 2, 3] (spaces around an item are allowed).

    Raises:
        ValueError: an empty item ("1,,2", a trailing comma, or no ids at all) or an item
            that is not an integer; the message names ``--token-ids`` and the item.
    """
    out = []
    for n, item in enumerate(text.split(","), 1):
        item = item.strip()
        if not item:
            raise ValueError(f"--token-ids: item {n} of {text!r} is empty (expected e.g. 1,2,3)")
        try:
            out.append(int(item))
        except ValueError:
            raise ValueError(f"--token-ids: {item!r} is not an integer (expected e.g. 1,2,3)") from None
    return out


def _token_ids_arg(text: str) -> list[int]:
    """argparse type of ``generate --token-ids``: `parse_token_ids`, each id a uint32 as the
    wire format carries it."""
    try:
        ids = parse_token_ids(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--token-ids: ")) from None  # argparse names it
    bad = next((t for t in ids if not 0 <= t < 2**32), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{bad} is out of range [0, {2**32})")
    return ids


def generate(target: str, prompt: str | None = None, token_ids: list[int] | None = None, max_tokens: int = 16,
             tenant: str = "", temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             ignore_eos: bool = False, timeout: float = 600.0, channel: grpc.Channel | None = None,
             on_text=None, **client_options) -> dict:
    """Run one Generate RPC against a worker or router and collect the stream
    (`kvmesh.services.client.KvmeshClient`; ``client_options``: its TLS / API key / retry options).
    ``on_text`` is called with each piece of text as it arrives (streaming output).

    Returns a dict with ``token_ids``, ``text``, ``worker_id``, ``finish_reason``,
    ``usage`` {prompt_tokens, cached_tokens, cached_tokens_by_tier, computed_prefill_tokens,
    completion_tokens, lossy_cached_tokens} and ``timing`` {queue_ms, prefill_ms, ttft_ms, e2e_ms,
    client_ttft_ms, client_e2e_ms}. ``on_text(str)``, if given, gets each piece of text as
    its tokens arrive.

    Raises:
        grpc.RpcError: the server answered with an error status.
    """
    from kvmesh.services.client import KvmeshClient

    with KvmeshClient(target, channel=channel, timeout=timeout, **client_options) as client:
        kwargs = dict(max_tokens=max_tokens, tenant=tenant, temperature=temperature, top_p=top_p, seed=seed,
                      ignore_eos=ignore_eos)
        if on_text is None:
            out = client.generate(prompt if token_ids is None else None, token_ids, **kwargs)
        else:
            from kvmesh.services.client import make_request

            req = make_request(prompt if token_ids is None else None, token_ids, **kwargs)
            chunks = []
            for chunk in client.stream_request(req):
                chunks.append(chunk)
                if chunk.text:
                    on_text(chunk.text)
            out = client._collect(chunks, req.request_id)
    return out.to_dict()


def _print_error(args: argparse.Namespace, code: str, message: str) -> None:
    from kvmesh.services.ops_cli import connect_hint

    message += connect_hint(code, message)
    if args.json:
        print(json.dumps({"error": {"code": code, "message": message}}))
    print(f"error: {code}: {message}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.services.security import channel_credentials

    stream = args.stream if args.stream is not None else (sys.stdout.isatty() and not args.json)
    try:  # usage errors, found before dialing (the flags' own ranges are their argparse types)
        if stream and args.json:
            raise ValueError("--stream prints text as it comes; --json prints one object at the end: pick one")
        # the TLS files as the client reads them: --tls-cert without --tls-ca, half a key pair, an
        # unreadable file, and an API key without TLS (it would cross the network in clear)
        channel_credentials(args.tls_ca, args.api_key, args.tls_cert, args.tls_key)
        if args.prompt is not None and not args.prompt:
            raise ValueError("--prompt is empty: pass some text (or --token-ids)")
        for flag, text in (("--prompt", args.prompt), ("--tenant", args.tenant)):
            if text:
                try:  # argv bytes that are not UTF-8 arrive as lone surrogates (PEP 383)
                    text.encode("utf-8")
                except UnicodeEncodeError as bad:
                    code = ord(bad.object[bad.start])
                    what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
                    raise ValueError(f"{flag} is not UTF-8 text ({what} at character {bad.start}): pass UTF-8 "
                                     "text") from None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        out = generate(args.target, prompt=args.prompt, token_ids=args.token_ids, max_tokens=args.max_tokens,
                       tenant=args.tenant, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed if args.seed is not None else secrets.randbits(64),
                       ignore_eos=args.ignore_eos, timeout=args.timeout, on_text=show if stream else None,
                       **client_options(args))
    except ValueError as exc:  # a local check of the client's
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") and exc.code() else "UNKNOWN"
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        _print_error(args, code, detail)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        u = out["usage"]
        print("" if stream else out["text"])
        lossy = f" ({u['lossy_cached_tokens']} from a lossy codec)" if u.get("lossy_cached_tokens") else ""
        print(f"[worker {out['worker_id']}] prompt {u['prompt_tokens']} tokens, cached {u['cached_tokens']}{lossy}, "
              f"completion {u['completion_tokens']}, TTFT {out['timing']['ttft_ms']:.1f} ms, "
              f"E2E {out['timing']['e2e_ms']:.1f} ms", file=sys.stderr)
    return 0


#: kv-size's names of the KV pool dtypes (`workers.config.ModelConfig.dtype` -> ``--dtype``).
_KV_SIZE_POOL_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def kv_size_dtype(model: str, cfg, requested: str | None) -> tuple[str, str, str]:
    """The element type ``kv-size`` counts in: ``(dtype, source, why)``.

    ``requested`` (``--dtype``) wins (source ``"--dtype"``). Otherwise the dtype a worker
    would allocate its KV pool in for ``model`` (the pool keeps the checkpoint's dtype
    whatever ``--compute-dtype`` says): ``cfg.dtype`` as fp32, bf16 or fp16, with source
    ``"built-in model"`` for ``tiny``, ``"preset"`` for a `workers.config.KNOWN_SHAPES` name
    (their published weights' dtype) or ``"config.json"`` for a directory (its
    ``torch_dtype``, float32 when it names none, as the loader reads it). ``why`` says so in
    a few words. ``cfg`` is what `workers.config.resolve_model_shape` returned for ``model``.
    """
    if requested:
        return requested, "--dtype", "given with --dtype"
    from kvmesh.workers.config import KNOWN_SHAPES

    name = _KV_SIZE_POOL_NAMES[cfg.dtype]
    if str(model).strip().lower() == "tiny":
        return name, "built-in model", "the built-in model's dtype, which its worker's KV pool takes"
    if any(cfg is known for known in KNOWN_SHAPES.values()):
        return name, "preset", f"the dtype of {cfg.model_id}'s published weights, which a worker's KV pool takes"
    path = os.path.join(str(model).strip(), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        data = {}
    key = next((k for k in ("torch_dtype", "dtype") if isinstance(data, dict) and data.get(k)), None)
    if key is None:
        return name, "config.json", (f"{path} names no torch_dtype, so the worker loads it, and keeps its KV, "
                                     f"in {cfg.dtype}")
    return name, "config.json", f"{key} {data[key]!r} in {path}, which the worker's KV pool takes"


def cmd_kv_size(args: argparse.Namespace) -> int:
    from kvmesh.workers.config import kv_cache_bytes, resolve_model_shape

    try:
        cfg = resolve_model_shape(args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.dtype, dtype_source, dtype_why = kv_size_dtype(args.model, cfg, args.dtype)
    # said only when kv-size chose the dtype; an explicit --dtype prints as it always did
    dtype_note = "" if dtype_source == "--dtype" else f"dtype {args.dtype}: {dtype_why} (--dtype sizes another)"
    if args.tokens < 0 or args.batch < 1:
        print("error: --tokens must be >= 0 and --batch >= 1", file=sys.stderr)
        return 2
    if args.block_size is not None and not args.codec:
        print("error: --block-size sizes the blocks a tier stores: it needs --codec (without it the size is "
              "per token, whatever the block size)", file=sys.stderr)
        return 2
    args.block_size = 16 if args.block_size is None else args.block_size
    if args.codec:  # what a tier stores: whole blocks, encoded, scales included
        from kvmesh.services.ops_cli import codec_size

        try:
            sized = codec_size(cfg, args.tokens, args.batch, args.codec, args.block_size, args.dtype)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        result = {"model": args.model, "tokens": args.tokens, "batch": args.batch, "dtype": args.dtype,
                  "dtype_source": dtype_source, "dtype_reason": dtype_why, **sized,
                  "gib": round(sized["bytes"] / 2**30, 4)}
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{args.model}: {args.tokens} tokens x batch {args.batch} = {sized['blocks']:,} blocks of "
                  f"{args.block_size} tokens; codec {args.codec} stores {sized['bytes_per_block']:,} bytes per block "
                  f"(pool {args.dtype}: {sized['pool_bytes_per_block']:,}) = {sized['bytes']:,} bytes "
                  f"({result['gib']} GiB); {sized['blocks_per_gib']:,} blocks per GiB of --host-bytes "
                  "(disk and remote records add a small header per block)")
            if dtype_note:
                print(dtype_note)
        return 0
    nbytes = kv_cache_bytes(cfg, args.tokens, batch=args.batch, dtype=args.dtype)
    result = {
        "model": args.model, "tokens": args.tokens, "batch": args.batch, "dtype": args.dtype,
        "dtype_source": dtype_source, "dtype_reason": dtype_why,
        "num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "bytes": int(nbytes), "gib": round(nbytes / 2**30, 4),
        "bytes_per_token": nbytes // max(1, args.tokens * args.batch) if args.tokens else 0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model}: {args.tokens} tokens x batch {args.batch} in {args.dtype} = {int(nbytes):,} bytes "
              f"({result['gib']} GiB); formula 2 x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} kv "
              f"heads x {cfg.head_dim} head_dim x bytes/elem x tokens x batch")
        if dtype_note:
            print(dtype_note)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvmesh.services.ops_cli import register_status, version

    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh prefix-cache service")
    parser.add_argument("--version", action="version", version=f"kvmesh {version()}")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        type=str.upper, help="log level of this process (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="serve one worker (kvmesh.v1.Worker) until interrupted")
    p.add_argument("--port", type=port_number, required=True,
                   help="TCP port to serve gRPC on, 1-65535 (0: a free one, which is what gets advertised)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="address the router and peers use to reach this worker (default --host:--port; "
                        "required when --host is 0.0.0.0 or ::, e.g. the pod IP on Kubernetes)")
    p.add_argument("--worker-id", default=None, help="id in the cluster (default HOSTNAME:PORT)")
    from kvmesh.workers.grpc_host import DEFAULT_DRAIN_TIMEOUT_S

    p.add_argument("--drain-timeout-s", type=_float_at_least(0.0, "--drain-timeout-s"),
                   default=DEFAULT_DRAIN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM/SIGINT the worker withdraws its lease, refuses new requests with UNAVAILABLE "
                        "(health NOT_SERVING) and lets running requests finish for up to this many seconds; those "
                        "still running then end UNAVAILABLE; a second signal stops at once. On Kubernetes keep "
                        "preStop sleep + this + ~10 s within terminationGracePeriodSeconds "
                        f"(default {DEFAULT_DRAIN_TIMEOUT_S:g})")
    from kvmesh.cache_store.remote_gc import DEFAULT_GRACE_S, MIN_GRACE_S

    p.add_argument("--remote-gc-grace-s", type=_gc_grace, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="with --remote-bytes: delete the remote-tier keys of a KV producer (and of the untagged "
                        "namespace of older versions) that no live worker of the cluster has named for this many "
                        "seconds, e.g. after an upgrade of torch; one worker of the cluster at a time, in the "
                        f"background. 0 = off, else at least {MIN_GRACE_S:g} (default {DEFAULT_GRACE_S:g})")
    from kvmesh.services.observability import add_server_flags

    add_server_flags(p, "worker")
    _add_engine_args(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("generate", help="send one Generate request to a worker or router")
    p.add_argument("--target", required=True, type=host_port, help="HOST:PORT of a worker or router")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--token-ids", type=_token_ids_arg, help="comma-separated token ids, each in [0, 2**32), "
                   "e.g. 1,2,3")
    p.add_argument("--max-tokens", type=_int_at_least(1, "--max-tokens", 2**32), default=16,
                   help="most tokens to generate, >= 1 (default 16)")
    p.add_argument("--tenant", default="", help="cache salt: splits the prefix cache of your tenant (the tenant "
                   "itself comes from --api-key; default: none)")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature, >= 0; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=_top_p, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches P, "
                        "in (0, 1] (default 1: every token, nucleus sampling off)")
    p.add_argument("--seed", type=_int_at_least(0, "--seed", 2**64), default=None,
                   help="sampling seed in [0, 2**64), for reproducible sampling (default: a random one per "
                        "call, so sampled outputs differ)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence tokens until --max-tokens (default: stop at EOS)")
    p.add_argument("--timeout", type=positive_float("--timeout"), default=600.0,
                   help="RPC deadline in seconds, > 0 (default 600)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print text as tokens arrive (default: on when stdout is a terminal and not --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("kv-size", help="KV cache memory for a model shape, raw or as a tier codec stores it")
    p.add_argument("--model", required=True, help="tiny, a known name (e.g. Llama-3-8B) or a model directory")
    p.add_argument("--tokens", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16", "fp8", "int4"],
                   help="element type (default: the dtype a worker's KV pool takes for --model: a directory's "
                        "config.json torch_dtype, fp32 for tiny, bf16 for the named public models); without "
                        "--codec, fp8/int4 count values only, no scales; with --codec it is the pool dtype the "
                        "blocks come in (fp32, bf16 or fp16)")
    p.add_argument("--codec", default=None, choices=["none", "fp8", "int4"],
                   help="size whole blocks as the host/disk/remote tier codec stores them, scales included "
                        "(default: raw KV bytes, no block rounding)")
    p.add_argument("--block-size", type=int, default=None, help="with --codec: tokens per KV block (default 16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_kv_size)

    from kvmesh.services import cluster_cli

    cluster_cli.add_worker_cluster_args(sub.choices["worker"])
    add_server_args(sub.choices["worker"])
    add_client_args(sub.choices["generate"])
    cluster_cli.register(sub)
    register_status(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as exc:  # bad option (2) or start-up failure (1): say it plainly
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        from kvmesh.services.cli_checks import with_flag_names

        print(f"error: {with_flag_names(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:  # a path flag
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        from kvmesh.services.cli_checks import os_error_message

        print(f"error: {os_error_message(args, exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
