"""KV-aware router: kvmesh.v1.Router, with the same Generate contract as a worker.

For each request the router tokenizes once, hashes the prompt's full blocks in the
request's namespace (model, cache salt, adapter) exactly as workers do, asks the
`ClusterIndex` how many leading blocks each live worker holds, and lets the routing
policy pick a worker from that and each worker's load. It then records a short-lived
speculative index entry for the chosen worker (so a burst of same-prefix requests lands
together before the worker's KV events arrive) and relays the worker's token stream.

Load seen by policies is the larger of what the worker last reported in its lease and
what this router knows it has sent there and not yet seen finish (fresh within one
request). If the chosen worker is unreachable before any token was relayed, the router
retries once on the next choice; after that the client gets UNAVAILABLE.

Peer fetch hint: when the policy picks a worker that holds fewer of the request's leading
blocks than another live worker (the holder was overloaded or over its share), the
forwarded request names that holder in ``prefix_location`` (`prefix_holder`). The chosen
worker decides from measured rates whether pulling the blocks beats recomputing them
(`workers.peer_fetch`).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass

import grpc

from kvmesh.cache_store.hashing import Namespace, hash_blocks
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.cluster_index import ClusterIndex, weighted_blocks
from kvmesh.services.index_subscriber import IndexSubscriber
from kvmesh.services.policies import RoutedShare, RouteRequest, WorkerView, make_policy
from kvmesh.workers.config import ModelConfig
from kvmesh.workers.grpc_host import CHANNEL_OPTIONS, ChannelPool, GrpcHost
from kvmesh.workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

#: Lifetime of a speculative index entry (seconds).
SPECULATIVE_TTL_S = 2.0


@dataclass
class _Inflight:
    """What this router has sent to one worker and not yet seen answered."""

    running: int = 0
    pending_prefill_tokens: int = 0
    last_done_wall: float = 0.0   # time.time() when a request of ours there last ended


class RouterServicer(pb_grpc.RouterServicer):
    """Implements kvmesh.v1.Router over a ClusterIndex fed by an IndexSubscriber."""

    def __init__(self, index: ClusterIndex, subscriber: IndexSubscriber, policy_name: str = "kv_aware",
                 model_dir: str | None = None, seed: int | None = None, max_attempts: int = 2):
        self.index = index
        self.subscriber = subscriber
        self.policy = make_policy(policy_name)
        self.policy_name = policy_name
        self.config = _load_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir, self.config)
        self.rng = random.Random(seed)
        self.max_attempts = max_attempts
        self._channels = ChannelPool()
        self._inflight: dict[str, _Inflight] = {}
        self.routed = RoutedShare()

    # ------------------------------------------------------------- helpers
    def _channel(self, address: str) -> grpc.aio.Channel:
        return self._channels.get(address)

    async def close(self) -> None:
        await self._channels.close()

    def _views(self, live: dict[str, dict], hashes: list[bytes], now: float, exclude: set[str]) -> list[WorkerView]:
        self.routed.set_fleet(len(live))  # the share window grows with the fleet
        matches = self.index.match(hashes, now) if hashes else {}
        views = []
        for wid, info in live.items():
            if wid in exclude or not info.get("address"):
                continue
            load = info.get("load") or {}
            local = self._inflight.get(wid) or _Inflight()
            # a lease written before our last request there ended still counts that request:
            # trust our own, fresher, counts until the next heartbeat
            stale = float(info.get("ts", 0.0)) < local.last_done_wall
            m = matches.get(wid)
            views.append(WorkerView(
                worker_id=wid,
                address=info["address"],
                matched_blocks=m.num_blocks if m else 0,
                weighted_blocks=weighted_blocks(m) if m else 0.0,
                running_requests=local.running if stale else max(int(load.get("running_requests", 0)),
                                                                 local.running),
                waiting_requests=int(load.get("waiting_requests", 0)),
                queued_prefill_tokens=local.pending_prefill_tokens if stale else max(
                    int(load.get("queued_prefill_tokens", 0)), local.pending_prefill_tokens),
                free_blocks=int(load.get("free_blocks", 0)),
                total_blocks=int(load.get("total_blocks", 0)),
                routed_recent=self.routed.value(wid),
            ))
        return views

    def _note_routed(self, wid: str, prefill_tokens: int) -> _Inflight:
        self.routed.note(wid)
        st = self._inflight.setdefault(wid, _Inflight())
        st.running += 1
        st.pending_prefill_tokens += prefill_tokens
        return st

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            return self.tokenizer.encode(request.text)
        return []

    # ----------------------------------------------------------------- RPCs
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        ids = self._prompt_ids(request)
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt is empty: send at least one token or non-empty text")
        live = self.subscriber.live_workers()
        if not live:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no live workers registered: start workers or retry")
        try:
            block_size = _block_size(live)
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        model_id = next((i["model_id"] for i in live.values() if i.get("model_id")), self.config.model_id)
        if request.WhichOneof("prompt") == "text" and model_id != self.config.model_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the router tokenizes for model {self.config.model_id!r} but workers serve {model_id!r}: start the "
                f"router with --model pointing at the workers' model directory, or send token_ids")
        ns = Namespace(model_id=model_id, cache_salt=request.cache_salt, adapter_id=request.adapter_id)
        hashes = list(hash_blocks(ids, block_size, ns.root_hash()).hashes)
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        forward.token_ids.ids[:] = ids  # tokenized once; workers never re-tokenize
        forward.request_id = request.request_id or uuid.uuid4().hex
        tried: set[str] = set()
        last_error = ""
        last_code = grpc.StatusCode.UNAVAILABLE
        for _attempt in range(self.max_attempts):
            now = time.monotonic()
            views = self._views(live, hashes, now, tried)
            if not views:
                break
            chosen = self.policy.choose(RouteRequest(len(ids), hashes, block_size), views, self.rng)
            tried.add(chosen.worker_id)
            self.index.add_speculative(chosen.worker_id, hashes, now, SPECULATIVE_TTL_S)
            prefill = len(ids) - chosen.matched_blocks * block_size
            holder = prefix_holder(chosen, views)
            if holder is not None:
                forward.prefix_location.CopyFrom(pb.PrefixLocation(
                    worker_id=holder.worker_id, address=holder.address, num_blocks=holder.matched_blocks))
            else:
                forward.ClearField("prefix_location")
            st = self._note_routed(chosen.worker_id, prefill)
            relayed = False
            stub = pb_grpc.WorkerStub(self._channel(chosen.address))
            timeout = context.time_remaining()
            try:
                call = stub.Generate(forward, timeout=timeout)
                async for msg in call:
                    if not relayed:
                        relayed = True
                        st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - prefill)
                    yield msg
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                retryable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                if retryable and not relayed and _attempt + 1 < self.max_attempts:
                    last_error = f"worker {chosen.worker_id} at {chosen.address}: {code.name}: {exc.details()}"
                    last_code = code
                    log.warning("%s; trying another worker", last_error)
                    continue
                await context.abort(code, exc.details() or code.name)
            finally:
                st.running = max(0, st.running - 1)
                st.last_done_wall = time.time()
                if not relayed:
                    st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - prefill)
        await context.abort(last_code, last_error or "no live worker could take the request")

    async def Status(self, request, context):
        live = self.subscriber.live_workers()
        out = pb.RouterStatus(policy=self.policy_name, indexed_blocks=self.index.num_blocks())
        for wid, info in sorted(live.items()):
            load = info.get("load") or {}
            out.workers.append(pb.WorkerStatus(
                worker_id=wid, address=info.get("address", ""),
                load=pb.Load(**{k: int(load.get(k, 0)) for k in (
                    "running_requests", "waiting_requests", "queued_prefill_tokens", "free_blocks",
                    "total_blocks")}),
                cached_blocks=self.index.num_blocks(wid)))
        return out


class WorkerFacade(pb_grpc.WorkerServicer):
    """kvmesh.v1.Worker's Generate and Tokenize served by the router.

    Lets any Worker client (``kvmesh generate``, the load harness) target the router
    unchanged; the worker-only RPCs (GetInfo, GetSnapshot, ...) stay UNIMPLEMENTED here.
    """

    def __init__(self, router: RouterServicer):
        self.router = router

    async def Generate(self, request, context):
        async for msg in self.router.Generate(request, context):
            yield msg

    async def Tokenize(self, request, context):
        return pb.TokenizeResponse(ids=self.router.tokenizer.encode(request.text))


def prefix_holder(chosen: WorkerView, views: list[WorkerView], min_extra_blocks: int = 1) -> WorkerView | None:
    """The worker to name in ``prefix_location`` for a request sent to ``chosen``, or None.

    That is the other worker holding the most leading blocks of the request (any tier),
    when it holds at least ``min_extra_blocks`` more than ``chosen``; ties go to the
    first in ``views``. Pure.
    """
    best = None
    for v in views:
        if v.worker_id != chosen.worker_id and (best is None or v.matched_blocks > best.matched_blocks):
            best = v
    if best is None or best.matched_blocks < chosen.matched_blocks + min_extra_blocks:
        return None
    return best


def _load_config(model_dir: str | None) -> ModelConfig:
    if model_dir is None:
        return ModelConfig.tiny()
    from kvmesh.workers.loader import read_config

    return read_config(model_dir)


def _block_size(live: dict[str, dict]) -> int:
    sizes = {int(info.get("block_size", 16)) for info in live.values()}
    if len(sizes) != 1:
        raise RuntimeError(f"workers disagree on block_size {sorted(sizes)}: one cluster needs one block size")
    return sizes.pop()


async def _resync(address: str) -> tuple[int, list[tuple[bytes, bytes | None, str]]]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        snap = await pb_grpc.WorkerStub(ch).GetSnapshot(pb.SnapshotRequest(), timeout=10.0)
    return snap.seq, [(b.block_hash, b.parent_block_hash or None, b.medium or "device") for b in snap.blocks]


async def serve_router(port: int, redis_url: str, policy: str = "kv_aware", host: str = "127.0.0.1",
                       model_dir: str | None = None, cluster: str = "default", seed: int | None = None,
                       ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve kvmesh.v1.Router on host:port until ``stop`` is set or SIGINT/SIGTERM.

    Raises:
        ValueError: unknown policy name.
        RuntimeError: the port could not be bound.
    """
    index = ClusterIndex()

    async def resync(worker_id: str, address: str):
        return await _resync(address)

    subscriber = IndexSubscriber(redis_url, index, resync, cluster=cluster)
    servicer = RouterServicer(index, subscriber, policy, model_dir=model_dir, seed=seed)
    grpc_host = GrpcHost(host, port, [
        (pb_grpc.add_RouterServicer_to_server, servicer, pb.DESCRIPTOR.services_by_name["Router"].full_name),
        (pb_grpc.add_WorkerServicer_to_server, WorkerFacade(servicer),
         pb.DESCRIPTOR.services_by_name["Worker"].full_name),
    ])
    await subscriber.start()
    bound = await grpc_host.start()
    print(f"kvmesh router ({policy}) listening on {host}:{bound}", flush=True)
    if ready is not None:
        ready.set()
    await grpc_host.wait(stop)
    await grpc_host.stop()
    await subscriber.stop()
    await servicer.close()
