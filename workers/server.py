"""gRPC front of one worker: kvmesh.v1.Worker, standard health checking and reflection.

The servicer only translates: it validates and converts the request, submits it to the
`Engine` (which runs on its own thread), and relays the engine's outputs from that
thread into the RPC's asyncio queue. Engine errors map once to gRPC status codes:
`InvalidRequest` -> INVALID_ARGUMENT, `Overloaded` -> RESOURCE_EXHAUSTED.

Peer fetch: a request whose ``prefix_location`` names another worker first goes through
`workers.peer_fetch.PeerFetcher` (bounded by its own deadline), then is submitted; the
fetched blocks wait in the engine's staging area. With a disk or remote tier,
`Engine.prefetch` (on a thread, before submitting) stages what only the disk or the
cluster's Redis holds of the prompt the same way. ``FetchBlocks`` serves the other side:
the leading run of the asked-for chain this worker holds, streamed in batches of
``FETCH_BATCH`` blocks so that memory stays bounded and the engine lock is held briefly.

Shutdown (`serve_worker`): on SIGTERM or SIGINT the worker drains. It withdraws its lease
(``on_drain``), so routers stop choosing it; Generate, Tokenize and FetchBlocks calls that
arrive from then on are refused UNAVAILABLE (a router retries them on another worker),
health reports NOT_SERVING, and GetLoad, GetInfo and metrics keep answering. Requests
already running finish normally, for up to ``drain_timeout_s`` seconds (``--drain-timeout-s``);
those still running then, or at a second SIGTERM/SIGINT, end UNAVAILABLE ("stopped before
the request finished; retry"). Then the server, the side servers and the engine stop (the
engine's tier flush included).

Access (``gate``, a `kvmesh.services.auth.Gate` built by the CLI): FetchBlocks,
GetSnapshot, ClearCache and GetLoad, and the request fields ``prefix_location`` and
``tenant``, are for cluster peers only (PERMISSION_DENIED otherwise); GetInfo and Tokenize
need a peer or credentials a Generate would accept (UNAUTHENTICATED otherwise); anyone
else's tenant comes from their credentials. Without a gate (no TLS) every caller is
trusted, as on a private network.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.workers import limits, wire
from kvmesh.cache_store.block_record import RECORD_FORMAT_VERSION
from kvmesh.cache_store.fresh_thread import run_on_fresh_thread, to_fresh_thread
from kvmesh.cache_store.hashing import HASH_BYTES
from kvmesh.cache_store.remote_gc import DEFAULT_GRACE_S, RemoteGC
from kvmesh.workers.engine import Engine
from kvmesh.workers.grpc_guard import LogLimiter, TenantCap, clip
from kvmesh.workers.grpc_host import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_CONCURRENT_RPCS, DrainGate, GrpcHost
from kvmesh.workers.peer_fetch import MAX_FETCH_BLOCKS, PeerFetcher
from kvmesh.workers.request import InvalidRequest, Overloaded, RequestOutput

log = logging.getLogger(__name__)



#: Blocks exported per engine-lock acquisition when serving FetchBlocks.
FETCH_BATCH = 32
#: Put in a Generate call's output queue when the drain ends the call (`DrainGate.cut`).
_CUT = object()


class _IncrementalText:
    """Streamed text of a growing token sequence.

    Decoding each message's tokens alone splits multi-byte UTF-8 characters and drops
    the spaces that SentencePiece-style tokenizers attach to the next token. This decodes
    the whole completion so far and emits what it adds, holding back a trailing U+FFFD
    (an incomplete character) until the next tokens complete it, as vLLM's incremental
    detokenizer does. Cost O(completion length) per message.
    """

    __slots__ = ("tokenizer", "ids", "sent")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        # a decoder that revised earlier text cannot take it back: emit only what is new
        piece = text[len(self.sent):]
        self.sent = text
        return piece


class WorkerServicer(pb_grpc.WorkerServicer):
    """Implements kvmesh.v1.Worker over an `Engine`.

    Args:
        engine: the engine.
        worker_id: this worker's id.
        address: this worker's host:port.
        peer: options of `PeerFetcher` (``mode``, ``max_fetch_s``); None uses the defaults.

    Generate, Tokenize and FetchBlocks run under ``drain`` (a `grpc_host.DrainGate`), which
    refuses them while the worker shuts down.
    """

    def __init__(self, engine: Engine, worker_id: str, address: str = "", peer: dict | None = None,
                 gate=None):
        self.engine = engine
        self.worker_id = worker_id
        self.address = address
        self.gate = gate
        self.fetcher = PeerFetcher(engine, **(peer or {}))
        # requests for another model: a caller's error, so WARNING lines, rate-limited
        self._foreign_model_log = LogLimiter(log, "requests for another model")
        # prefetches wait on the disk and on Redis: their own threads, so that a slow Redis
        # never holds up the threads GetLoad, GetSnapshot and FetchBlocks run on
        self._prefetch_pool = ThreadPoolExecutor(4, thread_name_prefix="kvmesh-prefetch")
        #: `services.metrics.WorkerMetrics` when metrics are served, else None
        self.metrics = None
        #: per-tenant bound on Generate calls in flight (`--max-inflight-per-tenant`; 0: none)
        self.tenant_cap = TenantCap(0)
        #: the data-plane calls, refused and ended when the worker drains (`serve_worker`)
        self.drain = DrainGate(f"worker {worker_id}")

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        limits.check_prompt_size(request, self.engine.max_model_len, *self.engine.context_owner)  # before tokenizing anything
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            return self.engine.tokenizer.encode(request.text)
        raise InvalidRequest("request has no prompt: set text or token_ids")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        async with self.drain.call(context) as call:
            caller, tenant, salt = (await self.gate.identity(context, request) if self.gate is not None
                                    else wire.forwarded_identity(request))
            # aclosing at each layer: a caller that stops reading (a cancelled stream, the HTTP
            # front's aclose) runs _generate's own clean-up now (engine abort, in-flight counts)
            async with contextlib.aclosing(self.tenant_cap.stream(caller, context, self._generate(
                    request, context, tenant, salt, caller, call))) as out:
                async for msg in out:
                    yield msg

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, tenant: str,
                        salt: str, caller: str = "", call=None):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # RequestOutputs, or _CUT when the drain ends the call

        def on_output(out: RequestOutput) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        if call is not None:  # the drain's deadline: the token loop answers UNAVAILABLE at its next message
            call.on_cut = functools.partial(queue.put_nowait, _CUT)

        rid = request.request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        if request.model_id and request.model_id != self.engine.kv_model_id:
            await self._refuse_foreign_model(request.model_id, context)
        try:
            if request.adapter_id:  # serving the base model for it would answer another question
                limits.check_adapter_id(request.adapter_id)  # over its cap: INVALID_ARGUMENT first
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"adapter_id {clip(request.adapter_id, 80)!r} is not served: worker "
                                    f"{self.worker_id} runs the base model only (no LoRA adapters are loaded); "
                                    f"leave adapter_id empty")
            prompt_ids = self._prompt_ids(request)
            sampling = wire.sampling_from_proto(request)
            if request.sampling.max_tokens_up_to_context:  # the rest of this worker's context at most
                room = self.engine.max_model_len - len(prompt_ids)
                wanted = sampling.max_tokens or room  # 0 (unset): the whole rest
                sampling = dataclasses.replace(sampling, max_tokens=max(1, min(wanted, room)))
            if request.HasField("prefix_location"):
                await self._fetch_prefix(request, prompt_ids, sampling, context, tenant, salt)
            if self.engine.tiers is not None and self.engine.tiers.can_prefetch:
                self.engine.validate([int(t) for t in prompt_ids], sampling)  # no read for a bad request
                # the pool bounds concurrent prefetches; each runs its torch copies on a
                # short-lived thread (`cache_store.fresh_thread`)
                await loop.run_in_executor(self._prefetch_pool, functools.partial(
                    run_on_fresh_thread, self.engine.prefetch, prompt_ids, salt, request.adapter_id, tenant,
                    name="kvmesh-prefetch"))
            # the engine keys requests by its own unique id: two clients reusing one
            # request_id never cancel each other
            remaining = context.time_remaining()  # seconds; None: the caller set no deadline
            engine_rid = self.engine.submit(prompt_ids, sampling, on_output,
                                            cache_salt=salt, adapter_id=request.adapter_id,
                                            request_id=rid, arrival=arrival, tenant=tenant, caller=caller,
                                            deadline=None if remaining is None else time.monotonic() + remaining)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finished = False
        detok = _IncrementalText(self.engine.tokenizer) if request.return_text else None
        token_times: list[float] = []
        generated = 0  # tokens streamed so far: a cancelled request's work still counts
        try:
            while not finished:
                out = await queue.get()
                if out is _CUT:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, self.drain.cut_message())
                if out.new_token_ids:
                    token_times.append(time.monotonic())
                    generated += len(out.new_token_ids)
                if out.finished and self.metrics is not None:
                    reason = out.finish_reason
                    if out.error:
                        reason = "shed" if out.error_code == "DEADLINE_EXCEEDED" else "error"
                    self.metrics.observe_finished(out.usage, out.timing, reason, token_times)
                if out.error:
                    finished = True
                    await context.abort(wire.STATUS_CODES.get(out.error_code, grpc.StatusCode.INTERNAL),
                                        out.error)
                msg = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids,
                                          finished=out.finished, worker_id=self.worker_id)
                if detok is not None:
                    msg.text = detok.add(out.new_token_ids, final=out.finished)
                if out.finished:
                    finished = True
                    msg.finish_reason = out.finish_reason
                    msg.usage.CopyFrom(wire.usage_to_proto(out.usage))
                    msg.timing.CopyFrom(wire.timing_to_proto(out.timing))
                yield msg
        finally:
            if not finished:  # client cancelled or deadline passed
                self.engine.abort(engine_rid)
                if self.metrics is not None:
                    self.metrics.observe_cancelled(len(prompt_ids), generated)

    async def _refuse_foreign_model(self, model_id: str, context) -> None:
        """FAILED_PRECONDITION for a request tokenized and hashed for another model.

        The id comes from the caller: a client that set ``model_id`` itself, or a router whose
        view of this worker is stale (a router of another model routes around this worker and
        logs that as an ERROR itself). Either way it is the caller's error, not this worker's
        configuration, so it is logged as a WARNING, at most `grpc_guard.LOG_BURST` lines per
        `grpc_guard.LOG_WINDOW_S` seconds (`grpc_guard.LogLimiter`)."""
        mine = self.engine.kv_model_id
        wanted = clip(model_id)  # the id is input: bounded
        self._foreign_model_log.warn("refused a request for model %r from %s: this worker serves %r",
                                     wanted, context.peer(), mine)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"request is for model {wanted!r} but worker {self.worker_id} serves {mine!r}: "
                            f"send model_id {mine!r} or leave it empty (a router and its workers need the same "
                            f"--model)")

    async def _fetch_prefix(self, request: pb.GenerateRequest, prompt_ids: list[int], sampling, context,
                            tenant: str = "", salt: str = "") -> None:
        """Pull the prompt's prefix from the worker named in ``prefix_location`` (if worth it).

        Raises:
            InvalidRequest, Overloaded: the request would be refused anyway (checked first,
                so a bad request never triggers a fetch).
        """
        loc = request.prefix_location
        if not loc.address or loc.worker_id == self.worker_id or loc.address == self.address or not loc.num_blocks:
            return
        self.engine.validate([int(t) for t in prompt_ids], sampling)
        ns = self.engine.namespace(salt, request.adapter_id, tenant)
        res = await self.fetcher.fetch_prefix(prompt_ids, ns, loc.address, loc.num_blocks, context.time_remaining(),
                                              holder_id=loc.worker_id)
        if self.metrics is not None:
            self.metrics.observe_fetch(res)

    async def FetchBlocks(self, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext):
        async with self.drain.call(context) as call:
            call.on_cut = _no_op  # checked between batches: a batch being exported finishes first
            async for msg in self._fetch_blocks(request, context, call):
                yield msg

    async def _fetch_blocks(self, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext, call):
        if self.gate is not None:
            await self.gate.require_peer(context, "FetchBlocks")
        hashes = list(request.block_hashes)
        if len(hashes) > MAX_FETCH_BLOCKS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"asked for {len(hashes)} blocks; at most {MAX_FETCH_BLOCKS} per call")
        bad = next((i for i, h in enumerate(hashes) if len(h) != HASH_BYTES), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes[{bad}] has {len(hashes[bad])} bytes; hashes are {HASH_BYTES} bytes")
        if request.kv_producer and request.kv_producer != self.engine.kv_producer:
            # same model and dtypes, other kernels: its own cold run would not give these bits
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this worker's KV is computed by {self.engine.kv_producer!r}, not "
                                f"{clip(request.kv_producer, 200)!r}: blocks are exchanged between equal producers "
                                "only; recompute the prefix")
        for start in range(0, len(hashes), FETCH_BATCH):
            if call.cut:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.drain.cut_message())
            batch = hashes[start:start + FETCH_BATCH]
            records = await to_fresh_thread(self.engine.export_blocks, batch,
                                            hashes[start - 1] if start else None, start > 0, name="kvmesh-export")
            for meta, payload in records:
                yield pb.BlockData(block_hash=meta.block_hash, parent_block_hash=meta.parent_hash,
                                   token_ids=meta.token_bytes, codec=meta.codec, dtype=meta.dtype,
                                   shape=list(meta.shape), checksum=meta.payload_checksum, payload=payload,
                                   format_version=RECORD_FORMAT_VERSION)
            if len(records) < len(batch):
                return

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        async with self.drain.call(context):
            if self.gate is not None:
                await self.gate.require_caller(context, "Tokenize")
            try:
                where, why = self.engine.context_owner
                limits.check_text_size(request.text, self.engine.max_model_len, where, "text", why)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return pb.TokenizeResponse(ids=self.engine.tokenizer.encode(request.text))

    async def GetInfo(self, request, context):
        if self.gate is not None:
            await self.gate.require_caller(context, "GetInfo")
        e = self.engine
        return pb.WorkerInfo(worker_id=self.worker_id, model_id=e.kv_model_id, block_size=e.block_size,
                             num_blocks=e.num_blocks, vocab_size=e.config.vocab_size,
                             max_model_len=e.max_model_len, device=str(e.device))

    # Control plane: the engine publishes its load each step; reading it never waits on one.
    # Loads and pool sizes are for the cluster's own components, as the router's Status
    # shows them to peers only.
    async def GetLoad(self, request, context):
        if self.gate is not None:
            await self.gate.require_peer(context, "GetLoad")
        return wire.load_to_proto(self.engine.load())

    # The engine lock is held for a whole model step: these run on a thread so the event
    # loop keeps streaming tokens meanwhile.

    async def GetSnapshot(self, request, context):
        if self.gate is not None:
            await self.gate.require_peer(context, "GetSnapshot")
        snap = await asyncio.to_thread(self.engine.snapshot)
        return pb.Snapshot(
            worker_id=self.worker_id, seq=snap["seq"], block_size=self.engine.block_size,
            blocks=[pb.CachedBlock(block_hash=h, parent_block_hash=p or b"", medium=m)
                    for h, p, m in snap["blocks"]],
        )

    async def ClearCache(self, request, context):
        if self.gate is not None:
            await self.gate.require_peer(context, "ClearCache")
        return pb.ClearCacheResponse(blocks_cleared=await asyncio.to_thread(self.engine.clear_cache))


def _no_op() -> None:
    pass


async def serve_worker(engine: Engine, port: int, host: str = "127.0.0.1", worker_id: str | None = None,
                       ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                       peer: dict | None = None, advertise: str | None = None,
                       metrics_port: int | None = None, http_port: int | None = None, tls=None, gate=None,
                       metrics_token: str | None = None,
                       reflection: bool = False, max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
                       max_inflight_per_tenant: int = 0, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                       on_drain: Callable[[], None] | None = None,
                       remote_gc_grace_s: float = DEFAULT_GRACE_S) -> None:
    """Serve the engine on host:port until ``stop`` is set or SIGINT/SIGTERM arrives, then drain.

    ``peer`` holds `PeerFetcher` options (``mode``, ``max_fetch_s``, ``holder_check``);
    ``advertise`` is the ``HOST:PORT`` other processes reach this worker at (default
    ``host:port``); ``tls`` (`kvmesh.workers.tls.TlsConfig`) serves TLS and makes peer
    fetches mutual TLS; ``gate`` checks each caller (see `WorkerServicer`); ``reflection``
    turns on gRPC server reflection; ``max_concurrent_rpcs`` caps the data-plane RPCs in
    flight (`GrpcHost`), ``max_inflight_per_tenant`` each tenant's Generate calls
    (`grpc_guard.TenantCap`; 0: no cap). ``metrics_port`` serves Prometheus ``/metrics``
    (`services.metrics`; only to bearers of ``metrics_token`` when given); ``http_port``
    serves the OpenAI-compatible HTTP front
    (`services.http_front`); None = off. With a remote tier, ``remote_gc_grace_s`` > 0 runs
    `cache_store.remote_gc.RemoteGC` on a thread of its own: the cluster's remote-tier
    namespaces that no live lease has named for that many seconds are deleted (0 = off).

    Shutdown: ``on_drain()`` (blocking; run on a thread, e.g. the CLI's deletion of the
    worker's lease so that routers stop choosing it) starts with the drain, which refuses
    new data-plane calls and lets running ones finish for up to ``drain_timeout_s`` seconds
    (`GrpcHost.drain`; a second SIGINT/SIGTERM ends it at once). Then the side servers, the
    peer fetcher and the engine stop (``engine.stop`` offloads the device pool and flushes the
    cache tiers, docs/TIERS.md).

    Raises:
        RuntimeError: the port could not be bound.
        ValueError: ``drain_timeout_s`` or ``remote_gc_grace_s`` is negative or not finite.
    """
    if not 0 <= drain_timeout_s < float("inf"):
        raise ValueError(f"drain_timeout_s must be a finite number of seconds >= 0, got {drain_timeout_s!r}")
    if not 0 <= remote_gc_grace_s < float("inf"):
        raise ValueError(f"remote_gc_grace_s must be a finite number of seconds >= 0 (0 = off), "
                         f"got {remote_gc_grace_s!r}")
    worker_id = worker_id or f"{socket.gethostname()}:{port}"
    servicer = WorkerServicer(engine, worker_id, advertise or f"{host}:{port}", peer={**(peer or {}), "tls": tls},
                              gate=gate)
    servicer.tenant_cap = TenantCap(max_inflight_per_tenant)
    grpc_host = GrpcHost(host, port, [(pb_grpc.add_WorkerServicer_to_server, servicer,
                                       pb.DESCRIPTOR.services_by_name["Worker"].full_name)],
                         tls=tls, reflection_on=reflection,
                         max_receive_bytes=max(limits.request_bytes_limit(engine.max_model_len),
                                               limits.fetch_request_bytes_limit(MAX_FETCH_BLOCKS, HASH_BYTES)),
                         max_concurrent_rpcs=max_concurrent_rpcs, admit=gate.admit if gate is not None else None,
                         drain=servicer.drain, name=f"worker {worker_id}")
    servicer.admission = grpc_host.admission  # for the metrics
    engine.start()
    from kvmesh.services import observability

    extras = await observability.start_worker_extras(
        servicer, host, metrics_port, http_port,
        ssl_context=tls.server_ssl_context() if tls is not None else None, metrics_token=metrics_token)
    bound = await grpc_host.start()
    remote_gc = _start_remote_gc(engine, remote_gc_grace_s)
    log.info("worker %s serving on %s:%d", worker_id, host, bound)
    print(f"kvmesh worker {worker_id} listening on {host}:{bound}", flush=True)
    print(f"kvmesh worker {worker_id}: {engine.describe()}", flush=True)
    if ready is not None:
        ready.set()
    await grpc_host.wait(stop)
    withdraw = asyncio.ensure_future(asyncio.to_thread(on_drain)) if on_drain is not None else None
    await grpc_host.drain(drain_timeout_s)
    if withdraw is not None:
        try:
            await withdraw
        except Exception:  # noqa: BLE001 - stopping anyway; the lease lapses by itself
            log.exception("worker %s: withdrawing from the cluster at the drain failed", worker_id)
    await extras.stop()
    await servicer.fetcher.close()
    servicer._prefetch_pool.shutdown(wait=False, cancel_futures=True)
    if remote_gc is not None:
        await asyncio.to_thread(remote_gc.stop)
    engine.stop()


def _start_remote_gc(engine: Engine, grace_s: float):
    """The running `RemoteGC` of the engine's remote tier, or None (no remote tier, or
    ``grace_s`` 0)."""
    tiers = getattr(engine, "tiers", None)
    if not grace_s or tiers is None or tiers.remote is None:
        return None
    gc = RemoteGC.for_tier(tiers.remote, tiers.config.remote_url, tiers.config.remote_cluster, grace_s)
    gc.start()
    return gc
