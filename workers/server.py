"""gRPC front of one worker: kvmesh.v1.Worker, standard health checking and reflection.

The servicer only translates: it validates and converts the request, submits it to the
`Engine` (which runs on its own thread), and relays the engine's outputs from that
thread into the RPC's asyncio queue. Engine errors map once to gRPC status codes:
`InvalidRequest` -> INVALID_ARGUMENT, `Overloaded` -> RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import uuid

import grpc

from proto import kvmesh_pb2 as pb
from proto import kvmesh_pb2_grpc as pb_grpc
from workers import wire
from workers.engine import Engine
from workers.grpc_host import GrpcHost
from workers.request import InvalidRequest, Overloaded, RequestOutput

log = logging.getLogger(__name__)



class WorkerServicer(pb_grpc.WorkerServicer):
    """Implements kvmesh.v1.Worker over an `Engine`."""

    def __init__(self, engine: Engine, worker_id: str, address: str = ""):
        self.engine = engine
        self.worker_id = worker_id
        self.address = address

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            return self.engine.tokenizer.encode(request.text)
        raise InvalidRequest("request has no prompt: set text or token_ids")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_output(out: RequestOutput) -> None:  # engine thread
            loop.call_soon_threadsafe(queue.put_nowait, out)

        rid = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids = self._prompt_ids(request)
            self.engine.submit(prompt_ids, wire.sampling_from_proto(request), on_output,
                               cache_salt=request.cache_salt, adapter_id=request.adapter_id,
                               request_id=rid)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out.error:
                    finished = True
                    await context.abort(wire.STATUS_CODES.get(out.error_code, grpc.StatusCode.INTERNAL),
                                        out.error)
                msg = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids,
                                          finished=out.finished, worker_id=self.worker_id)
                if request.return_text and out.new_token_ids:
                    msg.text = self.engine.tokenizer.decode(out.new_token_ids)
                if out.finished:
                    finished = True
                    msg.finish_reason = out.finish_reason
                    msg.usage.CopyFrom(wire.usage_to_proto(out.usage))
                    msg.timing.CopyFrom(wire.timing_to_proto(out.timing))
                yield msg
        finally:
            if not finished:  # client cancelled or deadline passed
                self.engine.abort(rid)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        return pb.TokenizeResponse(ids=self.engine.tokenizer.encode(request.text))

    async def GetInfo(self, request, context):
        e = self.engine
        return pb.WorkerInfo(worker_id=self.worker_id, model_id=e.config.model_id, block_size=e.block_size,
                             num_blocks=e.num_blocks, vocab_size=e.config.vocab_size,
                             max_model_len=e.max_model_len, device=str(e.device))

    async def GetLoad(self, request, context):
        return wire.load_to_proto(self.engine.load())

    async def GetSnapshot(self, request, context):
        snap = self.engine.snapshot()
        return pb.Snapshot(
            worker_id=self.worker_id, seq=snap["seq"], block_size=self.engine.block_size,
            blocks=[pb.CachedBlock(block_hash=h, parent_block_hash=p or b"", medium=m)
                    for h, p, m in snap["blocks"]],
        )

    async def ClearCache(self, request, context):
        return pb.ClearCacheResponse(blocks_cleared=self.engine.clear_cache())


async def serve_worker(engine: Engine, port: int, host: str = "127.0.0.1", worker_id: str | None = None,
                       ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve the engine on host:port until ``stop`` is set or SIGINT/SIGTERM arrives.

    Raises:
        RuntimeError: the port could not be bound.
    """
    worker_id = worker_id or f"{socket.gethostname()}:{port}"
    servicer = WorkerServicer(engine, worker_id, f"{host}:{port}")
    grpc_host = GrpcHost(host, port, [(pb_grpc.add_WorkerServicer_to_server, servicer,
                                       pb.DESCRIPTOR.services_by_name["Worker"].full_name)])
    engine.start()
    bound = await grpc_host.start()
    log.info("worker %s serving on %s:%d", worker_id, host, bound)
    print(f"kvmesh worker {worker_id} listening on {host}:{bound}", flush=True)
    if ready is not None:
        ready.set()
    await grpc_host.wait(stop)
    await grpc_host.stop()
    engine.stop()
