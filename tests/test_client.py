"""The Python client's retries, metadata and option checks, against an in-process gRPC server
that injects the faults (UNAVAILABLE, a stream cut after its first token). Agreement with
real workers and routers is in tests/test_observability_e2e.py."""
from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.client import AsyncKvmeshClient, KvmeshClient


class Flaky(pb_grpc.WorkerServicer):
    """Fails the first ``failures`` calls with ``code`` (after ``tokens_first`` tokens), then answers."""

    def __init__(self, failures=0, code=grpc.StatusCode.UNAVAILABLE, tokens_first=0):
        self.failures, self.code, self.tokens_first = failures, code, tokens_first
        self.calls = 0
        self.metadata = []

    def Generate(self, request, context):
        self.calls += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.calls <= self.failures:
            for _ in range(self.tokens_first):
                yield pb.GenerateResponse(token_ids=[5])
            context.abort(self.code, "injected")
        yield pb.GenerateResponse(token_ids=[1, 2], text="ab")
        yield pb.GenerateResponse(token_ids=[3], text="c", finished=True, finish_reason="length", worker_id="w",
                                  usage=pb.Usage(prompt_tokens=4, cached_tokens=2,
                                                 cached_tokens_by_tier={"device": 2}, completion_tokens=3),
                                  timing=pb.Timing(ttft_ms=1.5, e2e_ms=3.0))


@pytest.fixture()
def serve():
    servers = []

    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(0)


def test_retries_unavailable_with_backoff_and_sends_the_api_key(serve):
    svc = Flaky(failures=2)
    target = serve(svc)
    # the test server is plaintext: the key goes over a channel the caller made (the client
    # itself sends keys only over TLS)
    with grpc.insecure_channel(target) as ch, KvmeshClient(target, channel=ch, api_key="k1", backoff_s=0.01) as c:
        out = c.generate("abcd", max_tokens=3)
    assert svc.calls == 3
    assert out.token_ids == [1, 2, 3] and out.text == "abc" and out.finish_reason == "length"
    assert out.usage.cached_tokens == 2 and out.usage.cached_tokens_by_tier["device"] == 2
    assert out.usage.cached_tokens_by_tier["disk"] == 0 and out.timing.ttft_ms == 1.5
    assert all(m.get("authorization") == "Bearer k1" for m in svc.metadata)


def test_gives_up_after_the_retry_budget(serve):
    svc = Flaky(failures=10)
    with KvmeshClient(serve(svc), retries=2, backoff_s=0.01) as c:
        with pytest.raises(grpc.RpcError) as exc:
            c.generate("abcd")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and svc.calls == 3


def test_other_codes_and_started_streams_are_not_retried(serve):
    svc = Flaky(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    with KvmeshClient(serve(svc), backoff_s=0.01) as c:
        with pytest.raises(grpc.RpcError) as exc:
            c.generate("abcd")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and svc.calls == 1
    svc = Flaky(failures=1, tokens_first=1)
    with KvmeshClient(serve(svc), backoff_s=0.01) as c:
        chunks = []
        with pytest.raises(grpc.RpcError):
            for ch in c.stream("abcd"):
                chunks.append(ch)
    assert svc.calls == 1 and [ch.token_ids for ch in chunks] == [[5]]


def test_async_client_retries_too(serve):
    svc = Flaky(failures=1)
    target = serve(svc)

    async def run():
        async with grpc.aio.insecure_channel(target) as ch, \
                AsyncKvmeshClient(target, channel=ch, backoff_s=0.01, api_key="k2") as c:
            return await c.generate(token_ids=[1, 2, 3, 4], max_tokens=3)

    out = asyncio.run(run())
    assert svc.calls == 2 and out.token_ids == [1, 2, 3]
    assert svc.metadata[-1]["authorization"] == "Bearer k2"


def test_api_key_from_the_environment(serve, monkeypatch):
    monkeypatch.setenv("KVMESH_API_KEY", "envkey")
    svc = Flaky()
    target = serve(svc)
    with grpc.insecure_channel(target) as ch, KvmeshClient(target, channel=ch) as c:
        c.generate("x")
    assert svc.metadata[0]["authorization"] == "Bearer envkey"


def test_an_api_key_is_never_sent_in_clear(serve, monkeypatch, capsys):
    svc = Flaky()
    target = serve(svc)
    with pytest.raises(ValueError, match="--tls-ca"):
        KvmeshClient(target, api_key="secret")
    with pytest.raises(ValueError, match="in clear"):
        AsyncKvmeshClient(target, api_key="secret")
    monkeypatch.setenv("KVMESH_API_KEY", "envsecret")  # a forgotten client.env: key set, CA not
    with pytest.raises(ValueError, match="KVMESH_API_KEY"):
        KvmeshClient(target)
    from kvmesh.services.cli import main

    assert main(["generate", "--target", target, "--prompt", "hi", "--api-key", "secret"]) == 2
    assert "--tls-ca" in capsys.readouterr().err
    assert main(["status", "--target", target, "--api-key", "secret"]) == 2
    assert "in clear" in capsys.readouterr().err
    assert svc.calls == 0 and svc.metadata == []  # nothing reached the server


def test_option_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="--tls-ca"):
        KvmeshClient("127.0.0.1:1", tls_cert="c.pem", tls_key="k.pem")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        KvmeshClient("127.0.0.1:1", tls_ca=str(ca), tls_cert="c.pem")
    with pytest.raises(ValueError, match="cannot read"):
        KvmeshClient("127.0.0.1:1", tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="exactly one"):
        KvmeshClient("127.0.0.1:1").generate()
    with pytest.raises(ValueError, match="--tls-ca .*: not a PEM certificate"):  # "x" is no certificate
        KvmeshClient("127.0.0.1:1", tls_ca=str(ca))


def test_a_key_with_a_line_break_is_a_usage_error(tmp_path):
    from kvmesh.services.credentials import generate_cluster_credentials

    creds = generate_cluster_credentials(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="line break"):
        KvmeshClient("127.0.0.1:1", tls_ca=creds.ca, api_key=creds.api_key + "\n")
    KvmeshClient("127.0.0.1:1", tls_ca=creds.ca, api_key=creds.api_key).close()  # the same key, clean: accepted
    with pytest.raises(ValueError, match="non-ASCII"):
        KvmeshClient("127.0.0.1:1", tls_ca=creds.ca, api_key=creds.api_key + "é")
    from kvmesh.services.cli import main

    assert main(["status", "--target", "127.0.0.1:1", "--tls-ca", creds.ca, "--api-key", creds.api_key + "\n"]) == 2


def test_the_tls_hint_is_for_refused_connections_not_for_streams_cut_short():
    from kvmesh.services.ops_cli import connect_hint

    refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed"
    assert "--tls-ca" in connect_hint("UNAVAILABLE", refused)
    assert "--tls-ca" in connect_hint("UNAVAILABLE", "Ssl handshake failed: SSL_ERROR_SSL")
    # a worker killed mid-stream on a plaintext cluster: the connection had worked
    assert connect_hint("UNAVAILABLE", "Stream removed (Socket closed)") == ""
    assert connect_hint("DEADLINE_EXCEEDED", "Socket closed") == ""
    # credentials of another cluster: the server did not close anything, its certificate failed
    stale = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Ssl handshake failed "
             "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
             "CERTIFICATE_VERIFY_FAILED")
    assert "not signed by --tls-ca" in connect_hint("UNAVAILABLE", stale)
    assert "closed the connection" not in connect_hint("UNAVAILABLE", stale)
    # the HTTPS front's port: TLS works, HTTP/2 (ALPN h2) does not
    alpn = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Cannot check peer: "
            "missing selected ALPN property.")
    assert "--http-port" in connect_hint("UNAVAILABLE", alpn) and "gRPC --port" in connect_hint("UNAVAILABLE", alpn)


def test_the_fuzzer_never_sends_a_key_in_clear(monkeypatch, capsys):
    from kvmesh.bench import fuzz

    for name in ("KVMESH_TLS_CA", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVMESH_API_KEY", "secret")  # half of a sourced client.env
    monkeypatch.setattr(fuzz, "run_fuzz", lambda *a, **k: pytest.fail("fuzzed with a key over plaintext"))
    with pytest.raises(SystemExit) as exc:
        fuzz.main(["--target", "127.0.0.1:1"])
    assert exc.value.code == 2 and "in clear" in capsys.readouterr().err


def test_make_request_names_a_number_the_message_cannot_carry():
    from kvmesh.services.client import make_request

    for kwargs, name in [({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
                         ({"max_tokens": 2 ** 32}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
                         ({"seed": -1}, "seed"), ({"seed": 2 ** 64}, "seed"),
                         ({"top_p": 1e-300}, "top_p")]:  # 0 as a 32-bit float: nucleus sampling off
        with pytest.raises(ValueError, match=name):
            make_request("hi", **kwargs)
    with pytest.raises(ValueError, match="token_ids"):
        make_request(token_ids=[1, -2])
    assert make_request("hi", max_tokens=2 ** 32 - 1, seed=2 ** 64 - 1).sampling.seed == 2 ** 64 - 1


def test_the_hint_for_tls_spoken_to_a_plaintext_port():
    from kvmesh.services.client import connect_hint

    plain = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Ssl handshake failed "
             "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER")
    hint = connect_hint("UNAVAILABLE", plain)
    assert "does not speak TLS" in hint and "--insecure" in hint and "pass --tls-ca" not in hint
