"""Hosting gRPC services the same way in every kvmesh process.

A `GrpcHost` binds one grpc.aio server with kvmesh's message and concurrency limits, the standard
health service (SERVING for "" and each named service), server reflection when asked
for (off by default: it lists every RPC to anyone), TLS when given a `TlsConfig`, and
waits for SIGINT/SIGTERM or an event before a graceful stop. The worker and the router
both use it.
"""
from __future__ import annotations

import asyncio
import signal
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvmesh.workers.grpc_guard import REQUEST_MESSAGE_TIMEOUT_S, CallAdmission, RpcCap, add_guarded

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


class ChannelPool:
    """One reusable grpc.aio channel per peer address, with kvmesh's message limits.

    ``factory(address)`` replaces the default channel (tests use it to inject faults);
    with ``tls`` (a `kvmesh.workers.tls.TlsConfig`) channels are mutual TLS to peers.
    """

    def __init__(self, factory: Callable[[str], grpc.aio.Channel] | None = None, tls=None):
        if factory is None and tls is not None:
            factory = lambda address: tls.peer_channel(address, CHANNEL_OPTIONS)  # noqa: E731
        self._factory = factory
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = (self._factory(address) if self._factory
                  else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
            self._channels[address] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class GrpcHost:
    """One aio server for ``services``: ``[(add_to_server_fn, servicer, full_service_name)]``.

    ``max_receive_bytes`` caps each request message (bytes; workers and routers pass what
    their largest valid request needs, `kvmesh.workers.limits`); responses may be up to
    ``MAX_MESSAGE_BYTES`` (FetchBlocks streams KV payloads). ``max_concurrent_rpcs``
    caps the data-plane RPCs in flight (`grpc_guard.RpcCap`); gRPC's own limit,
    ``max_concurrent_rpcs + CONTROL_RPC_RESERVE``, caps all RPCs, so health checks and
    control-plane RPCs still answer while the data plane is full. Memory held by requests
    is thus bounded by about ``(max_concurrent_rpcs + CONTROL_RPC_RESERVE) * max_receive_bytes``.
    Calls are admitted when they start, before their request message
    (`grpc_guard.CallAdmission`): ``admit`` (``await admit(context)``, e.g.
    `kvmesh.services.auth.Gate.admit`) refuses a data-plane call without credentials at
    once, and calls that never send their message cannot hold the reserve; each call has
    ``message_timeout_s`` seconds to deliver its message.

    Raises:
        ValueError: ``max_concurrent_rpcs`` < 1.
        RuntimeError: from `start`, when ``host:port`` cannot be bound.
    """

    def __init__(self, host: str, port: int, services: list[tuple[Callable, object, str]], tls=None,
                 reflection_on: bool = False, max_receive_bytes: int = 1024 * 1024,
                 max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS, admit=None,
                 message_timeout_s: float = REQUEST_MESSAGE_TIMEOUT_S):
        self.host = host
        self.port = port
        self.tls = tls
        # no SO_REUSEPORT: a second process on a busy port must fail, not share it silently.
        # Requests are capped at what the longest allowed prompt needs (workers.limits):
        # gRPC refuses a bigger body with RESOURCE_EXHAUSTED before reading it into memory.
        self.cap = RpcCap(max_concurrent_rpcs)
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", int(max_receive_bytes)),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=self.cap.limit + CONTROL_RPC_RESERVE)
        self.health = health_aio.HealthServicer()
        self.names = [name for _, _, name in services]
        # calls are admitted at their start, before their message (grpc_guard.CallAdmission):
        # a body that does not parse: INVALID_ARGUMENT; data-plane RPCs over the cap or without
        # credentials: RESOURCE_EXHAUSTED / UNAUTHENTICATED at once; no message in time: DEADLINE_EXCEEDED
        self.admission = CallAdmission(self.cap, admit, message_timeout_s)
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
        """Return when ``stop`` is set or SIGINT/SIGTERM arrives (main thread only)."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        await stop.wait()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Report NOT_SERVING, then stop, letting in-flight RPCs finish for ``grace_s`` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace_s)
