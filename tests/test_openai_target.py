"""`bench --api openai` pointed at a port that is not an OpenAI-compatible front fails at once
with what to use instead, rather than retrying until its connect deadline."""
from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest

from kvmesh.bench.openai_target import OpenAITarget
from kvmesh.services.procs import free_port


def _detect(url: str) -> tuple[str, float]:
    async def go():
        async with OpenAITarget(url) as target:
            await target.detect(connect_timeout_s=120)

    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as err:
        asyncio.run(go())
    return str(err.value), time.monotonic() - t0


def test_a_grpc_port_is_named_as_such():
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        message, took = _detect(f"http://127.0.0.1:{port}/v1")
    finally:
        server.stop(None)
    assert "speaks gRPC" in message and "--http-port" in message
    assert took < 60  # decided on the first answer, not at the 120 s deadline


def test_a_metrics_port_is_not_an_openai_front():
    from prometheus_client import start_http_server

    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1")
    try:
        message, took = _detect(f"http://127.0.0.1:{port}/v1")
    finally:
        server.shutdown()
    assert "not an OpenAI-compatible front" in message
    assert took < 60
