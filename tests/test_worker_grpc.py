"""One real worker process over gRPC on loopback: the Generate contract, the CLI's JSON,
status codes for bad input and overload, health, reflection, cancellation."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.cli import generate

pytestmark = pytest.mark.slow
BS = 16


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from kvmesh.services.procs import free_port, python_cmd, spawn, stop_process, wait_healthy

    port = free_port()
    log = tmp_path_factory.mktemp("w") / "worker.log"
    proc = spawn(python_cmd("worker", "--port", str(port), "--worker-id", "w-test", "--num-blocks", "64",
                            "--threads", "1", "--reflection"), str(log))
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(address, proc=proc)
        yield address
    finally:
        stop_process(proc)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.services.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_generate_json_hit_and_fields(worker):
    prompt = "The quick brown fox jumps over the lazy dog; " * 3
    first = cli("generate", "--target", worker, "--prompt", prompt, "--max-tokens", "6", "--json")
    assert first.returncode == 0, first.stderr
    a = json.loads(first.stdout)
    for key in ("token_ids", "text", "worker_id", "usage", "timing"):
        assert key in a
    assert a["worker_id"] == "w-test"
    assert a["usage"]["prompt_tokens"] == len(prompt.encode())
    assert a["usage"]["completion_tokens"] == len(a["token_ids"]) == 6
    assert set(a["usage"]["cached_tokens_by_tier"]) >= {"device", "host", "disk", "peer"}
    assert a["timing"]["ttft_ms"] > 0 and a["timing"]["e2e_ms"] >= a["timing"]["ttft_ms"]
    b = json.loads(cli("generate", "--target", worker, "--prompt", prompt, "--max-tokens", "6", "--json").stdout)
    assert b["usage"]["cached_tokens"] == BS * ((len(prompt.encode()) - 1) // BS)
    assert b["token_ids"] == a["token_ids"]


def test_token_ids_and_tenant_isolation(worker):
    rng = random.Random(4)
    ids = [rng.randrange(256) for _ in range(50)]  # one generator: 50 varied tokens
    a = generate(worker, token_ids=ids, max_tokens=4, tenant="acme")
    b = generate(worker, token_ids=ids, max_tokens=4, tenant="globex")
    assert b["usage"]["cached_tokens"] == 0
    assert a["token_ids"] == b["token_ids"]


def test_bad_input_exits_nonzero_with_status(worker):
    res = cli("generate", "--target", worker, "--token-ids", "1,2,999")
    assert res.returncode != 0
    assert "INVALID_ARGUMENT" in res.stderr
    assert "out of range" in res.stderr
    # an empty prompt, which the CLI refuses before dialing, is refused by the server too
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, prompt="", max_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.value.details()


def test_prompt_beyond_context(worker):
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, token_ids=[1] * 40000, max_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context" in err.value.details()


def test_prompt_larger_than_the_pool_is_invalid_argument(worker):
    # no retry can help a prompt the 64-block pool cannot hold alone: not RESOURCE_EXHAUSTED (HTTP 429,
    # which clients retry) but INVALID_ARGUMENT naming the pool's limit
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, token_ids=[7] * (64 * BS), max_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {64 * BS - 1} tokens" in err.value.details() and "64 blocks" in err.value.details()
    # one token less fits with one completion token; more would run past the context: refused
    # (as vLLM's server does) with the largest max_tokens that fits, not cut short
    out = generate(worker, token_ids=[7] * (64 * BS - 1), max_tokens=1)
    assert out["usage"]["completion_tokens"] == 1
    with pytest.raises(grpc.RpcError) as err:
        generate(worker, token_ids=[7] * (64 * BS - 3), max_tokens=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens is 5" in err.value.details() and "at most 3 tokens" in err.value.details()
    # asked for "up to the context" (the HTTP front's chat default), it is served with what fits
    with grpc.insecure_channel(worker) as ch:
        msgs = list(pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[7] * (64 * BS - 3)),
            sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True, max_tokens_up_to_context=True)), timeout=120))
    assert sum(len(m.token_ids) for m in msgs) == 3 and msgs[-1].finish_reason == "length"
    # the flag alone (max_tokens unset) asks for all of the rest, not for one token
    with grpc.insecure_channel(worker) as ch:
        msgs = list(pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[7] * (64 * BS - 4)),
            sampling=pb.SamplingParams(ignore_eos=True, max_tokens_up_to_context=True)), timeout=120))
    assert sum(len(m.token_ids) for m in msgs) == 4
    # the worker is still up and serving
    assert generate(worker, token_ids=[1, 2, 3], max_tokens=2)["usage"]["completion_tokens"] == 2


def test_health_and_reflection(worker):
    with grpc.insecure_channel(worker) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Worker"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "kvmesh.v1.Worker" in names


def test_cancel_mid_stream_frees_blocks(worker):
    with grpc.insecure_channel(worker) as ch:
        stub = pb_grpc.WorkerStub(ch)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(40))),
                                 sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True))
        call = stub.Generate(req)
        next(call)
        call.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            load = stub.GetLoad(pb.LoadRequest())
            if load.running_requests == 0 and load.waiting_requests == 0:
                break
            time.sleep(0.05)
        assert load.running_requests == 0
        assert load.free_blocks == load.total_blocks  # nothing left locked


def test_kv_size_cli():
    res = cli("kv-size", "--model", "Llama-3-8B", "--tokens", "8192", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    # published Llama-3-8B shape: 32 layers, 8 KV heads, head_dim 128; bf16 = 2 bytes
    assert out["bytes"] == 2 * 32 * 8 * 128 * 2 * 8192
    bad = cli("kv-size", "--model", "no-such-model", "--tokens", "10")
    assert bad.returncode != 0 and "Llama-3-8B" in bad.stderr


def test_streamed_text_keeps_multibyte_characters(worker):
    """Text is decoded incrementally: a character split over tokens is never mangled."""
    text = "café 日本"
    ids = list(text.encode())
    with grpc.insecure_channel(worker) as ch:
        stub = pb_grpc.WorkerStub(ch)
        # the byte tokenizer: prompt ids are the bytes; the streamed text is the decoded completion
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), return_text=True,
                                 sampling=pb.SamplingParams(max_tokens=8))
        msgs = list(stub.Generate(req))
    completion = [t for m in msgs for t in m.token_ids]
    streamed = "".join(m.text for m in msgs)
    expected = bytes(t for t in completion if t < 256).decode("utf-8", errors="replace")
    assert streamed == expected


def test_duplicate_request_ids_do_not_cancel_each_other(worker):
    with grpc.insecure_channel(worker) as ch:
        stub = pb_grpc.WorkerStub(ch)
        mk = lambda: pb.GenerateRequest(request_id="same-id", token_ids=pb.TokenIds(ids=list(range(30))),  # noqa: E731
                                        sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True))
        a = stub.Generate(mk())
        b = stub.Generate(mk())
        next(a)
        a.cancel()  # the first client goes away
        got = [t for m in b for t in m.token_ids]
    assert len(got) == 40


def test_tiny_temperature_does_not_kill_the_worker(worker):
    out = generate(worker, token_ids=[5, 6, 7, 8], max_tokens=4, temperature=1e-40, seed=1)
    assert out["usage"]["completion_tokens"] == 4
    assert generate(worker, token_ids=[1, 2, 3], max_tokens=2)["usage"]["completion_tokens"] == 2


def test_second_worker_on_a_busy_port_fails(worker):
    port = worker.rsplit(":", 1)[1]
    res = subprocess.run([sys.executable, "-m", "kvmesh.services.cli", "worker", "--port", port, "--threads", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "could not bind" in res.stderr


def test_oversized_request_ids_and_tokenize_texts_are_invalid_arguments(worker):
    """A request_id is echoed in every streamed message: over 256 characters it is refused,
    as is a Tokenize text longer than the context could hold (Generate's own text cap); both
    before any work, and the worker serves the next request."""
    from kvmesh.workers.limits import MAX_REQUEST_ID_CHARS

    with grpc.insecure_channel(worker) as ch:
        stub = pb_grpc.WorkerStub(ch)
        req = pb.GenerateRequest(request_id="r" * (MAX_REQUEST_ID_CHARS + 1), token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                 sampling=pb.SamplingParams(max_tokens=1))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
        # this worker's context is 64 blocks x 16 = 1,024 tokens: texts up to 16 KiB are taken
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(pb.TokenizeRequest(text="x" * (40 << 10)))  # over the text cap, under the receive cap
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text has" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(pb.TokenizeRequest(text="x" * (3 << 20)))  # over the receive cap: never read
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        req.request_id = "r" * MAX_REQUEST_ID_CHARS
        assert [m.request_id for m in stub.Generate(req)][-1] == req.request_id
        assert list(stub.Tokenize(pb.TokenizeRequest(text="hello")).ids)


def test_a_cache_salt_past_its_cap_is_invalid_argument(worker):
    """A 3 MB salt was accepted (and hashed into the namespace); request_id had a cap, the salt none."""
    with pytest.raises(grpc.RpcError) as err:
        with grpc.insecure_channel(worker) as ch:
            list(pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[1, 2, 3]), cache_salt="s" * 5000,
                sampling=pb.SamplingParams(max_tokens=1)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in err.value.details()


def test_a_request_that_cannot_meet_its_grpc_deadline_is_shed_before_its_prefill(tmp_path):
    """A worker with --deadline-shed-factor 1000 (so the deadlines here are seconds long):
    a 900-token prompt whose 5 s deadline is under 1000x its estimated prefill is answered
    DEADLINE_EXCEEDED by the worker at once, naming the estimate, and counted as shed in
    its metrics; without a deadline the same prompt is served, nothing of it cached."""
    import urllib.request

    from kvmesh.services.procs import free_port, python_cmd, spawn, stop_process, wait_healthy

    port, metrics_port = free_port(), free_port()
    proc = spawn(python_cmd("worker", "--port", str(port), "--worker-id", "w-shed", "--num-blocks", "64",
                            "--threads", "1", "--deadline-shed-factor", "1000", "--metrics-port", str(metrics_port)),
                 str(tmp_path / "worker.log"))
    address = f"127.0.0.1:{port}"
    rng = random.Random(5)
    ids = [rng.randrange(256) for _ in range(900)]
    try:
        wait_healthy(address, proc=proc)
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            for _ in range(4):  # the worker measures its prefill rate (Engine.PEAK_RATE_MIN_SAMPLES steps)
                warm = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[rng.randrange(256) for _ in range(200)]),
                                          sampling=pb.SamplingParams(max_tokens=1))
                list(stub.Generate(warm))
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=4))
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, timeout=5))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "shed before its prefill" in err.value.details(), err.value.details()  # the worker's, not ours
            assert time.monotonic() - t0 < 4
            served = list(stub.Generate(req))
            assert served[-1].finished and served[-1].usage.cached_tokens == 0
            assert served[-1].usage.completion_tokens == 4
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        counted = [line for line in text.splitlines() if line.startswith('kvmesh:request_success_total{finished_reason="shed"}')]
        assert [line.split()[-1] for line in counted] == ["1.0"], counted
    finally:
        stop_process(proc)
