"""What a stranger can make the router do, on a real redis-server and router process.

The router's workers here are stand-ins in this process (a gRPC server that records the
raw Generate bodies it is sent and can answer RESOURCE_EXHAUSTED, to inject a busy
worker) holding real leases in Redis, so what the router forwards can be read byte for
byte. Covered: the Worker RPCs the router does not serve answer UNIMPLEMENTED without a
logged traceback; retries after a busy worker are logged at a bounded rate; an
``adapter_id`` over its cap is refused before forwarding; unknown protobuf fields are not
forwarded.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent import futures

import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.procs import RedisServer, free_port, python_cmd, spawn, stop_process, wait_healthy
from kvmesh.workers.grpc_guard import LOG_BURST
from kvmesh.workers.kv_publisher import WorkerLease

pytestmark = pytest.mark.slow


class _StandIn:
    """A worker stand-in: records each Generate body as received (bytes) and answers one
    token, or RESOURCE_EXHAUSTED while ``busy`` is set."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.bodies: list[bytes] = []
        self.busy = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        handler = grpc.unary_stream_rpc_method_handler(self._generate, request_deserializer=None,
                                                       response_serializer=pb.GenerateResponse.SerializeToString)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "kvmesh.v1.Worker", {"Generate": handler}),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{free_port()}")
        self.server.start()

    def _generate(self, body: bytes, context):
        self.bodies.append(body)
        if self.busy.is_set():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (injected)")
        yield pb.GenerateResponse(token_ids=[7], finished=True, finish_reason="length", worker_id=self.worker_id)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    redis = RedisServer()
    cluster = f"hardening-{uuid.uuid4().hex[:8]}"
    stand_ins = [_StandIn(f"s{i}") for i in range(2)]
    leases = [WorkerLease(redis.url, s.worker_id, f"127.0.0.1:{s.port}",
                          {"block_size": 16, "model_id": "stand-in-model", "max_model_len": 4096},
                          lambda: {}, cluster=cluster) for s in stand_ins]
    port = free_port()
    log_path = os.path.join(log_dir, "router.log")
    proc = spawn(python_cmd("router", "--port", str(port), "--redis-url", redis.url, "--cluster", cluster), log_path)
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(address, proc=proc, timeout=120)
        deadline = time.monotonic() + 30
        while True:  # until the router has read both leases
            with grpc.insecure_channel(address) as ch:
                st = pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5)
            if len(st.workers) == 2:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        yield {"router": address, "log": log_path, "stand_ins": stand_ins}
    finally:
        stop_process(proc)
        for lease in leases:
            lease.close()
        for s in stand_ins:
            s.server.stop(0)
        redis.stop()


def _request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 41))), sampling=pb.SamplingParams(max_tokens=1),
                              **fields)


def _generate(address: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream("/kvmesh.v1.Worker/Generate", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        try:
            list(call(body, timeout=30))
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _log(setup) -> str:
    with open(setup["log"], encoding="utf-8", errors="replace") as f:
        return f.read()


def test_worker_only_rpcs_are_unimplemented_without_a_logged_traceback(setup):
    """GetInfo, GetLoad, GetSnapshot, ClearCache and FetchBlocks on the router: each call
    UNIMPLEMENTED, and 100 calls add no traceback to the router's log (each used to log
    about 920 bytes of NotImplementedError traceback)."""
    before = len(_log(setup))
    calls = [("GetInfo", pb.WorkerInfoRequest()), ("GetLoad", pb.LoadRequest()),
             ("GetSnapshot", pb.SnapshotRequest()), ("ClearCache", pb.ClearCacheRequest()),
             ("FetchBlocks", pb.FetchBlocksRequest(block_hashes=[bytes(16)]))]
    with grpc.insecure_channel(setup["router"]) as ch:
        stub = pb_grpc.WorkerStub(ch)
        for _ in range(20):
            for name, req in calls:
                with pytest.raises(grpc.RpcError) as err:
                    out = getattr(stub, name)(req, timeout=10)
                    if name == "FetchBlocks":
                        list(out)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, (name, err.value)
    time.sleep(0.5)
    added = _log(setup)[before:]
    assert "Traceback" not in added and "NotImplementedError" not in added, added[:2000]
    assert len(added) < 1000, added[:2000]


def test_retries_after_busy_workers_are_logged_at_a_bounded_rate(setup):
    """With both workers answering RESOURCE_EXHAUSTED, 60 requests each retry once on the
    other worker, then get RESOURCE_EXHAUSTED; the router logs at most `LOG_BURST` retry
    lines per window (one per request before)."""
    before = len(_log(setup))
    for s in setup["stand_ins"]:
        s.busy.set()
    try:
        codes = [_generate(setup["router"], _request().SerializeToString())[0] for _ in range(60)]
    finally:
        for s in setup["stand_ins"]:
            s.busy.clear()
    assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    time.sleep(0.5)
    lines = [ln for ln in _log(setup)[before:].splitlines() if "trying another worker" in ln]
    assert 1 <= len(lines) <= 2 * LOG_BURST, len(lines)


def test_an_adapter_id_over_its_cap_is_refused_before_forwarding(setup):
    """``adapter_id`` is capped as ``cache_salt`` is (1,024 characters): one character more
    is INVALID_ARGUMENT from the router, naming the field, and never reaches a worker; the
    cap itself passes."""
    from kvmesh.workers.limits import MAX_ADAPTER_ID_CHARS

    assert MAX_ADAPTER_ID_CHARS == 1024
    sent = sum(len(s.bodies) for s in setup["stand_ins"])
    code, details = _generate(setup["router"], _request(adapter_id="a" * 1025).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("adapter_id has 1025 characters"), \
        (code, details)
    assert sum(len(s.bodies) for s in setup["stand_ins"]) == sent
    assert _generate(setup["router"], _request(adapter_id="a" * 1024).SerializeToString())[0] == grpc.StatusCode.OK


def test_a_worker_refuses_an_adapter_id_over_its_cap(spawn_worker):
    address, _ = spawn_worker("--num-blocks", "64")
    code, details = _generate(address, _request(adapter_id="é" * 1025).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_id has 1025 characters" in details, (code, details)
    # at the cap it passes the size check and meets the next one: no adapters are loaded, and
    # the base model's answer would be another model's (it once was, silently)
    code, details = _generate(address, _request(adapter_id="é" * 1024).SerializeToString())
    assert code == grpc.StatusCode.NOT_FOUND and "no LoRA adapters are loaded" in details, (code, details)
    assert _generate(address, _request().SerializeToString())[0] == grpc.StatusCode.OK


def _unknown_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field ``number`` no kvmesh message declares."""
    def varint(n: int) -> bytes:
        out = b""
        while n >= 0x80:
            out += bytes([n & 0x7F | 0x80])
            n >>= 7
        return out + bytes([n])

    return varint(number << 3 | 2) + varint(len(value)) + value


def test_unknown_fields_are_not_forwarded(setup):
    """A Generate body carrying fields the proto does not declare (top level and inside
    ``sampling``) is served, and the body the worker gets holds none of them."""
    marker = b"UNKNOWN-FIELD-MARKER"
    req = _request(request_id="unknown-fields")
    sampling = req.sampling.SerializeToString() + _unknown_field(99, marker + b"-inner")
    req.ClearField("sampling")
    body = (req.SerializeToString() + _unknown_field(4, sampling)  # field 4: sampling
            + _unknown_field(1000, marker) + _unknown_field(12, marker))
    parsed = pb.GenerateRequest.FromString(body)
    assert parsed.sampling.max_tokens == 1 and marker in parsed.SerializeToString()
    for s in setup["stand_ins"]:
        s.bodies.clear()
    assert _generate(setup["router"], body)[0] == grpc.StatusCode.OK
    got = [b for s in setup["stand_ins"] for b in s.bodies]
    assert len(got) == 1
    assert marker not in got[0]
    forwarded = pb.GenerateRequest.FromString(got[0])
    assert forwarded.request_id == "unknown-fields" and forwarded.sampling.max_tokens == 1


def test_router_receive_cap_without_model(setup):
    """A router without --model takes token-id prompts of 128K tokens at 5 bytes an id (it
    cannot know its workers' context at start), and nothing much bigger: a 1 MiB body gets
    RESOURCE_EXHAUSTED from gRPC, unread (the cap was 4 MiB)."""
    longest = _request()
    longest.token_ids.ids[:] = [2**32 - 1] * (128 * 1024 - 1)
    code, details = _generate(setup["router"], longest.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context" in details, (code, details)
    body = _request(request_id="x" * (1 << 20)).SerializeToString()
    code, details = _generate(setup["router"], body)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, (code, details)
