"""gRPC servers' concurrency cap, on a real worker process over loopback.

Data-plane calls past ``--max-concurrent-rpcs`` get RESOURCE_EXHAUSTED while health and
the control-plane RPCs still answer (they have `CONTROL_RPC_RESERVE` more slots), and calls
that never send their request message cannot take those slots (`CallAdmission`).
"""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.workers.grpc_guard import CONTROL_PER_HOST, WATCH_PER_HOST
from kvmesh.workers.grpc_host import CONTROL_RPC_RESERVE

pytestmark = pytest.mark.slow

CAP = 3


def _long_request(seed: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[(seed * 7 + i) % 256 for i in range(20)]),
                              sampling=pb.SamplingParams(max_tokens=4000, ignore_eos=True))


def test_data_plane_past_the_cap_is_refused_while_the_control_plane_answers(spawn_worker):
    address, _ = spawn_worker("--max-concurrent-rpcs", str(CAP), "--max-seqs", "4", "--max-model-len", "4096",
                              "--num-blocks", "1024")
    held = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        try:
            for i in range(CAP):  # CAP long generations, each streaming
                call = stub.Generate(_long_request(i), timeout=120)
                next(call)
                held.append(call)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(_long_request(9), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-rpcs" in err.value.details(), err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # the control plane still answers
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert stub.GetLoad(pb.LoadRequest(), timeout=10).running_requests == CAP
            assert stub.GetInfo(pb.WorkerInfoRequest(), timeout=10).max_model_len == 4096
            # long-lived health Watch streams cannot take the control plane's slots either
            for _ in range(WATCH_PER_HOST):
                watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=120)
                next(watch)
                held.append(watch)
            with pytest.raises(grpc.RpcError) as err:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Watch" in err.value.details()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        finally:
            for call in held:
                call.cancel()
        # cancelled calls give their slots back
        deadline = time.monotonic() + 30
        while True:
            try:
                out = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                            sampling=pb.SamplingParams(max_tokens=2)), timeout=30))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                time.sleep(0.2)
        assert out[-1].finished


def test_max_concurrent_rpcs_must_be_positive(capsys):
    from kvmesh.services.cli import build_parser

    for cmd in (["worker", "--port", "1"], ["router", "--port", "1"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*cmd, "--max-concurrent-rpcs", "0"])
        assert exit_.value.code == 2
        assert "--max-concurrent-rpcs" in capsys.readouterr().err


def _raw(address: str, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    opts = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(address, options=opts) as ch:
        call = ch.unary_stream(f"/kvmesh.v1.Worker/{method}", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        try:
            list(call(body, timeout=30))
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_receive_cap_follows_the_largest_valid_request(spawn_worker):
    """A worker of a 256-token context takes at most what its longest valid request needs
    (16 B of text per token, plus 64 KiB for the other fields): a 100 KB body gets
    RESOURCE_EXHAUSTED from gRPC, unread (it was parsed under a 4 MiB cap before). The
    largest valid Generate (every capped field at its cap, in 4-byte characters) is read,
    and so is a FetchBlocks request for the most blocks a peer may ask for."""
    from kvmesh.cache_store.hashing import HASH_BYTES
    from kvmesh.workers import limits
    from kvmesh.workers.peer_fetch import MAX_FETCH_BLOCKS

    address, _ = spawn_worker("--max-model-len", "256", "--num-blocks", "64")
    big = pb.GenerateRequest(text="x" * 100_000, sampling=pb.SamplingParams(max_tokens=1)).SerializeToString()
    code, details = _raw(address, "Generate", big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, (code, details)
    wide = "\U0001F600"  # 4 bytes of UTF-8
    fields = dict(request_id=wide * limits.MAX_REQUEST_ID_CHARS, cache_salt=wide * limits.MAX_CACHE_SALT_CHARS,
                  adapter_id=wide * limits.MAX_ADAPTER_ID_CHARS, sampling=pb.SamplingParams(max_tokens=1))
    longest_text = pb.GenerateRequest(text="x" * (16 * 256), **fields)
    longest_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1] * 255), **fields)
    for req in (longest_text, longest_ids):
        code, details = _raw(address, "Generate", req.SerializeToString())
        assert code != grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)  # read and judged on its content
    fetch = pb.FetchBlocksRequest(block_hashes=[i.to_bytes(HASH_BYTES, "big") for i in range(MAX_FETCH_BLOCKS)],
                                  kv_producer="")
    assert len(fetch.SerializeToString()) > limits.request_bytes_limit(256)
    assert _raw(address, "FetchBlocks", fetch.SerializeToString()) == (grpc.StatusCode.OK, "")


async def _stalled_calls(channel, method: str, n: int, release):
    """``n`` calls of ``method`` that send their headers and never their request message."""
    async def never():
        await release.wait()
        yield b""
    call = channel.stream_unary(method, request_serializer=lambda x: x, response_deserializer=lambda b: b)
    return [call(never(), timeout=120) for _ in range(n)]


async def _until(cond, timeout: float = 30.0) -> None:
    """Wait until ``cond()`` holds or ``timeout`` seconds pass (the assertions after it say
    which)."""
    import asyncio

    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _settle(calls, still_open: int, timeout: float = 60.0) -> int:
    """Wait until only ``still_open`` of ``calls`` are open (the rest refused; on a busy
    machine that takes a while), or ``timeout`` seconds; returns how many are open."""
    import asyncio

    deadline = time.monotonic() + timeout
    while sum(not c.done() for c in calls) > still_open and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)  # and no more are refused than should be
    return sum(not c.done() for c in calls)


def test_calls_that_never_send_their_message_cannot_block_the_server(spawn_worker):
    """A caller that opens calls and never sends their message (so no handler runs) used to
    hold every slot gRPC counts, and health checks were refused. Now a data-plane call takes
    a slot of the cap at its start, and control-plane calls waiting for their message are
    bounded per client host, so the server keeps answering."""
    import asyncio

    from grpc import aio

    from kvmesh.services.procs import free_port

    metrics_port = free_port()
    address, _ = spawn_worker("--max-concurrent-rpcs", str(CAP), "--max-seqs", "4", "--num-blocks", "256",
                              "--metrics-port", str(metrics_port))

    def scrape() -> dict:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    async def scenario():
        release = asyncio.Event()
        async with aio.insecure_channel(address) as attacker, aio.insecure_channel(address) as ch:
            # more calls than gRPC's whole limit (CAP + CONTROL_RPC_RESERVE); the ones past the
            # cap are refused at once (control calls from other hosts: the next test)
            stalled = await _stalled_calls(attacker, "/kvmesh.v1.Worker/Generate", CONTROL_RPC_RESERVE + 40, release)
            assert await _settle(stalled, CAP) == CAP
            codes = {(await c.code()) for c in stalled if c.done()}
            assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            seen = await asyncio.to_thread(scrape)  # what an operator sees
            assert seen[("kvmesh:grpc_data_plane_calls_in_flight", ())] == CAP
            assert seen[("kvmesh:grpc_calls_awaiting_message", ())] == CAP
            health = health_pb2_grpc.HealthStub(ch)
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
                health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.WorkerStub(ch)
            assert (await stub.GetLoad(pb.LoadRequest(), timeout=10)).running_requests == 0
            for c in stalled:
                c.cancel()
            # their slots come back: a Generate runs
            deadline = time.monotonic() + 30
            while True:
                try:
                    out = [m async for m in stub.Generate(pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(max_tokens=2)), timeout=30)]
                    break
                except aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                    await asyncio.sleep(0.2)
            assert out[-1].finished

    asyncio.run(scenario())


def test_a_call_without_its_message_in_time_is_deadline_exceeded():
    import asyncio

    from grpc import aio

    from kvmesh.workers.grpc_host import GrpcHost

    async def scenario():
        host = GrpcHost("127.0.0.1", 0, [], message_timeout_s=0.5)
        port = await host.start()
        release = asyncio.Event()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                [late] = await _stalled_calls(ch, "/grpc.health.v1.Health/Check", 1, release)
                with pytest.raises(aio.AioRpcError) as err:
                    await late
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "did not arrive within 0.5 s" in err.value.details()

                async def nothing():
                    return
                    yield b""
                empty = ch.stream_unary("/grpc.health.v1.Health/Check", request_serializer=lambda x: x,
                                        response_deserializer=lambda b: b)
                with pytest.raises(aio.AioRpcError) as err:
                    await empty(nothing(), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "without a request message" in err.value.details()
                # a normal call is unaffected, and the slots were given back
                health = health_pb2_grpc.HealthStub(ch)
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
                    health_pb2.HealthCheckResponse.SERVING
                deadline = time.monotonic() + 30  # a slot comes back when its call has ended
                while host.admission.control.total and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert host.admission.control.total == 0 and host.admission.timed_out == 1
        finally:
            release.set()
            await host.server.stop(0)

    asyncio.run(scenario())


def test_peer_host_names_the_client_host():
    from kvmesh.workers.grpc_guard import HostLimit, host_network, peer_host

    assert peer_host("ipv4:10.1.2.3:5000") == "10.1.2.3"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:%5B2001:db8::1%5D:443") == "2001:db8::1"
    assert peer_host("ipv6:[::ffff:10.1.2.3]:5000") == "10.1.2.3"  # IPv4-mapped: the IPv4 host
    assert peer_host("unix:/tmp/sock") == "unix"
    # a caller without a peer certificate counts by its IPv6 /64: one host can take a new
    # address of it per call
    assert host_network("2001:db8::ffff:1:2") == host_network("2001:db8::9") == "2001:db8::/64"
    assert host_network("2001:db8:0:1::9") == "2001:db8:0:1::/64"
    assert host_network("fe80::1%eth0") == "fe80::/64"
    assert host_network("::1") == "::1" and host_network("10.1.2.3") == "10.1.2.3"
    # which every per-host limit uses for a caller that is not a verified peer (a port
    # without TLS tells none apart); a peer keeps its own address (pods of a node share a /64)
    from kvmesh.workers.grpc_guard import CallAdmission, _client

    class Ctx:  # what the admission reads of a call's context
        def peer(self):
            return "ipv6:[2001:db8::5]:443"

    assert _client(CallAdmission(), Ctx()) == ("2001:db8::/64", True)
    assert _client(CallAdmission(trusted=lambda ctx: True), Ctx()) == ("2001:db8::5", True)
    assert _client(CallAdmission(trusted=lambda ctx: False), Ctx()) == ("2001:db8::/64", False)
    limit = HostLimit(2, 3)
    assert limit.enter("a") and limit.enter("a") and not limit.enter("a")  # per host
    assert limit.enter("b") and not limit.enter("c")  # in all
    limit.leave("a")
    assert limit.enter("c") and limit.by_host == {"a": 1, "b": 1, "c": 1}


class _Trivial:
    """A Worker servicer whose Generate answers at once (the admission is under test)."""

    async def Generate(self, request, context):
        yield pb.GenerateResponse(finished=True)


def test_one_host_cannot_hold_the_data_plane_or_flood_the_reserve(monkeypatch):
    """Review findings: stalled data-plane calls from one host each held a slot of the cap
    (per-tenant caps apply only once the message is read), and control calls younger than
    the grace period were not counted, so a client re-opening them quickly filled the
    reserve. Now one host holds at most DATA_PENDING_PER_HOST stalled data-plane calls, and
    control calls count from their start."""
    import asyncio

    from grpc import aio

    from kvmesh.workers.grpc_guard import DATA_PENDING_PER_HOST
    from kvmesh.workers.grpc_host import GrpcHost

    cap = DATA_PENDING_PER_HOST + 8
    # each connection stands for a client host (every test client is on 127.0.0.1)
    monkeypatch.setattr("kvmesh.workers.grpc_guard.peer_host", lambda peer: peer)

    async def scenario():
        trivial = type("S", (_Trivial, pb_grpc.WorkerServicer), {})()
        host = GrpcHost("127.0.0.1", 0, [(pb_grpc.add_WorkerServicer_to_server, trivial, "kvmesh.v1.Worker")],
                        max_concurrent_rpcs=cap)
        port = await host.start()
        release = asyncio.Event()
        try:
            own = [("grpc.use_local_subchannel_pool", 1)]  # two connections, not one shared
            async with aio.insecure_channel(f"127.0.0.1:{port}", options=own) as attacker, \
                    aio.insecure_channel(f"127.0.0.1:{port}", options=own) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                checks = await _stalled_calls(attacker, "/grpc.health.v1.Health/Check", CONTROL_RPC_RESERVE + 16,
                                              release)
                # at once, before any grace period: the reserve still answers
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
                    health_pb2.HealthCheckResponse.SERVING
                gens = await _stalled_calls(attacker, "/kvmesh.v1.Worker/Generate", cap, release)
                assert await _settle(checks, CONTROL_PER_HOST) == CONTROL_PER_HOST
                assert await _settle(gens, DATA_PENDING_PER_HOST) == DATA_PENDING_PER_HOST
                assert {(await c.code()) for c in checks + gens if c.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
                # the rest of the data plane serves others
                out = [m async for m in pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(), timeout=10)]
                assert out[-1].finished
                for c in checks + gens:
                    c.cancel()
        finally:
            release.set()
            await host.server.stop(0)
        return host.admission

    admission = asyncio.run(scenario())
    assert admission.control.total == admission.data_pending.total == admission.cap.active == 0


def test_callers_without_a_peer_certificate_cannot_fill_the_control_plane(monkeypatch, tmp_path):
    """On a TLS port, the control calls of callers without a peer certificate, from however
    many hosts, are bounded in all (`ANONYMOUS_CONTROL_LIMIT`; past it RESOURCE_EXHAUSTED
    saying so) and hold slots of their own in gRPC's limit. Before, ~34 hosts holding 8
    stalled health checks each filled gRPC's whole limit (the data-plane cap plus the
    reserve): a peer's health check (the probes) and its Generate calls were refused."""
    import asyncio

    from grpc import aio

    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.workers.grpc_guard import ANONYMOUS_CONTROL_LIMIT
    from kvmesh.workers.grpc_host import GrpcHost
    from kvmesh.workers.tls import PEER_SERVER_NAME, TlsConfig

    c = generate_cluster_credentials(str(tmp_path / "creds"))
    tls = TlsConfig.from_files(c.cert, c.key, c.ca, client_ca=c.client_ca)  # a router with --client-ca
    read = lambda path: open(path, "rb").read()  # noqa: E731
    # each connection stands for a client host, none of them this machine (every test client
    # is on 127.0.0.1)
    monkeypatch.setattr("kvmesh.workers.grpc_guard.peer_host", lambda peer: peer)
    monkeypatch.setattr("kvmesh.workers.grpc_host.local_peer", lambda peer: False)
    hosts = ANONYMOUS_CONTROL_LIMIT // CONTROL_PER_HOST + 2
    cap = 4

    async def scenario():
        trivial = type("S", (_Trivial, pb_grpc.WorkerServicer), {})()
        host = GrpcHost("127.0.0.1", 0, [(pb_grpc.add_WorkerServicer_to_server, trivial, "kvmesh.v1.Worker")],
                        tls=tls, max_concurrent_rpcs=cap)
        port = await host.start()
        release = asyncio.Event()
        opts = [("grpc.ssl_target_name_override", PEER_SERVER_NAME), ("grpc.use_local_subchannel_pool", 1)]
        # clients of the client CA: callers, not peers
        client = grpc.ssl_channel_credentials(read(c.ca), read(c.client_key), read(c.client_cert))
        peer = grpc.ssl_channel_credentials(read(c.ca), read(c.key), read(c.cert))
        strangers = [aio.secure_channel(f"127.0.0.1:{port}", client, options=opts) for _ in range(hosts)]
        try:
            checks = []
            for ch in strangers:
                checks += await _stalled_calls(ch, "/grpc.health.v1.Health/Check", CONTROL_PER_HOST, release)
            assert await _settle(checks, ANONYMOUS_CONTROL_LIMIT) == ANONYMOUS_CONTROL_LIMIT
            refused = {(await c.code(), await c.details()) for c in checks if c.done()}
            async with aio.secure_channel(f"127.0.0.1:{port}", peer, options=opts) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                served = (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status
                stub = pb_grpc.WorkerStub(ch)
                outs = await asyncio.gather(*[_collect(stub.Generate(pb.GenerateRequest(), timeout=10))
                                              for _ in range(cap)])
            open_now = host.admission.anonymous_control.total
            for call in checks:
                call.cancel()
        finally:
            release.set()
            for ch in strangers:
                await ch.close()
            await host.server.stop(0)
        return refused, served, outs, open_now

    refused, served, outs, open_now = asyncio.run(scenario())
    assert open_now == ANONYMOUS_CONTROL_LIMIT
    assert {code for code, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
    assert all("without a peer certificate" in details for _, details in refused), refused
    assert served == health_pb2.HealthCheckResponse.SERVING
    assert all(out[-1].finished for out in outs)


async def _collect(call) -> list:
    return [m async for m in call]


@pytest.mark.parametrize("local", [True, False])
def test_a_caller_on_the_servers_loopback_counts_as_trusted(monkeypatch, tmp_path, local):
    """A router without a client CA has no peers among its callers, and its pod's probes
    call it without a peer certificate from 127.0.0.1: their control calls count with the
    peers' (`local_peer`), not in the strangers' `ANONYMOUS_CONTROL_LIMIT`. The same caller
    from another host counts there."""
    import asyncio

    from grpc import aio

    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.workers.grpc_host import GrpcHost
    from kvmesh.workers.tls import PEER_SERVER_NAME, TlsConfig

    c = generate_cluster_credentials(str(tmp_path / "creds"))
    tls = TlsConfig.from_files(c.cert, c.key, c.ca)
    if not local:
        monkeypatch.setattr("kvmesh.workers.grpc_host.local_peer", lambda peer: False)

    async def scenario():
        trivial = type("S", (_Trivial, pb_grpc.WorkerServicer), {})()
        host = GrpcHost("127.0.0.1", 0, [(pb_grpc.add_WorkerServicer_to_server, trivial, "kvmesh.v1.Worker")],
                        tls=tls, max_concurrent_rpcs=4)
        port = await host.start()
        release = asyncio.Event()
        creds = grpc.ssl_channel_credentials(open(c.ca, "rb").read())
        try:
            async with aio.secure_channel(f"127.0.0.1:{port}", creds,
                                          options=[("grpc.ssl_target_name_override", PEER_SERVER_NAME)]) as ch:
                calls = await _stalled_calls(ch, "/grpc.health.v1.Health/Check", 2, release)
                await _until(lambda: host.admission.control.total + host.admission.anonymous_control.total >= 2)
                counts = host.admission.control.total, host.admission.anonymous_control.total
                for call in calls:
                    call.cancel()
        finally:
            release.set()
            await host.server.stop(0)
        return counts

    assert asyncio.run(scenario()) == ((2, 0) if local else (0, 2))


def test_reflection_streams_are_bounded_like_watch_streams():
    import asyncio

    from grpc import aio
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from kvmesh.workers.grpc_host import GrpcHost

    async def scenario():
        host = GrpcHost("127.0.0.1", 0, [], reflection_on=True)
        port = await host.start()
        release = asyncio.Event()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)

                async def idle():
                    await release.wait()
                    yield reflection_pb2.ServerReflectionRequest(list_services="")
                held = [stub.ServerReflectionInfo(idle()) for _ in range(WATCH_PER_HOST + 3)]
                assert await _settle(held, WATCH_PER_HOST) == WATCH_PER_HOST
                # reflection itself still works once a stream is free
                for c in held:
                    c.cancel()
                deadline = time.monotonic() + 30  # slots come back when the calls end, not at once
                while host.admission.watches.total and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)

                async def one():
                    yield reflection_pb2.ServerReflectionRequest(list_services="")
                names = [s.name async for r in stub.ServerReflectionInfo(one())
                         for s in r.list_services_response.service]
                assert "grpc.health.v1.Health" in names
                # the server frees the slot when its handler returns, which may be just after
                # the client has read the end of the stream
                deadline = time.monotonic() + 30
                while host.admission.watches.total and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert host.admission.watches.total == 0
        finally:
            release.set()
            await host.server.stop(0)

    asyncio.run(scenario())


class _CountingWorker(pb_grpc.WorkerServicer):
    """Answers Tokenize (unary) and Generate (server streaming) and counts the calls served."""

    def __init__(self) -> None:
        self.served = 0

    async def Tokenize(self, request, context):
        self.served += 1
        return pb.TokenizeResponse(ids=[len(request.text)])

    async def Generate(self, request, context):
        self.served += 1
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[1])
        yield pb.GenerateResponse(request_id=request.request_id, finished=True)


def test_unary_request_methods_take_exactly_one_message():
    """Unary-request methods are served as stream-request ones (to read the message under a
    deadline). A call that sends a second message is refused INVALID_ARGUMENT and not served
    on its first, on unary and server-streaming methods of the data and control planes; a
    call that sends its message and never ends its request stream is bounded by the same
    deadline; normal calls answer as before, and every slot comes back."""
    import asyncio

    from grpc import aio

    from kvmesh.workers.grpc_host import GrpcHost

    timeout_s = 1.0
    tok = pb.TokenizeRequest(text="abc").SerializeToString()
    gen = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[1, 2])).SerializeToString()
    check = health_pb2.HealthCheckRequest().SerializeToString()
    calls = {  # method: (request, response streaming)
        "/kvmesh.v1.Worker/Tokenize": (tok, False),
        "/kvmesh.v1.Worker/Generate": (gen, True),
        "/grpc.health.v1.Health/Check": (check, False),
        "/grpc.health.v1.Health/Watch": (check, True),
    }

    async def scenario():
        worker = _CountingWorker()
        host = GrpcHost("127.0.0.1", 0, [(pb_grpc.add_WorkerServicer_to_server, worker, "kvmesh.v1.Worker")],
                        message_timeout_s=timeout_s)
        port = await host.start()
        release = asyncio.Event()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                async def status(method: str, messages) -> tuple:
                    raw, streaming = calls[method]
                    make = ch.stream_stream if streaming else ch.stream_unary
                    call = make(method, request_serializer=lambda x: x, response_deserializer=lambda b: b)
                    try:
                        if streaming:
                            got = [m async for m in call(messages(raw), timeout=30)]
                            return grpc.StatusCode.OK, got
                        return grpc.StatusCode.OK, await call(messages(raw), timeout=30)
                    except aio.AioRpcError as exc:
                        return exc.code(), exc.details()

                async def two(raw):
                    yield raw
                    yield raw

                async def two_apart(raw):  # the second message comes a little later
                    yield raw
                    await asyncio.sleep(0.1)
                    yield raw

                async def open_after_one(raw):  # never half-closes
                    yield raw
                    await release.wait()

                for method in calls:
                    for messages in (two, two_apart):
                        code, details = await status(method, messages)
                        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
                        assert "takes exactly one request message" in details, details
                    started = time.monotonic()
                    code, details = await status(method, open_after_one)
                    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (method, code, details)
                    assert "did not end its request stream within 1 s" in details, details
                    assert time.monotonic() - started < timeout_s + 5
                assert worker.served == 0  # no call was served on its first message
                # normal clients: unary and server streaming, on both planes
                stub = pb_grpc.WorkerStub(ch)
                assert list((await stub.Tokenize(pb.TokenizeRequest(text="abcd"), timeout=10)).ids) == [4]
                out = [m async for m in stub.Generate(pb.GenerateRequest(request_id="x"), timeout=10)]
                assert [m.finished for m in out] == [False, True]
                health = health_pb2_grpc.HealthStub(ch)
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
                    health_pb2.HealthCheckResponse.SERVING
                watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
                assert worker.served == 2
                a = host.admission
                deadline = time.monotonic() + 30  # slots come back when their calls end
                while (a.control.total or a.watches.total or a.data_pending.total or a.cap.active) and \
                        time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert (a.control.total, a.watches.total, a.data_pending.total, a.cap.active) == (0, 0, 0, 0)
                assert a.timed_out == len(calls)
        finally:
            release.set()
            await host.server.stop(0)

    asyncio.run(scenario())


def test_keepalive_pings_only_to_workers_whose_lease_accepts_them():
    """A router pings (`KEEPALIVE_CHANNEL_OPTIONS`) only workers whose lease states their
    server accepts PINGs at least that often: a worker of an older kvmesh keeps gRPC's
    default policy and would close a silent call's connection as "too many pings". The
    pool keeps the two kinds of channel to one address apart."""
    import asyncio

    from kvmesh.workers.grpc_host import (KEEPALIVE_LEASE_FIELD, KEEPALIVE_TIME_S, SERVER_MIN_PING_INTERVAL_S,
                                          ChannelPool, accepts_keepalive)

    assert SERVER_MIN_PING_INTERVAL_S <= KEEPALIVE_TIME_S  # a router's own workers never refuse its PINGs
    assert accepts_keepalive({KEEPALIVE_LEASE_FIELD: SERVER_MIN_PING_INTERVAL_S})
    for lease in ({}, {KEEPALIVE_LEASE_FIELD: 300.0}, {KEEPALIVE_LEASE_FIELD: True},
                  {KEEPALIVE_LEASE_FIELD: "4"}, {KEEPALIVE_LEASE_FIELD: 0}):
        assert not accepts_keepalive(lease), lease

    made = []

    async def scenario():
        pool = ChannelPool()
        a, b, c = pool.get("127.0.0.1:1"), pool.get("127.0.0.1:1", keepalive=True), pool.get("127.0.0.1:1")
        made.extend([a is c, a is not b])
        await pool.close()

    asyncio.run(scenario())
    assert made == [True, True]


def test_silent_connections_are_closed_and_capped():
    """A stranger who opens TCP connections and never starts a handshake held each one for
    gRPC's default 120 s, with no cap: enough of them took every descriptor of the process
    and nobody could connect. A connection now has ``handshake_timeout_s`` to finish its
    handshake, and past ``max_connections`` new ones are closed at accept."""
    import asyncio
    import socket

    from grpc import aio

    from kvmesh.workers.grpc_host import GrpcHost, max_incoming_connections

    assert 16 <= max_incoming_connections() <= 4096

    def closed_by_server(sock, within_s):
        """Whether the server closes ``sock`` within ``within_s`` (what it sends first, e.g. a
        plaintext server's HTTP/2 SETTINGS, is read and dropped)."""
        end = time.monotonic() + within_s
        try:
            while time.monotonic() < end:
                sock.settimeout(max(0.01, end - time.monotonic()))
                if sock.recv(4096) == b"":
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            pass
        return False

    async def check(host, timeout):
        async with aio.insecure_channel(f"127.0.0.1:{host.port}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def scenario():
        quick = GrpcHost("127.0.0.1", 0, [], handshake_timeout_s=0.5)
        capped = GrpcHost("127.0.0.1", 0, [], handshake_timeout_s=600, max_connections=2)
        quick.port = await quick.start()
        capped.port = await capped.start()
        try:
            silent = socket.create_connection(("127.0.0.1", quick.port))
            assert await asyncio.to_thread(closed_by_server, silent, 60.0)  # was held 120 s
            silent.close()
            held = [socket.create_connection(("127.0.0.1", capped.port)) for _ in range(2)]
            with pytest.raises(aio.AioRpcError) as err:  # the cap is taken: refused at accept
                await check(capped, 2.0)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            for sock in held:
                sock.close()
            deadline = time.monotonic() + 30
            while True:  # the server sees the close on its next read
                try:
                    assert await check(capped, 5.0)
                    break
                except aio.AioRpcError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
        finally:
            await quick.server.stop(0)
            await capped.server.stop(0)

    asyncio.run(scenario())


def test_a_burst_of_calls_is_answered_or_refused_never_cancelled():
    """gRPC core drops calls at random past 1,000 waiting for the Python server (a bare
    CANCELLED, which callers read as their own cancellation and never retry): 2,000 calls
    at once lost 363 of them. Every call of a burst is now answered or refused with a
    status that says why."""
    import asyncio
    import collections

    from grpc import aio

    from kvmesh.workers.grpc_host import GrpcHost

    async def scenario():
        host = GrpcHost("127.0.0.1", 0, [], max_concurrent_rpcs=16)
        port = await host.start()
        codes: collections.Counter = collections.Counter()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                check = health_pb2_grpc.HealthStub(ch).Check

                async def one():
                    try:
                        await check(health_pb2.HealthCheckRequest(), timeout=120)
                        codes[grpc.StatusCode.OK] += 1
                    except aio.AioRpcError as exc:
                        codes[exc.code()] += 1

                await asyncio.gather(*(one() for _ in range(2000)))
        finally:
            await host.server.stop(0)
        return codes

    codes = asyncio.run(scenario())
    assert sum(codes.values()) == 2000
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes[grpc.StatusCode.OK] > 0


def test_a_verified_peer_is_not_held_to_the_per_host_bound_on_slow_messages(tmp_path):
    """A busy worker's event loop can miss the grace in which a call's message counts as
    sent with it, and a router's relayed calls were then refused RESOURCE_EXHAUSTED as slow
    senders (`DATA_PENDING_PER_HOST`) while the worker had room. A caller with a peer
    certificate is not held to that bound (strangers still are: see the test above)."""
    import asyncio

    from grpc import aio

    from kvmesh.services.credentials import generate_cluster_credentials
    from kvmesh.workers.grpc_guard import DATA_PENDING_PER_HOST
    from kvmesh.workers.grpc_host import GrpcHost
    from kvmesh.workers.tls import PEER_SERVER_NAME, TlsConfig

    c = generate_cluster_credentials(str(tmp_path / "creds"))
    tls = TlsConfig.from_files(c.cert, c.key, c.ca, c.client_ca)
    n = DATA_PENDING_PER_HOST + 4

    async def scenario():
        trivial = type("S", (_Trivial, pb_grpc.WorkerServicer), {})()
        host = GrpcHost("127.0.0.1", 0, [(pb_grpc.add_WorkerServicer_to_server, trivial, "kvmesh.v1.Worker")],
                        tls=tls, max_concurrent_rpcs=n + 4)
        port = await host.start()
        release = asyncio.Event()
        creds = grpc.ssl_channel_credentials(open(c.ca, "rb").read(), open(c.key, "rb").read(),
                                             open(c.cert, "rb").read())
        try:
            async with aio.secure_channel(f"127.0.0.1:{port}", creds,
                                          options=[("grpc.ssl_target_name_override", PEER_SERVER_NAME)]) as ch:
                gens = await _stalled_calls(ch, "/kvmesh.v1.Worker/Generate", n, release)
                await _until(lambda: host.admission.cap.active >= n)
                open_calls = await _settle(gens, n, timeout=1.0)
                for call in gens:
                    call.cancel()
        finally:
            release.set()
            await host.server.stop(0)
        return open_calls

    assert asyncio.run(scenario()) == n
