"""A worker drains on SIGTERM/SIGINT: real `kvmesh worker` processes over gRPC on loopback.

During the drain new data-plane calls (Generate, Tokenize, FetchBlocks) get UNAVAILABLE
with a message saying the worker is shutting down, health reports NOT_SERVING, GetLoad
still answers, and requests already running finish with all their tokens. Past
``--drain-timeout-s``, or at a second signal, the requests still running end UNAVAILABLE
("stopped before the request finished; retry") and the process exits 0, with one WARNING
line instead of grpc.aio's tracebacks. With Redis, the lease goes as the drain starts and a
router stops choosing the worker; the engine's stop (the disk tier's flush) still follows.

Nothing here waits a fixed time for something to happen: every wait polls a condition
under a deadline sized for a busy 2-core machine, and each generation is long (thousands
of tokens past EOS, ``--threads 1``) so that the drain overlaps it by many seconds.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.cache_store.hashing import HASH_BYTES
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

#: Context and pool of the workers here: room for a generation of thousands of tokens.
WORKER_FLAGS = ("--max-model-len", "4096", "--num-blocks", "1024")
#: Generous bounds (seconds) for a loaded machine: to see a condition, for a process to exit.
SEE_S = 60.0
EXIT_S = 90.0
PROMPT = "hello world this is a test"


def _generate_request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class _Stream(threading.Thread):
    """Reads one Generate stream on its own thread: the messages, then the error (if any)."""

    def __init__(self, address: str, max_tokens: int):
        super().__init__(daemon=True)
        self.address = address
        self.request = _generate_request(max_tokens)
        self.messages: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.first = threading.Event()   # a first message (or the end) came
        self.ended = threading.Event()
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                for msg in pb_grpc.WorkerStub(ch).Generate(self.request, timeout=600):
                    self.messages.append(msg)
                    self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.ended.set()
            self.first.set()

    def tokens(self) -> int:
        return sum(len(m.token_ids) for m in self.messages)

    def start_streaming(self) -> "_Stream":
        """Start, and return once the first tokens came (the request is running)."""
        self.start()
        assert self.first.wait(SEE_S), "no token within the deadline"
        assert not self.ended.is_set(), f"the generation ended at once: {self.error}"
        return self


def _poll(what: str, check, timeout: float = SEE_S, every: float = 0.05):
    """``check()`` until it returns something truthy; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not seen within {timeout:g} s: {what}"
        time.sleep(every)


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _exit_code(proc: subprocess.Popen, timeout: float = EXIT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running {timeout:g} s after the drain should have ended (log {proc.log_path})")


def _log(proc: subprocess.Popen) -> str:
    with open(proc.log_path, encoding="utf-8", errors="replace") as fh:
        fh.seek(proc.log_offset)
        return fh.read()


def _refused(call) -> grpc.RpcError:
    """The error of ``call()`` (a Generate stream is read to its end), which must fail."""
    with pytest.raises(grpc.RpcError) as err:
        out = call()
        if not isinstance(out, pb.TokenizeResponse):
            list(out)
    return err.value


def test_a_request_running_at_sigterm_finishes_with_all_its_tokens(spawn_worker):
    """(a) SIGTERM while a long generation streams: it ends normally (every token, finish
    reason, usage), after the drain began, and the worker then exits 0."""
    address, proc = spawn_worker(*WORKER_FLAGS, "--drain-timeout-s", "600")
    max_tokens = 1000
    stream = _Stream(address, max_tokens).start_streaming()
    proc.send_signal(signal.SIGTERM)
    _poll("health NOT_SERVING (the drain began)",
          lambda: _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING)
    assert not stream.ended.is_set(), "the generation ended before the drain was seen: make it longer"
    assert stream.ended.wait(600), "the generation did not finish"
    assert stream.error is None, f"{stream.error.code()}: {stream.error.details()}"
    last = stream.messages[-1]
    assert last.finished and last.finish_reason == "length"
    assert stream.tokens() == max_tokens == last.usage.completion_tokens
    assert _exit_code(proc) == 0
    log = _log(proc)
    assert "Traceback" not in log and " ERROR " not in log, log


def test_requests_during_the_drain_are_refused_unavailable_at_once(spawn_worker):
    """(b) After SIGTERM, with a request still running: new Generate, Tokenize and FetchBlocks
    calls get UNAVAILABLE saying the worker shuts down and to retry elsewhere, promptly;
    GetLoad (control plane) still answers. A second SIGTERM then stops the worker at once."""
    address, proc = spawn_worker(*WORKER_FLAGS, "--drain-timeout-s", "600")
    stream = _Stream(address, 4000).start_streaming()
    proc.send_signal(signal.SIGTERM)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.WorkerStub(ch)

        def refused_generate():
            try:
                list(stub.Generate(_generate_request(4), timeout=30))
            except grpc.RpcError as exc:
                return exc if exc.code() == grpc.StatusCode.UNAVAILABLE else None
            return None  # served: the drain has not begun yet

        err = _poll("a new Generate refused UNAVAILABLE", refused_generate)
        assert "shutting down" in err.details() and "retry on another worker" in err.details(), err.details()
        calls = {
            "Generate": lambda: stub.Generate(_generate_request(4), timeout=30),
            "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=30),
            "FetchBlocks": lambda: stub.FetchBlocks(pb.FetchBlocksRequest(block_hashes=[b"\0" * HASH_BYTES]),
                                                    timeout=30),
        }
        for name, call in calls.items():
            started = time.monotonic()
            err = _refused(call)
            took = time.monotonic() - started
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (name, err.code(), err.details())
            assert "shutting down" in err.details() and "retry" in err.details(), (name, err.details())
            assert took < 10.0, f"{name} refused after {took:.1f} s"
        load = stub.GetLoad(pb.LoadRequest(), timeout=10)
        assert load.running_requests == 1, load
        assert not stream.ended.is_set(), "the long generation ended during the checks: make it longer"
    proc.send_signal(signal.SIGTERM)  # the second signal: no more waiting
    assert stream.ended.wait(SEE_S), "the second SIGTERM did not end the running request"
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "stopped before the request finished; retry" in stream.error.details(), stream.error.details()
    assert _exit_code(proc) == 0
    log = _log(proc)
    assert "Traceback" not in log, log
    assert "while draining: stopping now" in log and "1 request(s) still running on a second signal" in log, log


def test_past_the_drain_timeout_a_request_is_cut_unavailable_and_the_worker_exits(spawn_worker):
    """(c) With a tiny --drain-timeout-s a long generation is ended UNAVAILABLE ("stopped
    before the request finished; retry") soon after SIGTERM, and the process exits 0 within
    a bounded time, logging one WARNING line with the count and no traceback."""
    address, proc = spawn_worker(*WORKER_FLAGS, "--drain-timeout-s", "0.5")
    stream = _Stream(address, 4000).start_streaming()
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert stream.ended.wait(SEE_S), "the request was not cut"
    assert stream.error is not None, f"finished with {stream.tokens()} tokens: make the generation longer"
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error.code()
    assert stream.error.details() == f"worker {_worker_id(address)} stopped before the request finished; retry"
    assert 0 < stream.tokens() < 4000
    code = _exit_code(proc)
    assert code == 0, f"exit {code}; log:\n{_log(proc)}"
    assert stream.ended_at - signalled < SEE_S
    log = _log(proc)
    assert "Traceback" not in log and " ERROR " not in log, log
    lines = [ln for ln in log.splitlines() if "still running at the drain deadline" in ln]
    assert len(lines) == 1 and " WARNING " in lines[0] and ": 1 request(s)" in lines[0], log


def test_health_reports_not_serving_during_the_drain(spawn_worker):
    """(d) Health is SERVING before SIGTERM and NOT_SERVING (for "" and kvmesh.v1.Worker)
    while a request still runs; SIGINT then stops the worker at once."""
    address, proc = spawn_worker(*WORKER_FLAGS, "--drain-timeout-s", "600")
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(address) == serving and _health(address, "kvmesh.v1.Worker") == serving
    stream = _Stream(address, 4000).start_streaming()
    proc.send_signal(signal.SIGTERM)
    _poll("health NOT_SERVING", lambda: _health(address) == not_serving)
    assert _health(address, "kvmesh.v1.Worker") == not_serving
    assert not stream.ended.is_set(), "the generation ended before the checks: make it longer"
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    assert stream.ended.wait(SEE_S)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert _exit_code(proc) == 0


def test_the_lease_goes_when_the_drain_starts(spawn_worker, redis_server):
    """With Redis, the worker's lease (what routers route by) is deleted as the drain
    starts, while a request it runs still streams."""
    import redis

    from kvmesh.workers.kv_publisher import lease_key

    cluster = "drain"
    address, proc = spawn_worker(*WORKER_FLAGS, "--drain-timeout-s", "600", "--redis-url", redis_server.url,
                                 "--cluster", cluster)
    wid = _worker_id(address)
    r = redis.Redis.from_url(redis_server.url)
    try:
        _poll("the worker's lease", lambda: r.exists(lease_key(wid, cluster)))
        stream = _Stream(address, 4000).start_streaming()
        proc.send_signal(signal.SIGTERM)
        _poll("the lease deleted", lambda: not r.exists(lease_key(wid, cluster)))
        assert not stream.ended.is_set(), "the generation ended before the lease went: make it longer"
        proc.send_signal(signal.SIGTERM)
        assert stream.ended.wait(SEE_S)
        assert _exit_code(proc) == 0
        assert not r.exists(lease_key(wid, cluster))
    finally:
        r.close()


def test_the_tier_flush_still_runs_after_a_drain(spawn_worker, tmp_path):
    """The stop steps after the drain still run: a write-back disk tier gets the cached
    blocks only at the stop, so a worker restarted on the same folder after a drain that
    cut a request serves an earlier prompt from disk."""
    disk = str(tmp_path / "disk")
    tiers = ("--max-model-len", "4096", "--num-blocks", "512", "--host-bytes", "64M", "--disk-dir", disk,
             "--disk-bytes", "256M", "--disk-write-mode", "back")
    prompt = "the drain must not skip the flush of the disk tier. " * 4  # a few blocks of the byte tokenizer
    request = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    address, proc = spawn_worker(*tiers, "--drain-timeout-s", "0.5", worker_id="flush")
    with grpc.insecure_channel(address) as ch:
        first = list(pb_grpc.WorkerStub(ch).Generate(request, timeout=SEE_S))[-1]
    assert first.usage.cached_tokens == 0
    stream = _Stream(address, 4000).start_streaming()
    proc.send_signal(signal.SIGTERM)
    assert stream.ended.wait(SEE_S) and stream.error is not None  # cut at the deadline
    assert _exit_code(proc) == 0
    address, _ = spawn_worker(*tiers, worker_id="flush")
    with grpc.insecure_channel(address) as ch:
        again = list(pb_grpc.WorkerStub(ch).Generate(request, timeout=SEE_S))[-1]
    assert again.usage.cached_tokens_by_tier["disk"] > 0, again.usage


def test_a_router_stops_choosing_a_draining_worker(tmp_path):
    """A router, two workers and Redis (`LocalCluster`): once worker A starts draining (a
    long request of its own keeps it draining), every request sent to the router is
    answered, by worker B: the router retries the UNAVAILABLE refusal of the half second
    before it sees A's lease go, and then no longer lists A."""
    from kvmesh.services.launcher import ClusterSpec, LocalCluster

    spec = ClusterSpec(num_workers=2, num_blocks=1024, threads_per_worker=1, log_dir=str(tmp_path),
                       extra_worker_args=["--max-model-len", "4096", "--drain-timeout-s", "600"])
    with LocalCluster(spec) as c, grpc.insecure_channel(c.router_address) as ch:
        router = pb_grpc.RouterStub(ch)

        def routed() -> set[str]:
            return {w.worker_id for w in router.Status(pb.RouterStatusRequest(), timeout=10).workers
                    if not w.routed_around}

        _poll("both workers routed to", lambda: len(routed()) == 2)
        (a_id, (a_address, a_proc)), (b_id, _) = sorted(c.workers.items())
        stream = _Stream(a_address, 4000).start_streaming()
        a_proc.send_signal(signal.SIGTERM)
        for i in range(3):  # right after the signal: some may pick A, be refused and be retried
            out = list(router.Generate(pb.GenerateRequest(text=f"{PROMPT} {i}", sampling=pb.SamplingParams(
                max_tokens=4, ignore_eos=True)), timeout=SEE_S))
            assert out[-1].finished and out[-1].worker_id == b_id, out[-1]
        _poll("the router no longer lists the draining worker", lambda: routed() == {b_id})
        for i in range(3):
            out = list(router.Generate(pb.GenerateRequest(text=f"{PROMPT} again {i}", sampling=pb.SamplingParams(
                max_tokens=4, ignore_eos=True)), timeout=SEE_S))
            assert out[-1].worker_id == b_id
        assert not stream.ended.is_set(), "A's own request ended before the checks: make it longer"
        a_proc.send_signal(signal.SIGTERM)
        assert stream.ended.wait(SEE_S)
        assert _exit_code(a_proc) == 0


def _worker_id(address: str) -> str:
    """The id `spawn_worker` gives the worker at ``address`` (``w<port>``)."""
    return "w" + address.rsplit(":", 1)[1]


def test_drain_timeout_must_be_a_finite_non_negative_number():
    from kvmesh.services.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["worker", "--port", "1"]).drain_timeout_s == 30.0
    assert parser.parse_args(["worker", "--port", "1", "--drain-timeout-s", "0"]).drain_timeout_s == 0.0
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["worker", "--port", "1", "--drain-timeout-s", bad])


def test_calls_that_ignore_the_cut_still_end_unavailable(monkeypatch, caplog):
    """In-process `GrpcHost.drain`: a unary call stuck in an await is cut by cancelling its
    task; a stream that said it would stop itself (``on_cut``) but does not has its task
    cancelled `CUT_WAIT_S` later. Both callers get UNAVAILABLE with the cut message, and the
    log has WARNING lines with the counts, no ERROR."""
    import asyncio
    import logging

    from grpc import aio

    from kvmesh.workers import grpc_host
    from kvmesh.workers.grpc_host import GrpcHost

    monkeypatch.setattr(grpc_host, "CUT_WAIT_S", 0.2)
    caplog.set_level(logging.INFO)
    cut = "worker t stopped before the request finished; retry"

    async def scenario():
        gate = grpc_host.DrainGate("worker t")
        forever = asyncio.Event()

        class Stuck(pb_grpc.WorkerServicer):
            async def Tokenize(self, request, context):  # cut by cancellation (no on_cut)
                async with gate.call(context):
                    await forever.wait()

            async def Generate(self, request, context):  # says it stops itself, then never does
                async with gate.call(context) as call:
                    call.on_cut = lambda: None
                    yield pb.GenerateResponse(token_ids=[1])
                    await forever.wait()

        host = GrpcHost("127.0.0.1", 0, [(pb_grpc.add_WorkerServicer_to_server, Stuck(), "kvmesh.v1.Worker")],
                        drain=gate, name="worker t")
        port = await host.start()
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.WorkerStub(ch)
            tokenize = asyncio.ensure_future(stub.Tokenize(pb.TokenizeRequest(text="x"), timeout=60))
            stream = stub.Generate(pb.GenerateRequest(), timeout=60)
            await stream.read()
            while gate.active < 2:
                await asyncio.sleep(0.01)
            await host.drain(0.1)
            assert gate.active == 0
            with pytest.raises(aio.AioRpcError) as err:
                await tokenize
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, cut)
            assert (await stream.code(), await stream.details()) == (grpc.StatusCode.UNAVAILABLE, cut)

    asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("2 request(s) still running at the drain deadline" in m for m in warnings), warnings
    assert any("1 request(s) had not ended 0.2 s after the cut" in m for m in warnings), warnings


def test_grpc_tracebacks_of_calls_cancelled_at_stop_are_counted_not_logged():
    """The filter `GrpcHost.drain` puts on grpc.aio's logger during the stop: a record
    carrying a CancelledError is dropped and counted; any other passes."""
    import asyncio
    import logging

    from kvmesh.workers.grpc_host import _CancelledAtStop

    quiet = _CancelledAtStop()

    def record(exc):
        return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1, "not handled", (),
                                 (type(exc), exc, None) if exc is not None else None)

    assert not quiet.filter(record(asyncio.CancelledError()))
    assert quiet.filter(record(ValueError("a real error"))) and quiet.filter(record(None))
    assert quiet.dropped == 1
