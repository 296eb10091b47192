"""Request bodies that do not parse get INVALID_ARGUMENT, not UNKNOWN and a traceback.

grpc.aio parses each request with the handler's ``request_deserializer`` before the
servicer runs; a protobuf ``DecodeError`` there (a truncated or corrupted body, invalid
UTF-8 in a string field) escapes as an "unexpected exception", logged with a traceback
and answered with ``UNKNOWN``. `add_guarded` registers a generated ``add_*_to_server``
function's handlers with the parsing moved into the handler, so a body that does not
parse is answered ``INVALID_ARGUMENT`` with the parser's reason, and logged in one
line (at most ``LOG_BURST`` lines per ``LOG_WINDOW_S`` seconds; the rest are counted
and reported in the next line, so a hostile client cannot flood the log).

With an `RpcCap`, the same wrappers also count the data-plane RPCs in flight and answer
one over the cap RESOURCE_EXHAUSTED before parsing it, leaving the control plane alone.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Callable

import grpc

log = logging.getLogger(__name__)

#: Malformed-request log lines allowed per window, and the window (seconds).
LOG_BURST = 10
LOG_WINDOW_S = 10.0


class LogLimiter:
    """WARNING lines about what callers send, at most ``LOG_BURST`` per ``LOG_WINDOW_S``
    seconds; the lines dropped are counted and reported in the next line written, so a
    hostile client cannot flood the log.

    Args:
        logger: where the lines go (default this module's).
        what: what a line is about, plural, for the count of dropped ones
            (``"N more malformed requests not logged"``).
    """

    def __init__(self, logger: logging.Logger | None = None, what: str = "malformed requests") -> None:
        self.logger = logger or log
        self.what = what
        self.window_start = float("-inf")
        self.lines = 0
        self.suppressed = 0

    def warn(self, fmt: str, *args) -> None:
        self._log(logging.WARNING, fmt, args, False)

    def exception(self, fmt: str, *args) -> None:
        """An ERROR line with the current exception's traceback, under the same limit."""
        self._log(logging.ERROR, fmt, args, True)

    def error(self, fmt: str, *args, exc_info=None) -> None:
        """An ERROR line with ``exc_info`` (an exception or a ``sys.exc_info()`` tuple; None:
        no traceback), under the same limit."""
        self._log(logging.ERROR, fmt, args, exc_info)

    def _log(self, level: int, fmt: str, args: tuple, exc_info) -> None:
        now = time.monotonic()
        if now - self.window_start >= LOG_WINDOW_S:
            self.window_start, self.lines = now, 0
        if self.lines >= LOG_BURST:
            self.suppressed += 1
            return
        self.lines += 1
        if self.suppressed:
            fmt += f" (%d more {self.what} not logged)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self.logger.log(level, fmt, *args, exc_info=exc_info)


_limiter = LogLimiter()


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (then "..."), for caller input echoed in a log
    line or an error message."""
    return text if len(text) <= limit else text[:limit] + "..."


def _reason(exc: Exception) -> str:
    return clip(str(exc) or type(exc).__name__)


class RpcCap:
    """The most data-plane RPCs (`DATA_PLANE_METHODS`) one server runs at once.

    One over the limit is answered RESOURCE_EXHAUSTED before its body is parsed, and is not
    logged. Other RPCs (health, a worker's GetLoad, GetInfo, GetSnapshot, ClearCache, the
    router's Status) are not counted here, so they still answer while the data plane is
    full; `kvmesh.workers.grpc_host.GrpcHost` bounds them all with gRPC's own limit.
    """

    def __init__(self, limit: int) -> None:
        if int(limit) < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1 (got {limit})")
        self.limit = int(limit)
        self.active = 0

    def enter(self) -> bool:
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1

    def refusal(self) -> str:
        return (f"server busy: {self.limit} requests in flight, the most it takes at once "
                f"(--max-concurrent-rpcs); retry later or elsewhere")


class TenantCap:
    """The most Generate calls one tenant has in flight on one server (0: no limit).

    One tenant's flood of long requests would otherwise take every slot of `RpcCap`, the
    engine's waiting queue and the KV blocks of running requests, and every other tenant
    would be refused or wait. With a limit, a call past it is answered RESOURCE_EXHAUSTED
    at once, naming the tenant's own count, and other tenants keep their slots. The tenant
    is the one the server resolved from credentials (`services.auth.Gate.tenant`); "" in
    open mode, where every caller is one tenant. Single-threaded (the server's event loop).
    """

    def __init__(self, limit: int = 0) -> None:
        if int(limit) < 0:
            raise ValueError(f"max_inflight_per_tenant must be >= 0 (0: no limit), got {limit}")
        self.limit = int(limit)
        self.active: dict[str, int] = {}
        self.refused = 0

    def enter(self, tenant: str) -> bool:
        n = self.active.get(tenant, 0)
        if self.limit and n >= self.limit:
            self.refused += 1
            return False
        self.active[tenant] = n + 1
        return True

    def leave(self, tenant: str) -> None:
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
        else:
            self.active.pop(tenant, None)

    async def stream(self, tenant: str, context, inner):
        """``inner`` (an async generator of responses) under ``tenant``'s slot: a call past
        the limit is aborted RESOURCE_EXHAUSTED before ``inner`` starts; the slot is released
        however the call ends, and ``inner`` is closed at once (``aclosing``) when the caller
        stops reading, so its own clean-up (engine abort, in-flight counts) runs then."""
        if not self.enter(tenant):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.refusal(tenant))
        try:
            async with contextlib.aclosing(inner) as responses:
                async for msg in responses:
                    yield msg
        finally:
            self.leave(tenant)

    def refusal(self, tenant: str) -> str:
        who = f"tenant {clip(tenant, 64)!r}" if tenant else "this caller"
        return (f"{who} already has {self.limit} requests in flight here, the most one tenant may have "
                f"(--max-inflight-per-tenant); retry when one finishes")


#: RPCs counted by `RpcCap`: the ones that carry prompts or KV, or run the model.
DATA_PLANE_METHODS = frozenset({"Generate", "Tokenize", "FetchBlocks"})


def _guard(method: str, handler: grpc.RpcMethodHandler, cap: RpcCap | None = None) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None or handler.request_streaming:
        return handler

    async def refuse(exc: Exception, context) -> None:
        _limiter.warn("malformed %s request from %s: %s", method, context.peer(), _reason(exc))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request body is not a valid {method} message: {_reason(exc)}")

    if handler.response_streaming:
        inner = handler.unary_stream

        async def unary_stream(raw: bytes, context):
            if cap is not None and not cap.enter():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, cap.refusal())
            try:
                try:
                    request = parse(raw)
                except Exception as exc:  # DecodeError, or a UnicodeDecodeError on some protobuf builds
                    await refuse(exc, context)
                    return
                out = inner(request, context)
                if inspect.isasyncgen(out):
                    async for msg in out:
                        yield msg
                else:  # a coroutine that sends with context.write (the health service's Watch)
                    await out
            finally:
                if cap is not None:
                    cap.leave()

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=None,
                                                    response_serializer=handler.response_serializer)
    inner = handler.unary_unary

    async def unary_unary(raw: bytes, context):
        if cap is not None and not cap.enter():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, cap.refusal())
        try:
            try:
                request = parse(raw)
            except Exception as exc:
                await refuse(exc, context)
            return await inner(request, context)
        finally:
            if cap is not None:
                cap.leave()

    return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=None,
                                               response_serializer=handler.response_serializer)


class _Capture:
    """Stands in for the server while a generated ``add_*_to_server`` registers handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict]] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers also come through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services.append((service, handlers))


def add_guarded(add: Callable, servicer, server, cap: RpcCap | None = None) -> None:
    """Register ``servicer`` on ``server`` as ``add(servicer, server)`` would, with request
    parsing failures answered INVALID_ARGUMENT (unary-request methods only; kvmesh has
    no client-streaming RPC) and, with ``cap``, its `DATA_PLANE_METHODS` counted by it."""
    capture = _Capture()
    add(servicer, capture)
    if not capture.services:  # generated by an older grpcio-tools: register unguarded
        add(servicer, server)
    for service, handlers in capture.services:
        guarded = {name: _guard(f"{service}/{name}", h, cap if name in DATA_PLANE_METHODS else None)
                   for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)
