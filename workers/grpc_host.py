"""Hosting gRPC services the same way in every kvmesh process.

A `GrpcHost` binds one grpc.aio server with kvmesh's message and concurrency limits, the standard
health service (SERVING for "" and each named service), server reflection when asked
for (off by default: it lists every RPC to anyone), TLS when given a `TlsConfig`, and
waits for SIGINT/SIGTERM or an event before a graceful stop. The worker and the router
both use it.

Draining (`GrpcHost.drain`, the worker's shutdown): the data-plane calls a servicer runs
under the host's `DrainGate` are refused UNAVAILABLE once the drain begins, health turns
NOT_SERVING, control-plane calls keep answering, and the calls already running have until
a deadline to finish; those still running then (or at a second SIGINT/SIGTERM) are ended
UNAVAILABLE by the gate itself, so their callers get a status that says what happened and
the log gets one WARNING line, not a traceback per call.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvmesh.workers.grpc_guard import (
    ANONYMOUS_CONTROL_LIMIT, REQUEST_MESSAGE_TIMEOUT_S, CallAdmission, RpcCap, add_guarded, local_peer,
    open_file_share)
from kvmesh.workers.tls import caller_of

#: Largest message a channel accepts and a server sends (bytes): FetchBlocks streams KV
#: payloads. What a server accepts is set per server from what a valid request needs
#: (`kvmesh.workers.limits.request_bytes_limit`).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Default of ``--max-concurrent-rpcs``: data-plane RPCs (Generate, Tokenize, FetchBlocks)
#: one server runs at once; more get RESOURCE_EXHAUSTED. A worker queues at most
#: ``--max-seqs`` + ``--max-waiting`` (544 by default) requests anyway.
DEFAULT_MAX_CONCURRENT_RPCS = 1024
#: RPCs gRPC admits beyond ``--max-concurrent-rpcs``, for health checks and the other
#: control-plane RPCs while the data plane is full; past that gRPC itself answers
#: RESOURCE_EXHAUSTED before reading the request.
CONTROL_RPC_RESERVE = 64
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
#: Keepalive of a router's channels to its workers: while a call is open, an HTTP/2 PING
#: every ``KEEPALIVE_TIME_S`` seconds, and the connection is closed when one is not
#: acknowledged within ``KEEPALIVE_TIMEOUT_S`` (gRPC core's keepalive, doc/keepalive.md of
#: grpc/grpc). A worker that is frozen (SIGSTOP, a hung node) or cut off by the network
#: thus fails the calls open to it with UNAVAILABLE within about 10 s, and the router retries
#: one that has streamed nothing on another worker, instead of each call waiting for its
#: deadline (600 s for the HTTP front's default). PINGs are answered by gRPC's own threads,
#: so a worker busy in a long prefill acknowledges them; they are sent without data frames
#: too (a queued request or a long prefill streams nothing). Only towards a worker whose
#: lease states that its server accepts them (`KEEPALIVE_LEASE_FIELD`): a server with gRPC's
#: default policy (kvmesh before it) takes a PING more often than every 5 minutes on a
#: silent call as abuse and closes the connection (GOAWAY "too_many_pings") after 3.
KEEPALIVE_TIME_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0
KEEPALIVE_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    # gRPC core waits this long for any PING's acknowledgement (its default: 60 s), whatever
    # the keepalive timeout says
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
#: Seconds between keepalive PINGs a server accepts without data frames: 4 (below
#: `KEEPALIVE_TIME_S`, so routers' channels are never told "too many pings"; gRPC's default
#: is 5 minutes). A caller that pings faster is sent GOAWAY after gRPC's default of 2
#: strikes. A worker states it in its lease (`KEEPALIVE_LEASE_FIELD`).
SERVER_MIN_PING_INTERVAL_S = 4.0
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", int(SERVER_MIN_PING_INTERVAL_S * 1000)),
]
#: Seconds a new connection has to finish its TLS (or plaintext HTTP/2) handshake before the
#: server closes it (gRPC core's default: 120 s, so a stranger who opens TCP connections and
#: never speaks held each descriptor for two minutes).
SERVER_HANDSHAKE_TIMEOUT_S = 10.0
#: Most connections a server keeps open at once (gRPC core's ``max_allowed_incoming_connections``;
#: lowered to a quarter of the process's open-file limit when that is smaller, see
#: `max_incoming_connections`). Past it new connections are closed at accept: the process
#: keeps the descriptors its Redis, disk-tier and outgoing connections need. Limits per
#: client address belong in front of the port (a NetworkPolicy, a load balancer).
DEFAULT_MAX_INCOMING_CONNECTIONS = 4096


def pending_call_options(rpc_limit: int) -> list[tuple[str, int]]:
    """Server options that let a burst of calls reach kvmesh's own limits.

    gRPC core queues each new call until the Python server asks for it; past
    ``grpc.server.max_pending_requests`` queued calls (default 1000) it drops new ones at
    random, and the caller sees a bare CANCELLED, which reads as its own cancellation and
    is never retried. Bursts of 1,200-2,000 calls at once lost 1-18 % of them that way,
    whatever ``maximum_concurrent_rpcs`` was. Queued calls hold no more than their stream's
    flow-control window; with room for 10,000 of them (or 4 x ``rpc_limit``; hard limit
    twice that) a burst reaches ``maximum_concurrent_rpcs`` and the admission checks, which
    answer RESOURCE_EXHAUSTED, or is served."""
    soft = max(10_000, 4 * int(rpc_limit))
    return [("grpc.server.max_pending_requests", soft), ("grpc.server.max_pending_requests_hard_limit", 2 * soft)]


def max_incoming_connections() -> int:
    """`DEFAULT_MAX_INCOMING_CONNECTIONS`, or a quarter of this process's open-file limit
    when that is lower (at least 16; `grpc_guard.open_file_share`)."""
    return open_file_share(DEFAULT_MAX_INCOMING_CONNECTIONS, 16)


#: Lease field of a worker whose server accepts keepalive PINGs that often (seconds).
KEEPALIVE_LEASE_FIELD = "keepalive_min_ping_s"


def accepts_keepalive(lease: dict) -> bool:
    """Whether a router may send `KEEPALIVE_CHANNEL_OPTIONS`' PINGs to the worker of
    ``lease``: its lease states a minimum PING interval no longer than `KEEPALIVE_TIME_S`."""
    value = lease.get(KEEPALIVE_LEASE_FIELD)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= KEEPALIVE_TIME_S
#: Default of the worker's ``--drain-timeout-s`` (seconds): how long requests running at
#: SIGTERM may take to finish. With Kubernetes' preStop sleep (5 s) and the stop steps after
#: the drain it fits the worker's terminationGracePeriodSeconds (45 s, k8s/base/worker.yaml).
DEFAULT_DRAIN_TIMEOUT_S = 30.0
#: Seconds the calls ended at the drain deadline have to wind down (their engine requests
#: aborted, their status sent) before the server stops regardless.
CUT_WAIT_S = 5.0
#: Grace (seconds) of the server stop that follows a drain: by then only control-plane calls
#: (health checks, GetLoad) can still be open.
STOP_AFTER_DRAIN_GRACE_S = 1.0

log = logging.getLogger(__name__)


class ChannelPool:
    """One reusable grpc.aio channel per peer address, with kvmesh's message limits.

    ``factory(address)`` replaces the default channel (tests use it to inject faults);
    with ``tls`` (a `kvmesh.workers.tls.TlsConfig`) channels are mutual TLS to peers.
    ``get(address, keepalive=True)`` gives a channel that sends keepalive PINGs
    (`KEEPALIVE_CHANNEL_OPTIONS`), kept apart from the one without.
    """

    def __init__(self, factory: Callable[[str], grpc.aio.Channel] | None = None, tls=None):
        self._factory = factory
        self._tls = tls
        self._channels: dict[tuple[str, bool], grpc.aio.Channel] = {}

    def get(self, address: str, keepalive: bool = False) -> grpc.aio.Channel:
        ch = self._channels.get((address, keepalive))
        if ch is None:
            options = KEEPALIVE_CHANNEL_OPTIONS if keepalive else CHANNEL_OPTIONS
            if self._factory is not None:
                ch = self._factory(address)
            elif self._tls is not None:
                ch = self._tls.peer_channel(address, options)
            else:
                ch = grpc.aio.insecure_channel(address, options=options)
            self._channels[(address, keepalive)] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class DrainCall:
    """One data-plane call running under a `DrainGate` (what ``DrainGate.call`` yields).

    Attributes:
        task: the asyncio task running the call.
        cut: set once the gate ended the call (drain deadline or a second signal).
        on_cut: None (default): the gate ends the call by cancelling ``task``, and the
            gate's context manager answers UNAVAILABLE in its place. A call that can stop
            at a point of its own choosing sets a callable instead (no arguments, run on the
            event loop, must not block); the gate then only sets ``cut`` and calls it, and
            the call answers with `DrainGate.cut_message` itself (``Generate`` wakes its
            token loop so; ``FetchBlocks`` checks ``cut`` between batches).
    """

    __slots__ = ("task", "cut", "on_cut", "cancelled")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.cut = False
        self.on_cut: Callable[[], None] | None = None
        self.cancelled = False  # the gate cancelled ``task`` (its cut, not the caller's)


class DrainGate:
    """The data-plane calls of one server, so that it can drain before it stops.

    A servicer runs each data-plane call (a worker's Generate, Tokenize, FetchBlocks) inside
    ``async with gate.call(context)``. Before `begin` the gate only counts the calls; after
    it, a new call is aborted UNAVAILABLE with `refusal` (a router retries UNAVAILABLE on
    another worker). `cut` ends the calls still running: each is aborted UNAVAILABLE with
    `cut_message`, by its own task, so gRPC sends that status rather than cancelling the
    call at the server's stop. Single-threaded: the server's event loop.

    Args:
        name: what the server is called in messages, e.g. ``"worker w0"``.
    """

    def __init__(self, name: str = "this server") -> None:
        self.name = name
        #: True once `begin` ran: new calls are refused
        self.draining = False
        #: calls refused because the server was draining
        self.refused = 0
        self._calls: set[DrainCall] = set()
        self._changed: asyncio.Event | None = None

    @property
    def active(self) -> int:
        """Data-plane calls running now."""
        return len(self._calls)

    def refusal(self) -> str:
        """Details of the UNAVAILABLE status a call gets during the drain."""
        return f"{self.name} is shutting down and takes no new requests; retry on another worker"

    def cut_message(self) -> str:
        """Details of the UNAVAILABLE status a call gets when the drain ends before it does."""
        return f"{self.name} stopped before the request finished; retry"

    def begin(self) -> None:
        """Refuse every data-plane call from now on (idempotent)."""
        self.draining = True

    @contextlib.asynccontextmanager
    async def call(self, context):
        """Run one data-plane call under the gate; yields its `DrainCall`.

        Raises (through ``context.abort``): UNAVAILABLE with `refusal` when the gate is
        draining; UNAVAILABLE with `cut_message` when `cut` cancelled the call's task.
        """
        if self.draining:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal())
        call = DrainCall(asyncio.current_task())
        self._calls.add(call)
        try:
            yield call
        except asyncio.CancelledError:
            if not call.cancelled:
                raise  # the caller went away, or the task was cancelled by someone else
            call.task.uncancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.cut_message())
        finally:
            self._calls.discard(call)
            if self._changed is not None:
                self._changed.set()

    def cut(self, force: bool = False) -> int:
        """End every call still running; returns how many it acted on.

        Each call not cut yet is ended its own way (`DrainCall.on_cut`). With ``force``,
        the task of every call still running is cancelled instead, whatever its ``on_cut``
        (for calls that did not end after a first cut); the gate still answers them
        UNAVAILABLE with `cut_message` when the cancellation reaches them inside the gate.
        """
        n = 0
        for call in list(self._calls):
            if force:
                if call.task is None or call.cancelled:
                    continue
                call.cut = call.cancelled = True
                call.task.cancel()
            elif call.cut:
                continue
            else:
                call.cut = True
                if call.on_cut is not None:
                    call.on_cut()
                elif call.task is not None:
                    call.cancelled = True
                    call.task.cancel()
            n += 1
        return n

    async def wait_idle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """Wait until no call runs (True), ``timeout_s`` seconds pass or ``hurry`` is set
        (False, as soon as either happens)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while self._calls:
            left = deadline - loop.time()
            if left <= 0 or (hurry is not None and hurry.is_set()):
                return False
            self._changed = asyncio.Event()
            waits = [asyncio.ensure_future(self._changed.wait())]
            if hurry is not None:
                waits.append(asyncio.ensure_future(hurry.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return True


class _CancelledAtStop(logging.Filter):
    """Drops grpc.aio's ERROR traceback for a call cancelled by the server's stop (a
    ``CancelledError`` "not handled by _handle_exceptions") and counts them: the drain
    reports them in one line instead."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            self.dropped += 1
            return False
        return True


class GrpcHost:
    """One aio server for ``services``: ``[(add_to_server_fn, servicer, full_service_name)]``.

    ``max_receive_bytes`` caps each request message (bytes; workers and routers pass what
    their largest valid request needs, `kvmesh.workers.limits`); responses may be up to
    ``MAX_MESSAGE_BYTES`` (FetchBlocks streams KV payloads). ``max_concurrent_rpcs``
    caps the data-plane RPCs in flight (`grpc_guard.RpcCap`); gRPC's own limit,
    ``max_concurrent_rpcs + CONTROL_RPC_RESERVE`` (plus, with ``tls``,
    `grpc_guard.ANONYMOUS_CONTROL_LIMIT` for the control calls of callers without a peer
    certificate, which count there and nowhere else), caps all RPCs, so health checks and
    control-plane RPCs still answer while the data plane is full. Memory held by requests
    is thus bounded by about that limit times ``max_receive_bytes``.
    Calls are admitted when they start, before their request message
    (`grpc_guard.CallAdmission`): ``admit`` (``await admit(context)``, e.g.
    `kvmesh.services.auth.Gate.admit`) refuses a data-plane call without credentials at
    once, and calls that never send their message cannot hold the reserve; each call has
    ``message_timeout_s`` seconds to deliver its message. ``drain`` is the `DrainGate` its
    servicers run their data-plane calls under (default: a new one, named ``name``), which
    `drain` uses. A connection has ``handshake_timeout_s`` seconds (default
    `SERVER_HANDSHAKE_TIMEOUT_S`) to finish its handshake, and at most ``max_connections``
    (default `max_incoming_connections`) are open at once.

    Raises:
        ValueError: ``max_concurrent_rpcs`` < 1.
        RuntimeError: from `start`, when ``host:port`` cannot be bound.
    """

    def __init__(self, host: str, port: int, services: list[tuple[Callable, object, str]], tls=None,
                 reflection_on: bool = False, max_receive_bytes: int = 1024 * 1024,
                 max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS, admit=None,
                 message_timeout_s: float = REQUEST_MESSAGE_TIMEOUT_S, drain: DrainGate | None = None,
                 name: str = "this server", handshake_timeout_s: float = SERVER_HANDSHAKE_TIMEOUT_S,
                 max_connections: int | None = None):
        self.host = host
        self.port = port
        self.tls = tls
        self.name = name
        self.drain_gate = drain if drain is not None else DrainGate(name)
        #: set by a SIGINT/SIGTERM that arrives once the stop event is set: drain no longer
        self.hurry = asyncio.Event()
        # no SO_REUSEPORT: a second process on a busy port must fail, not share it silently.
        # Requests are capped at what the longest allowed prompt needs (workers.limits):
        # gRPC refuses a bigger body with RESOURCE_EXHAUSTED before reading it into memory.
        self.cap = RpcCap(max_concurrent_rpcs)
        rpc_limit = self.cap.limit + CONTROL_RPC_RESERVE + (ANONYMOUS_CONTROL_LIMIT if tls else 0)
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", int(max_receive_bytes)),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0), *SERVER_KEEPALIVE_OPTIONS,
            ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
            ("grpc.max_allowed_incoming_connections",
             int(max_connections if max_connections is not None else max_incoming_connections())),
            *pending_call_options(rpc_limit)],
            # callers without a peer certificate have control slots of their own (CallAdmission)
            maximum_concurrent_rpcs=rpc_limit)
        self.health = health_aio.HealthServicer()
        self.names = [name for _, _, name in services]
        # calls are admitted at their start, before their message (grpc_guard.CallAdmission):
        # a body that does not parse: INVALID_ARGUMENT; data-plane RPCs over the cap or without
        # credentials: RESOURCE_EXHAUSTED / UNAUTHENTICATED at once; no message in time: DEADLINE_EXCEEDED
        self.admission = CallAdmission(
            self.cap, admit, message_timeout_s,
            trusted=(lambda ctx: local_peer(ctx.peer()) or caller_of(ctx, tls).is_peer) if tls else None)
        for add, servicer, _ in services:
            add_guarded(add, servicer, self.server, self.admission)
        add_guarded(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server, self.admission)
        if reflection_on:  # its streams are bounded like health Watch streams (CallAdmission)
            names = (*self.names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
            add_guarded(reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
                        reflection.aio.ReflectionServicer(names), self.server, self.admission)

    async def start(self) -> int:
        """Bind, start and report SERVING; returns the bound port."""
        try:
            addr = f"{self.host}:{self.port}"
            bound = (self.server.add_secure_port(addr, self.tls.server_credentials()) if self.tls is not None
                     else self.server.add_insecure_port(addr))
        except RuntimeError:  # grpcio >= 1.5x raises instead of returning 0
            bound = 0
        if bound == 0:
            raise RuntimeError(f"could not bind {self.host}:{self.port}: is another process using it?")
        await self.server.start()
        for name in ("", *self.names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return bound

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Return when ``stop`` is set or SIGINT/SIGTERM arrives (main thread only).

        The handlers stay installed: a signal that arrives once ``stop`` is set (during a
        `drain`) sets ``hurry``, which ends the drain at once."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if not stop.is_set():
                stop.set()
                return
            if self.drain_gate.draining and not self.hurry.is_set():
                log.warning("%s: %s while draining: stopping now, without waiting for running requests",
                            self.name, signal.Signals(signum).name)
            self.hurry.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await stop.wait()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Report NOT_SERVING, then stop, letting in-flight RPCs finish for ``grace_s`` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace_s)

    async def drain(self, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        """Drain, then stop the server.

        At once: new data-plane calls under the `DrainGate` are refused UNAVAILABLE and
        health reports NOT_SERVING for every service; control-plane calls (GetLoad,
        GetInfo, health) keep answering. Then the running data-plane calls have up to
        ``timeout_s`` seconds (>= 0) to finish; a SIGINT/SIGTERM meanwhile (``hurry``) cuts
        the wait short. Calls still running are ended UNAVAILABLE (`DrainGate.cut`, one
        WARNING line with their count) and get `CUT_WAIT_S` seconds to wind down (a call
        still running then has its task cancelled, another WARNING line); then the server
        stops with `STOP_AFTER_DRAIN_GRACE_S` seconds of grace, for the control-plane calls
        still open. grpc.aio's ERROR traceback for a call cancelled by that stop is replaced
        by a WARNING line with the count. Never raises for the calls it ends.
        """
        gate = self.drain_gate
        gate.begin()
        await self.health.enter_graceful_shutdown()
        running = gate.active
        if running:
            log.warning("%s draining: %d request(s) in flight, waiting up to %g s for them to finish "
                        "(SIGINT/SIGTERM again stops at once)", self.name, running, timeout_s)
        else:
            log.info("%s draining: no request in flight", self.name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        if await gate.wait_idle(timeout_s, self.hurry):
            if running:
                log.info("%s drained in %.1f s", self.name, loop.time() - started)
        else:
            cut = gate.cut()
            why = "on a second signal" if self.hurry.is_set() else f"at the drain deadline ({timeout_s:g} s)"
            log.warning("%s: %d request(s) still running %s were ended with UNAVAILABLE "
                        "(the callers are told to retry)", self.name, cut, why)
            if not await gate.wait_idle(CUT_WAIT_S):
                stuck = gate.cut(force=True)
                log.warning("%s: %d request(s) had not ended %g s after the cut; their tasks were cancelled",
                            self.name, stuck, CUT_WAIT_S)
                await gate.wait_idle(CUT_WAIT_S)
        quiet = _CancelledAtStop()
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        grpc_log.addFilter(quiet)
        try:
            await self.server.stop(grace=STOP_AFTER_DRAIN_GRACE_S)
            await asyncio.sleep(0)  # the cancelled calls' tasks finish (and would log) now
        finally:
            grpc_log.removeFilter(quiet)
        if quiet.dropped:
            log.warning("%s: %d call(s) still open when the server stopped were cancelled", self.name,
                        quiet.dropped)
