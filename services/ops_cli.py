"""Operator sub-commands of the `kvmesh` CLI: ``status`` (the router's view of its cluster),
``--version``, and the codec sizing behind ``kv-size --codec``."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from kvmesh.services.cli_checks import host_port, positive_float


def version() -> str:
    """The installed kvmesh version (package metadata), or "unknown" when not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("kvmesh")
    except PackageNotFoundError:
        return "unknown"


# connect_hint lives with the client library, which adds it to its own errors
from kvmesh.services.client import connect_hint  # noqa: E402,F401  (re-exported for the CLI)


# ---------------------------------------------------------------------------- status


def router_status(target: str, timeout: float = 10.0, api_key: str | None = None,
                  tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> dict:
    """Ask a router's ``Router/Status`` and return it as a dict.

    Returns ``{"policy", "indexed_blocks", "workers": [{"worker_id", "address",
    "cached_blocks", "running_requests", "waiting_requests", "queued_prefill_tokens",
    "free_blocks", "total_blocks", "model_id", "block_size", "routed_around"}]}`` (blocks are
    KV blocks, the router's index counts, over every namespace: all tenants and models;
    ``routed_around`` is "" for a worker the router sends requests to, else why it does not), or
    ``{"policy", "details_withheld": True}`` (no ``workers``) when the router showed only its
    policy to a caller that is not a cluster peer.
    ``api_key`` goes in the ``authorization: Bearer KEY`` metadata; ``tls_ca`` makes the channel TLS,
    verifying the router against that CA; ``tls_cert``/``tls_key`` add the client certificate a
    secure router (``kvmesh up`` without ``--insecure``) requires.

    Raises:
        grpc.RpcError: the router answered with an error (UNIMPLEMENTED: not a router).
        ValueError: a TLS file cannot be read, a client certificate without its key or CA, or an
            API key without TLS.
    """
    import grpc

    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

    from kvmesh.services.client import _credentials

    creds = _credentials(tls_ca or None, tls_cert or None, tls_key or None)
    if api_key and creds is None:
        raise ValueError("--api-key needs --tls-ca (or KVMESH_TLS_CA): without TLS the key would cross "
                         "the network in clear")
    channel = grpc.secure_channel(target, creds) if creds is not None else grpc.insecure_channel(target)
    from kvmesh.services.security import check_api_key

    check_api_key(api_key)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    with channel:
        st = pb_grpc.RouterStub(channel).Status(pb.RouterStatusRequest(), timeout=timeout, metadata=metadata)
    workers = []
    for w in st.workers:
        workers.append({"worker_id": w.worker_id, "address": w.address, "cached_blocks": int(w.cached_blocks),
                        "running_requests": int(w.load.running_requests),
                        "waiting_requests": int(w.load.waiting_requests),
                        "queued_prefill_tokens": int(w.load.queued_prefill_tokens),
                        "free_blocks": int(w.load.free_blocks), "total_blocks": int(w.load.total_blocks),
                        "model_id": w.model_id, "block_size": int(w.block_size), "routed_around": w.routed_around,
                        "tier_weights": {m: round(v, 4) for m, v in sorted(w.load.tier_weights.items())}})
    if st.details_withheld:  # no "workers" key: an empty list would read as "no live workers"
        return {"policy": st.policy, "details_withheld": True}
    return {"policy": st.policy, "indexed_blocks": int(st.indexed_blocks), "workers": workers}


def status_table(status: dict) -> str:
    """A plain-text table of `router_status` for a terminal."""
    if status.get("details_withheld"):
        return (f"router policy {status['policy']}; workers, loads and cached blocks are shown to cluster peers "
                "only: pass --tls-cert/--tls-key of a certificate the cluster CA signed (kvmesh up: "
                "RUN_DIR/credentials/peer.pem and peer.key). A router started without --client-ca asks no "
                "client for a certificate, so it sees no peers and shows these to nobody (the k8s overlays "
                "run it so: read loads from the workers' --metrics-port instead)\n")
    workers = status["workers"]
    around = [w for w in workers if w.get("routed_around")]
    lines = [f"router policy {status['policy']}, {len(workers)} live worker{'' if len(workers) == 1 else 's'}"
             + (f" ({len(around)} routed around, below)" if around else "")
             + f", {status['indexed_blocks']:,} KV blocks indexed (all tenants and models)"]
    header = ("worker", "address", "routed", "model", "block size", "running", "waiting", "queued prefill tokens",
              "free / total blocks", "cached blocks")
    rows = [(w["worker_id"], w["address"], "no" if w.get("routed_around") else "yes", w.get("model_id") or "?",
             str(w.get("block_size") or "?"), str(w["running_requests"]), str(w["waiting_requests"]),
             f"{w['queued_prefill_tokens']:,}", f"{w['free_blocks']:,} / {w['total_blocks']:,}",
             f"{w['cached_blocks']:,}") for w in workers]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if not workers:
        lines.append("(no live workers: check that workers run with the router's --redis-url and --cluster)")
    for w in around:
        lines.append(f"not routing to {w['worker_id']}: {w['routed_around']}")
    return "\n".join(lines) + "\n"


#: `kvmesh status`'s exit code when the router showed only its policy (the caller is not a
#: cluster peer): a script that checks the code does not take "no details" for "no workers".
STATUS_WITHHELD = 3


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    try:
        status = router_status(args.target, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca,
                               tls_cert=args.tls_cert, tls_key=args.tls_key)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") and exc.code() else "UNKNOWN"
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        if code == "UNIMPLEMENTED":
            detail = f"{args.target} is not a kvmesh router (kvmesh status asks Router/Status)"
        print(f"error: {code}: {detail}{connect_hint(code, detail)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status))
        if status.get("details_withheld"):  # the table says why itself; JSON readers get it here
            print(status_table(status), end="", file=sys.stderr)
    else:
        print(status_table(status), end="")
    return STATUS_WITHHELD if status.get("details_withheld") else 0


def register_status(sub) -> None:
    p = sub.add_parser("status", help="print a router's view of its cluster: live workers, their load and "
                                      "cached blocks, blocks indexed")
    p.add_argument("--target", required=True, type=host_port, help="HOST:PORT of a kvmesh router")
    p.add_argument("--timeout", type=positive_float("--timeout"), default=10.0,
                   help="RPC deadline, seconds > 0 (default 10)")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"),
                   help="API key, sent as `authorization: Bearer KEY` (default: $KVMESH_API_KEY; none)")
    p.add_argument("--tls-ca", default=os.environ.get("KVMESH_TLS_CA"),
                   help="CA certificate (PEM) to verify a TLS router (default: $KVMESH_TLS_CA; none: plaintext)")
    p.add_argument("--tls-cert", default=os.environ.get("KVMESH_TLS_CERT"),
                   help="client certificate (PEM) for a router that requires one (default: $KVMESH_TLS_CERT; none)")
    p.add_argument("--tls-key", default=os.environ.get("KVMESH_TLS_KEY"),
                   help="key of --tls-cert (PEM) (default: $KVMESH_TLS_KEY; none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)


# ---------------------------------------------------------------------------- kv-size --codec

#: Pool dtypes a codec can take blocks in (the worker's model dtype).
POOL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def codec_block_bytes(cfg, codec: str, block_size: int, dtype: str = "bf16") -> tuple[int, int]:
    """(bytes of one encoded block, bytes of one block in the pool) as the tier codec stores it.

    The block is ``(layers, 2, kv_heads, block_size, head_dim)`` of ``cfg``;
    ``payload_bytes`` comes from the codec itself (`cache_store.kv_codec`), so its scales
    are included.

    Raises:
        ValueError: unknown codec, a dtype that is not a pool dtype, or block_size < 1.
    """
    import torch

    from kvmesh.cache_store.kv_codec import make_codec

    if dtype not in POOL_DTYPES:
        raise ValueError(f"--dtype {dtype} is not a KV pool dtype; with --codec use one of {', '.join(POOL_DTYPES)}")
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1 (got {block_size})")
    shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, block_size, cfg.head_dim)
    c = make_codec(codec, shape, getattr(torch, POOL_DTYPES[dtype]))
    return int(c.payload_bytes), int(c.block_bytes)


def codec_size(cfg, tokens: int, batch: int, codec: str, block_size: int, dtype: str) -> dict:
    """What ``tokens x batch`` tokens take in a tier with ``codec``: whole blocks of
    ``block_size`` tokens, each `codec_block_bytes`. Returns blocks, bytes_per_block,
    pool_bytes_per_block, bytes and blocks_per_gib (the host tier's slots per GiB of
    ``--host-bytes``: it holds ``capacity // payload_bytes`` blocks, `cache_store.host_tier`)."""
    per_block, pool_block = codec_block_bytes(cfg, codec, block_size, dtype)
    blocks = math.ceil(tokens / block_size) * batch
    return {"codec": codec, "block_size": block_size, "blocks": blocks, "bytes_per_block": per_block,
            "pool_bytes_per_block": pool_block, "bytes": blocks * per_block,
            "blocks_per_gib": (1 << 30) // per_block}
