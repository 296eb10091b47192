"""Request bodies that do not parse get INVALID_ARGUMENT, not UNKNOWN and a traceback.

grpc.aio parses each request with the handler's ``request_deserializer`` before the
servicer runs; a protobuf ``DecodeError`` there (a truncated or corrupted body, invalid
UTF-8 in a string field) escapes as an "unexpected exception", logged with a traceback
and answered with ``UNKNOWN``. `add_guarded` registers a generated ``add_*_to_server``
function's handlers with the parsing moved into the handler, so a body that does not
parse is answered ``INVALID_ARGUMENT`` with the parser's reason, and logged in one
line (at most ``LOG_BURST`` lines per ``LOG_WINDOW_S`` seconds; the rest are counted
and reported in the next line, so a hostile client cannot flood the log).

The wrappers also admit each call when it starts, before its request message arrives
(`CallAdmission`): gRPC counts a call against its own limit from its first bytes, so a
caller that opens calls and never sends their message would otherwise hold every slot,
health checks' included, without ever reaching a handler. Each call must deliver its
message within ``REQUEST_MESSAGE_TIMEOUT_S``; a data-plane call is checked for credentials
and counted by the `RpcCap` at its start (one over the cap is answered RESOURCE_EXHAUSTED
at once, and its stalled calls are bounded per client host); control-plane calls, and
among them long-lived streams (health Watch, reflection), are bounded per client host for
their whole life, so one host cannot take the slots kept for the control plane. Every slot
is given back when the call ends, not when its handler returns. To read the message under a deadline, every unary-request method is
served as a stream-request one: the wire format is the same, and clients see no difference.
Such a call still takes exactly one request message, as a unary RPC does: one that sends a
second is answered INVALID_ARGUMENT, not served on its first, and the end of its request
stream must come within the same deadline as the message.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import logging
import time
from typing import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

#: Malformed-request log lines allowed per window, and the window (seconds).
LOG_BURST = 10
LOG_WINDOW_S = 10.0


def open_file_share(default: int, minimum: int = 1) -> int:
    """``default``, or a quarter of this process's open-file limit (``RLIMIT_NOFILE``,
    soft) when that is lower, and at least ``minimum``: the most connections one server of
    the process keeps, so that they never take the descriptors its other ports, Redis and
    disk files need."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return default
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return default
    return max(minimum, min(default, soft // 4))


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

#: Seconds a call has, from its start, to deliver its request message (a client sends it with
#: the call's headers; a request of the largest allowed size takes well under a second on any
#: link a cluster uses). Past it the call is answered DEADLINE_EXCEEDED and its slot is freed.
REQUEST_MESSAGE_TIMEOUT_S = 10.0
#: Control-plane calls (health, GetLoad, Status, ...) one client host has open at once,
#: counted from a call's start to its end (a call whose answer the client does not read
#: stays open). Cluster peers' calls have no limit in all besides gRPC's reserve
#: (`grpc_host.CONTROL_RPC_RESERVE`): a limit in all below it would let a few hosts refuse
#: everyone else.
CONTROL_PER_HOST = 8
#: Control-plane calls open at once from callers without a peer certificate (clients, load
#: balancers' health checks, strangers), all hosts together, on a TLS port; callers on the
#: server's own loopback (a pod's probes) are not counted here (`local_peer`). They have slots
#: of their own in gRPC's limit (`grpc_host.GrpcHost`), so however many hosts open them they
#: take no slot from the data plane nor from peers' control calls (probes, routers'
#: GetLoad); past it such a call is refused RESOURCE_EXHAUSTED. 256 is 64 client hosts each
#: holding its 4 health Watch streams.
ANONYMOUS_CONTROL_LIMIT = 256
#: Of those, long-lived streams (health Watch, and server reflection when it is on).
WATCH_PER_HOST = 4
#: Data-plane calls whose message has not come with the call (`_PROMPT_MESSAGE_S`) waiting
#: for it at once: in all, and from one client host. Each also holds a `RpcCap` slot, so
#: without this one caller's stalled calls could take the whole data plane (per-tenant caps
#: apply only once the message, which names a peer's tenant, is read).
DATA_PENDING_LIMIT = 64
DATA_PENDING_PER_HOST = 16


def peer_host(peer: str) -> str:
    """The client host of a gRPC peer string: ``ipv4:10.0.0.1:5000`` -> ``10.0.0.1``,
    ``ipv6:[2001:db8::1]:443`` -> ``2001:db8::1`` (an IPv4-mapped one as IPv4); a Unix
    socket peer is ``unix``."""
    kind, _, rest = peer.partition(":")
    if kind == "unix" or not rest:
        return kind or "?"
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    host = (rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest).strip("[]")
    if kind == "ipv6":
        try:
            mapped = ipaddress.IPv6Address(host.partition("%")[0]).ipv4_mapped
        except ValueError:
            return host
        if mapped is not None:
            return str(mapped)
    return host


def host_network(host: str) -> str:
    """What per-host limits count a caller without a peer certificate by: an IPv6 host by
    its /64 network (``2001:db8::1`` -> ``2001:db8::/64``: a site or a host is usually given a
    whole /64, RFC 6177, and could take a new address of it per call), loopback as itself;
    anything else unchanged."""
    try:
        ip = ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return host
    if ip.is_loopback:
        return host
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


def local_peer(peer: str) -> bool:
    """Whether a gRPC peer string is a caller on this machine (a loopback address or a Unix
    socket): in a pod, its own probes; no stranger's connection arrives from there."""
    host = peer_host(peer)
    if host == "unix":
        return True
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


class HostLimit:
    """A count with a limit per client host (`peer_host`) and, unless ``limit`` is None, in
    all. Single-threaded (the server's event loop)."""

    def __init__(self, per_host: int, limit: int | None = None) -> None:
        self.limit = limit
        self.per_host = int(per_host)
        self.total = 0
        self.by_host: dict[str, int] = {}

    def enter(self, host: str) -> bool:
        n = self.by_host.get(host, 0)
        if n >= self.per_host or (self.limit is not None and self.total >= self.limit):
            return False
        self.by_host[host] = n + 1
        self.total += 1
        return True

    def leave(self, host: str) -> None:
        self.total -= 1
        n = self.by_host.get(host, 0) - 1
        if n > 0:
            self.by_host[host] = n
        else:
            self.by_host.pop(host, None)


class CallAdmission:
    """Admits each call of one server when it starts, before its request message.

    * A data-plane call (`DATA_PLANE_METHODS`) is checked by ``admit`` (the port's
      credentials check: a caller without credentials is refused UNAUTHENTICATED at once)
      and takes a slot of ``cap`` (RESOURCE_EXHAUSTED at once when none is free), held until
      the call ends.
    * A data-plane call whose message has not come within ``_PROMPT_MESSAGE_S`` takes a
      `HostLimit` slot while it waits for it (``DATA_PENDING_LIMIT`` in all,
      ``DATA_PENDING_PER_HOST`` per client host; none free: RESOURCE_EXHAUSTED), so one
      caller cannot hold the whole data plane with calls that never send their message.
    * A control-plane call takes one of ``CONTROL_PER_HOST`` slots of its client host from
      its start to its end (none free: RESOURCE_EXHAUSTED), and a long-lived stream (health
      Watch, reflection) one of ``WATCH_PER_HOST`` as well. So one host cannot fill the
      reserve with calls that never send their message, or whose answers it never reads.
      A caller that ``trusted`` does not admit (neither a cluster peer nor on this
      machine's loopback) counts in ``anonymous_control`` instead:
      ``ANONYMOUS_CONTROL_LIMIT`` in all, so many hosts together cannot fill the reserve or
      the data plane's slots either.
    * Every slot, the data-plane cap's included, is given back when the call ends
      (``context.add_done_callback``), not when its handler returns: gRPC counts a call
      until its answer is sent.
    * Every call must deliver its message within ``message_timeout_s`` seconds.

    Args:
        cap: the data-plane cap; None counts nothing there.
        admit: ``await admit(context)`` aborts a data-plane call whose caller has no
            credentials (`kvmesh.services.auth.Gate.admit`); None admits everyone.
        message_timeout_s: seconds a call has to deliver its request message.
        trusted: ``trusted(context)``: whether the caller's control calls count in
            ``control`` (a cluster peer, or a caller on this machine: `local_peer`); None:
            every caller's do (a port without TLS, where no caller can be told apart).
    """

    def __init__(self, cap: RpcCap | None = None, admit: Callable[[object], Awaitable[None]] | None = None,
                 message_timeout_s: float = REQUEST_MESSAGE_TIMEOUT_S,
                 trusted: Callable[[object], bool] | None = None) -> None:
        self.cap = cap
        self.admit = admit
        self.message_timeout_s = float(message_timeout_s)
        self.trusted = trusted
        self.control = HostLimit(CONTROL_PER_HOST)
        self.anonymous_control = HostLimit(CONTROL_PER_HOST, ANONYMOUS_CONTROL_LIMIT)
        self.data_pending = HostLimit(DATA_PENDING_PER_HOST, DATA_PENDING_LIMIT)
        self.watches = HostLimit(WATCH_PER_HOST)
        self.refused = 0      # calls refused at their start (no slot)
        self.timed_out = 0    # calls whose message did not arrive in time


def _refuse_start(admission: CallAdmission, method: str, what: str, context) -> str:
    admission.refused += 1
    _limiter.warn("%s call from %s refused at its start: %s", method, context.peer(), what)
    return what


#: Seconds a data-plane call may wait for its message before it takes a `HostLimit` slot:
#: a client sends the message with the call's headers, so only slow senders ever need one
#: (a burst of calls from one client, a router's to its workers, needs none).
_PROMPT_MESSAGE_S = 0.05


async def _read_message(admission: CallAdmission, method: str, context, limit: HostLimit | None = None,
                        host: str = "", grace_s: float = 0.0) -> bytes:
    """The call's one request message (raw bytes); aborts the call when it does not arrive
    within ``admission.message_timeout_s`` or the call ends without one
    (INVALID_ARGUMENT). The request stream must end after it within the same time: a second
    message is refused INVALID_ARGUMENT (the method takes exactly one), a stream left open
    DEADLINE_EXCEEDED. A client's unary call sends its half-close with the message, so that
    check waits for nothing. With ``limit``,
    a call whose message has not come within ``grace_s`` seconds holds one of its slots for
    ``host`` while the message is awaited, and is refused RESOURCE_EXHAUSTED when none is
    free.

    Awaited in the handler's own task with ``context.read()``: a task per call, or a request
    iterator suspended at its first message, would keep the message alive in reference
    cycles until the garbage collector ran."""
    task = asyncio.current_task()
    state = {"held": False, "refused": False}

    def take() -> bool:
        if limit.enter(host):
            state["held"] = True
        else:
            state["refused"] = True
        return state["held"]

    def slow() -> None:  # the message did not come with the call
        if not take():
            task.cancel()

    def busy() -> str:
        return _refuse_start(admission, method, "too many calls from this host (or in all) are still sending "
                             "their request message; send it with the call and retry", context)

    handle = None
    if limit is not None:
        handle = asyncio.get_running_loop().call_later(grace_s, slow)
    refusal = None
    raw = None
    try:
        async with asyncio.timeout(admission.message_timeout_s):
            raw = await context.read()
            # then the end of the request stream: a client's unary call sends its half-close
            # with the message, so this read returns at once for it
            after = grpc.aio.EOF if raw is grpc.aio.EOF else await context.read()
        if raw is grpc.aio.EOF:
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, f"the {method} call ended without a request message")
        elif after is not grpc.aio.EOF:
            _limiter.warn("%s call from %s sent more than one request message", method, context.peer())
            refusal = (grpc.StatusCode.INVALID_ARGUMENT,
                       f"the {method} method takes exactly one request message; the call sent more than one")
        else:
            return raw
    except TimeoutError:
        admission.timed_out += 1
        t = admission.message_timeout_s
        if raw is None:
            _limiter.warn("%s call from %s sent no request message within %g s", method, context.peer(), t)
            refusal = (grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"the {method} request message did not arrive within {t:g} s of the call's start; "
                       "send it with the call")
        else:
            _limiter.warn("%s call from %s did not end its request stream within %g s", method, context.peer(), t)
            refusal = (grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"the {method} call did not end its request stream within {t:g} s of the call's start; "
                       "a unary method takes exactly one request message, sent with the half-close")
    except asyncio.CancelledError:
        if not state["refused"]:
            raise  # the call itself was cancelled
        task.uncancel()
        refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, busy())
    finally:
        if handle is not None:
            handle.cancel()
        if state["held"]:
            limit.leave(host)
    await context.abort(*refusal)


async def _hold(admission: CallAdmission, limit: HostLimit, host: str, method: str, context, why: str) -> None:
    """Take one of ``limit``'s slots for ``host`` until the call ends (its done callback), or
    abort the call RESOURCE_EXHAUSTED saying ``why``."""
    if not limit.enter(host):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _refuse_start(admission, method, why + "; retry later",
                                                                               context))
    context.add_done_callback(lambda _call: limit.leave(host))


def _client(admission: CallAdmission, context) -> tuple[str, bool]:
    """(the host per-host limits count the call's caller by, whether the caller is trusted):
    a verified peer (or a caller on this machine, `local_peer`) by its own address; any
    other caller, also every caller of a port without TLS where none can be told apart, by
    `host_network` (an IPv6 /64)."""
    host = peer_host(context.peer())
    if admission.trusted is None:
        return host_network(host), True
    if admission.trusted(context):
        return host, True
    return host_network(host), False


async def _hold_control(admission: CallAdmission, host: str, method: str, context, trusted: bool = True) -> None:
    """A control-plane call's slot of its client host, for the call's life (`_hold`); of
    ``anonymous_control`` when the caller is not ``trusted``."""
    per_host = f"this host has {CONTROL_PER_HOST} control calls open, the most one host may have"
    if trusted:
        await _hold(admission, admission.control, host, method, context, per_host)
        return
    limit = admission.anonymous_control
    await _hold(admission, limit, host, method, context,
                per_host if limit.by_host.get(host, 0) >= limit.per_host else
                f"{ANONYMOUS_CONTROL_LIMIT} control calls of callers without a peer certificate are open, the most "
                "this server takes")


async def _hold_stream(admission: CallAdmission, host: str, method: str, context) -> None:
    """A long-lived stream's slot of its client host (health Watch, reflection), for its life."""
    await _hold(admission, admission.watches, host, method, context,
                f"this host has {WATCH_PER_HOST} {method.rsplit('/', 1)[-1]} streams open, the most one host may "
                "have; close one")


def _guard_stream(method: str, handler: grpc.RpcMethodHandler, admission: CallAdmission) -> grpc.RpcMethodHandler:
    """A stream-request method (server reflection): each call holds a control slot and a
    stream slot of its client host for its whole life, as a health Watch does."""
    if not handler.response_streaming:
        return handler  # kvmesh serves no client-streaming unary method
    inner = handler.stream_stream

    async def stream_stream(request_iterator, context):
        host, trusted = _client(admission, context)
        await _hold_control(admission, host, method, context, trusted)
        await _hold_stream(admission, host, method, context)
        out = inner(request_iterator, context)
        if inspect.isasyncgen(out):
            async for msg in out:
                yield msg
        else:
            await out

    return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=handler.request_deserializer,
                                                 response_serializer=handler.response_serializer)


def _guard(method: str, handler: grpc.RpcMethodHandler, admission: CallAdmission | None = None,
           data_plane: bool = False) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    admission = admission or CallAdmission()
    if handler.request_streaming:
        return _guard_stream(method, handler, admission)
    if parse is None:
        return handler
    cap = admission.cap if data_plane else None
    streaming = handler.response_streaming

    async def refuse(exc: Exception, context) -> None:
        _limiter.warn("malformed %s request from %s: %s", method, context.peer(), _reason(exc))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request body is not a valid {method} message: {_reason(exc)}")

    async def receive(context):
        """Admit the call and read its message; returns the request. What the call holds is
        given back when it ends."""
        host, trusted = _client(admission, context)
        if data_plane:
            if admission.admit is not None:
                await admission.admit(context)
            if cap is not None:
                if not cap.enter():
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, cap.refusal())
                context.add_done_callback(lambda _call: cap.leave())
            # a verified peer (a router relaying a request it has read whole) is not held to the
            # per-host bound on calls awaiting their message: on a busy worker its messages can
            # miss the grace and it was refused as a slow sender while the queue had room
            verified = trusted and admission.trusted is not None
            raw = await _read_message(admission, method, context, None if verified else admission.data_pending,
                                      host, _PROMPT_MESSAGE_S)
        else:
            await _hold_control(admission, host, method, context, trusted)
            raw = await _read_message(admission, method, context)
            if streaming:
                await _hold_stream(admission, host, method, context)
        try:
            return parse(raw)
        except Exception as exc:  # DecodeError, or a UnicodeDecodeError on some protobuf builds
            await refuse(exc, context)

    if streaming:
        inner = handler.unary_stream

        async def stream_stream(request_iterator, context):
            out = inner(await receive(context), context)
            if inspect.isasyncgen(out):
                async for msg in out:
                    yield msg
            else:  # a coroutine that sends with context.write (the health service's Watch)
                await out

        return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=None,
                                                     response_serializer=handler.response_serializer)
    inner = handler.unary_unary

    async def stream_unary(request_iterator, context):
        return await inner(await receive(context), context)

    return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=None,
                                                response_serializer=handler.response_serializer)


class _Capture:
    """Stands in for the server while a generated ``add_*_to_server`` registers handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict]] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers also come through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services.append((service, handlers))


def add_guarded(add: Callable, servicer, server, admission: CallAdmission | None = None) -> None:
    """Register ``servicer`` on ``server`` as ``add(servicer, server)`` would, with request
    parsing failures answered INVALID_ARGUMENT (unary-request methods only; kvmesh has
    no client-streaming RPC) and each call admitted by ``admission`` (`CallAdmission`;
    None: one with no data-plane cap and no credentials check)."""
    capture = _Capture()
    add(servicer, capture)
    if not capture.services:  # generated by an older grpcio-tools: register unguarded
        add(servicer, server)
    admission = admission or CallAdmission()
    for service, handlers in capture.services:
        guarded = {name: _guard(f"{service}/{name}", h, admission, name in DATA_PLANE_METHODS)
                   for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)
