"""Starting the side servers of a worker or router: Prometheus ``/metrics`` and the
OpenAI-compatible HTTP front.

`start_worker_extras` and `start_router_extras` are what `workers.server.serve_worker`
and `services.router.serve_router` call after their gRPC server started; each returns
an `Extras` whose `stop` shuts the side servers down. The metrics server runs on its own
thread (`services.metrics.serve_metrics`); the HTTP front runs on the process's asyncio
loop (aiohttp) beside grpc.aio.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

log = logging.getLogger(__name__)


class Extras:
    """Side servers of one process: the ports they bound and how to stop them."""

    def __init__(self) -> None:
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.registry = None
        #: the OpenAI-compatible HTTP fronts started (`services.http_front.HttpFront`)
        self.http_fronts: list = []
        self._stops: list[Callable[[], Awaitable[None] | None]] = []

    async def stop(self) -> None:
        """Stop every side server (never raises)."""
        for fn in reversed(self._stops):
            try:
                res = fn()
                if res is not None:
                    await res
            except Exception:  # noqa: BLE001 - shutting down: log and go on
                log.exception("stopping a side server failed")
        self._stops.clear()


def _serve_metrics(extras: Extras, registry, host: str, port: int, what: str, token: str | None = None) -> None:
    from kvmesh.services.metrics import serve_metrics

    bound, server = serve_metrics(registry, port, host, token=token)
    extras.metrics_port = bound
    extras._stops.append(server.shutdown)
    print(f"kvmesh {what} metrics on http://{host}:{bound}/metrics", flush=True)


def _register_admission(servicer, registry) -> None:
    """The gRPC server's admission metrics (`metrics.AdmissionCollector`), when the server
    passed its `CallAdmission` on as ``servicer.admission``."""
    admission = getattr(servicer, "admission", None)
    if admission is not None:
        from kvmesh.services.metrics import AdmissionCollector

        registry.register(AdmissionCollector(admission))


async def start_worker_extras(servicer, host: str, metrics_port: int | None, http_port: int | None,
                              authenticate=None, ssl_context=None, metrics_token: str | None = None) -> Extras:
    """Serve a worker's metrics and, optionally, its HTTP front.

    Metrics are recorded whenever either is on (the HTTP front also serves ``/metrics``).
    ``authenticate``, ``ssl_context`` and ``metrics_token`` as in `start_router_extras`.

    Raises:
        RuntimeError: a port could not be bound (names the flag).
    """
    extras = Extras()
    if metrics_port is None and http_port is None:
        return extras
    from kvmesh.services.metrics import WorkerMetrics

    metrics = WorkerMetrics(servicer.engine, servicer.worker_id)
    servicer.metrics = metrics
    extras.registry = metrics.registry
    _register_admission(servicer, metrics.registry)
    if metrics_port is not None:
        _serve_metrics(extras, metrics.registry, host, metrics_port, f"worker {servicer.worker_id}", metrics_token)
    if http_port is not None:
        from kvmesh.services.http_front import HttpFront

        front = HttpFront(servicer.Generate, servicer.engine.tokenizer, servicer.engine.config.model_id,
                          model_dir=getattr(servicer.engine, "model_dir", None), registry=metrics.registry,
                          max_model_len=servicer.engine.max_model_len, authenticate=authenticate,
                          check_key=_key_check(servicer))
        front.metrics_private = metrics_token is not None
        extras.http_port = await front.start(host, http_port, ssl_context)
        extras.http_fronts.append(front)
        extras._stops.append(front.stop)
    return extras


def _key_check(servicer):
    """``Authorization`` header -> tenant under the servicer's gate when it requires API
    keys (raises `services.auth.Unauthenticated` for a missing or unknown key), else None:
    the HTTP front's model listing and model checks then ask for a key exactly when
    Generate does."""
    gate = getattr(servicer, "gate", None)
    auth = getattr(gate, "auth", None)
    if auth is None or not auth.requires_key:
        return None
    return lambda header: auth.tenant_for(header)


async def start_router_extras(servicer, host: str, metrics_port: int | None, http_port: int | None,
                              authenticate=None, ssl_context=None, metrics_token: str | None = None) -> Extras:
    """Serve a router's metrics and, optionally, its HTTP front.

    ``authenticate`` maps an ``Authorization`` header value (or None) to a tenant id and
    raises for a refused key (see `services.http_front.HttpFront`): the shape of
    ``services.auth``'s tenant resolver, e.g. ``lambda h: resolver.tenant_for(h)``. None
    allows anonymous requests. ``ssl_context`` serves the HTTP front over HTTPS. With
    ``metrics_token`` the metrics port answers only requests bearing it
    (`services.metrics.bearer_only`).

    Raises:
        RuntimeError: a port could not be bound (names the flag).
    """
    extras = Extras()
    if metrics_port is None and http_port is None:
        return extras
    from kvmesh.services.metrics import RouterMetrics

    metrics = RouterMetrics(servicer)
    servicer.metrics = metrics
    servicer.subscriber.on_batch = metrics.observe_batch
    extras.registry = metrics.registry
    _register_admission(servicer, metrics.registry)
    if metrics_port is not None:
        _serve_metrics(extras, metrics.registry, host, metrics_port, "router", metrics_token)
    if http_port is not None:
        from kvmesh.services.http_front import HttpFront

        front = HttpFront(servicer.Generate, servicer.tokenizer, servicer.config.model_id,
                          model_dir=getattr(servicer, "model_dir", None), registry=metrics.registry,
                          authenticate=authenticate, max_model_len=servicer.config.max_position_embeddings,
                          check_key=_key_check(servicer))
        front.context_fn = servicer.served_context  # what the live workers serve
        front.metrics_private = metrics_token is not None
        extras.http_port = await front.start(host, http_port, ssl_context)
        extras.http_fronts.append(front)
        extras._stops.append(front.stop)
    return extras


def add_server_flags(p, what: str) -> None:
    """``--metrics-port``, ``--http-port`` and ``--max-concurrent-rpcs`` on the ``worker``
    and ``router`` commands."""
    from kvmesh.services.cli_checks import positive_int
    from kvmesh.workers.grpc_host import CONTROL_RPC_RESERVE, DEFAULT_MAX_CONCURRENT_RPCS

    data_plane = "Generate, Tokenize, FetchBlocks" if what == "worker" else "Generate, Tokenize"
    p.add_argument("--max-concurrent-rpcs", type=positive_int("--max-concurrent-rpcs"),
                   default=DEFAULT_MAX_CONCURRENT_RPCS, metavar="N",
                   help=f"most data-plane gRPC calls ({data_plane}) this {what} runs at once, counted from "
                        f"a call's start; more get RESOURCE_EXHAUSTED at once. Health checks and other "
                        f"control-plane calls get {CONTROL_RPC_RESERVE} more slots, after which gRPC refuses any "
                        f"call "
                        f"(default {DEFAULT_MAX_CONCURRENT_RPCS})"
                        + ("; not used by --backend vllm" if what == "router" else ""))
    def non_negative(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise argparse.ArgumentTypeError(f"--max-inflight-per-tenant must be an integer >= 0 (0: no limit), "
                                             f"got {text!r}")
        return value

    p.add_argument("--max-inflight-per-tenant", type=non_negative, default=0, metavar="N",
                   help=f"most Generate calls one tenant (from its API key or certificate) has in flight on this "
                        f"{what}; more get RESOURCE_EXHAUSTED at once, so one tenant's flood cannot take every "
                        "slot (default 0: no limit)" + ("; not used by --backend vllm" if what == "router" else ""))
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help=f"serve Prometheus metrics of this {what} at http://HOST:PORT/metrics (0 = a free port; "
                        "-1 or unset: off)")
    p.add_argument("--metrics-token-file", default=None, metavar="FILE",
                   help="answer --metrics-port only to requests with 'Authorization: Bearer TOKEN', TOKEN being "
                        "this file's content (Prometheus: authorization.credentials_file). The counters move with "
                        "each request: without a token, anyone who reaches the port can tell whether another "
                        "tenant's request was cached (default: no token; `kvmesh up` makes one)")
    p.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help=f"serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                        f"/health, /metrics) from this {what} (0 = a free port; -1 or unset: off, as for "
                        "`kvmesh up`)")


def server_ports(args) -> dict:
    """``metrics_port`` / ``http_port`` keyword arguments of `serve_worker` / `serve_router`."""
    out = {}
    for name in ("metrics_port", "http_port"):
        value = getattr(args, name, None)
        if value == -1:  # off, as `kvmesh up --http-port -1` means
            setattr(args, name, None)
            value = None
        if value is not None:
            if not 0 <= value < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be a port in [0, 65535] (got {value})")
            out[name] = value
    token_file = getattr(args, "metrics_token_file", None)
    if token_file is not None:
        from kvmesh.services.metrics import read_metrics_token

        if "metrics_port" not in out:
            raise ValueError("--metrics-token-file guards --metrics-port, which is off: add --metrics-port PORT "
                             "or leave the token file out")
        out["metrics_token"] = read_metrics_token(token_file)
    return out
