"""Reliability under hostile or heavy input, on a real redis-server, worker and router.

* A long prefill never takes its worker out of the cluster: the lease, health, GetLoad
  and the router's view stay live while the engine thread is busy for seconds.
* Size limits: an over-long prompt or a ~64 MiB body is refused in milliseconds, and the
  next request works.
* Bad sampling values (NaN / negative top_p) are INVALID_ARGUMENT; ``--max-waiting`` is
  a flag.
* Fuzz: malformed bodies to the worker and the router get no UNKNOWN and no hang, and
  memory comes back (`bench.fuzz`). The default counts are reduced to keep the suite
  quick (400 to the worker, 200 to the router, after 200 warm-up requests each);
  ``KVMESH_FUZZ_FULL=1`` runs the full 5,000 and 2,000 after 500 warm-up requests.
"""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import threading
import time

import grpc
import pytest

from kvmesh.bench.fuzz import rss_kib, run_fuzz
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.services.cli import generate
from kvmesh.services.launcher import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow
FULL_FUZZ = os.environ.get("KVMESH_FUZZ_FULL") == "1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(num_workers=1, num_blocks=2048, threads_per_worker=1,
                       log_dir=str(tmp_path_factory.mktemp("logs")))
    with LocalCluster(spec) as c:
        yield c


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def status(address: str) -> pb.RouterStatus:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RouterStub(ch).Status(pb.RouterStatusRequest(), timeout=5)


def worker_address(cluster) -> str:
    return next(iter(cluster.workers.values()))[0]


def worker_pid(cluster) -> int:
    return next(iter(cluster.workers.values()))[1].pid


def test_long_prefill_keeps_worker_live(cluster):
    """While long prompts are prefilled back to back (seconds of model steps), a probe
    asking the router every 100 ms never gets UNAVAILABLE, and the router lists the worker
    all along and sees it busy. The worker's own GetLoad answers while a step runs."""
    router = cluster.router_address
    worker = worker_address(cluster)
    # The worker's control plane answers *during* a model step, not after it. Shown by what
    # it answers, not by how fast: the engine publishes, under its lock and before a step's
    # forward, the load that step is busy with, and replaces it (still under the lock) once
    # the step is done. A prompt alone on the worker, scheduled but with none of its tokens
    # computed yet, is therefore a load only a reader that did not wait for the lock can see.
    long_len = 4_000
    mid_step: list = []
    with grpc.insecure_channel(worker) as ch:
        load_stub = pb_grpc.WorkerStub(ch)
        for attempt in range(5):  # each prompt's first step is one chance to catch it
            failed: list = []

            def run_alone(seed=50 + attempt):
                try:
                    generate(worker, token_ids=toks(seed, long_len), max_tokens=1, timeout=300)
                except grpc.RpcError as exc:
                    failed.append(exc.code())

            th = threading.Thread(target=run_alone, daemon=True)
            th.start()
            while th.is_alive() and not mid_step:
                ld = load_stub.GetLoad(pb.LoadRequest(), timeout=30)  # the deadline only against a hang
                if (ld.running_requests, ld.waiting_requests, ld.queued_prefill_tokens) == (1, 0, long_len - 1):
                    mid_step.append(ld)
            th.join(300)
            assert not failed and not th.is_alive(), failed
            if mid_step:
                break
    assert mid_step, "GetLoad never answered during a step: it waits for the engine's steps"
    # 4K tokens: four chunked steps of 1024 back to back, several seconds on 2 busy
    # cores -- the lease heartbeat used to starve behind them on the engine lock
    # Long prompts are sent back to back until the router has reported the worker busy a few
    # times (a fast engine finishes one before the lease's load reaches the router).
    done, stop = threading.Event(), threading.Event()
    result: dict = {}

    def run_long():
        try:
            i = 0
            while not stop.is_set():
                result["out"] = generate(router, token_ids=toks(100 + i, 4_000), max_tokens=1, timeout=300)
                i += 1
        except grpc.RpcError as exc:
            result["code"] = exc.code()
        finally:
            done.set()

    codes: list = []
    probes: list[threading.Thread] = []

    def probe(i: int):
        try:
            generate(router, token_ids=toks(1000 + i, 8), max_tokens=1, timeout=120)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)

    busy_seen = 0
    listed = 0
    polls = 0
    long_polls = 0
    t0 = time.monotonic()
    threading.Thread(target=run_long, daemon=True).start()
    with grpc.insecure_channel(worker) as ch:
        load_stub = pb_grpc.WorkerStub(ch)
        while not done.is_set() and time.monotonic() - t0 < 240:
            th = threading.Thread(target=probe, args=(len(probes),), daemon=True)
            th.start()
            probes.append(th)
            st = status(router)
            polls += 1
            if any(w.address == worker for w in st.workers):
                listed += 1
            if any(w.load.running_requests > 0 for w in st.workers):
                busy_seen += 1
            # the worker's own control plane keeps answering (during a step: shown above);
            # more prompt tokens queued than the probes (8 each) can hold: a long prefill
            # is under way as this poll's probe goes out
            ld = load_stub.GetLoad(pb.LoadRequest(), timeout=30)  # the deadline only against a hang
            if ld.queued_prefill_tokens > 8 * (ld.running_requests + ld.waiting_requests):
                long_polls += 1
            if busy_seen >= 3 and long_polls >= 3 and time.monotonic() - t0 > 2.0:
                stop.set()
            time.sleep(0.1)
    stop.set()
    done.wait(300)
    for th in probes:
        th.join(180)
    assert done.is_set()
    assert "out" in result, result
    assert long_polls > 0, "no probe went out while the worker was prefilling a long prompt"
    assert codes and "UNAVAILABLE" not in codes, codes
    assert all(c == "OK" for c in codes), codes
    assert listed == polls, f"worker missing from the router's view in {polls - listed} of {polls} polls"
    assert busy_seen > 0, "the router never saw the worker busy"


def test_long_prefill_probe_bench_runs(cluster):
    """`bench.long_prefill_probe` (the 32K-token check for an operator's cluster), short."""
    from kvmesh.bench.long_prefill_probe import probe

    out = probe(cluster.router_address, 600, interval_s=0.1)
    assert out["probes"] and out["probes"].get("UNAVAILABLE", 0) == 0
    assert out["polls_with_every_worker"] == out["status_polls"] > 0
    assert out["worker_id"] == "worker-0"


def test_engine_load_does_not_wait_for_a_step():
    """`Engine.load` answers while another thread holds the engine lock (as a step does)."""
    from kvmesh.workers.engine import Engine

    engine = Engine(num_blocks=64)
    holding = threading.Event()
    release = threading.Event()
    held = []  # True while the lock is held; the holder lets go only once released (or after 30 s)

    def hold():
        with engine._lock:
            held.append(True)
            holding.set()
            release.wait(30)
            held.clear()  # still under the lock: a load() that waited for it sees this

    th = threading.Thread(target=hold)
    th.start()
    try:
        assert holding.wait(30)
        load = engine.load()
        # answered while the lock was still held (it is released only below), not after
        assert held == [True], "load() waited for the engine lock"
        assert load["total_blocks"] == 64 and load["free_blocks"] == 64
    finally:
        release.set()
        th.join()


def _raw_generate(address: str, body: bytes, timeout: float = 30.0) -> grpc.StatusCode:
    return _raw_generate_status(address, body, timeout)[0]


def _raw_generate_status(address: str, body: bytes, timeout: float = 30.0) -> tuple[grpc.StatusCode, str]:
    opts = [("grpc.max_send_message_length", 256 << 20)]
    with grpc.insecure_channel(address, options=opts) as ch:
        call = ch.unary_stream("/kvmesh.v1.Worker/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        try:
            for _ in call(body, timeout=timeout):
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("target", ["router", "worker"])
def test_huge_body_refused_fast(cluster, target):
    """A ~64 MiB body and an over-long prompt are refused by the cheap checks, before any
    work proportional to the prompt (tokenizing, hashing, forwarding): told by the refusal
    itself, which names the check that made it, not by a clock."""
    address = cluster.router_address if target == "router" else worker_address(cluster)
    pid = cluster.router_proc.pid if target == "router" else worker_pid(cluster)
    generate(address, token_ids=toks(7, 40), max_tokens=2)  # warm
    rss0 = rss_kib(pid)
    body = pb.GenerateRequest(text="x" * (64 * 1024 * 1024 - 1024)).SerializeToString()
    code, details = _raw_generate_status(address, body)
    # the transport's message cap (the body is never parsed), or the size check made before
    # tokenizing (`limits.check_prompt_size`: it counts the text's bytes)
    assert (code, "larger than max" in details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, True) or \
        (code, "prompt text has" in details) == (grpc.StatusCode.INVALID_ARGUMENT, True), (code, details)
    # a prompt just over the model's context as token ids: INVALID_ARGUMENT naming the limit
    ids = pb.GenerateRequest()
    ids.token_ids.ids.extend([1] * 40_000)
    with pytest.raises(grpc.RpcError) as err:
        generate(address, token_ids=[1] * 40_000, max_tokens=1, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context" in err.value.details()
    # refused by the count of ids (`limits.check_prompt_size`), by the router itself when it
    # is the target (it names the workers' model), not forwarded to a worker or computed
    where = "the workers' model" if target == "router" else "the model"
    assert f"prompt has 40000 tokens but {where}'s context" in err.value.details(), err.value.details()
    # the next request works, and memory is back
    out = generate(address, token_ids=toks(8, 40), max_tokens=2, timeout=60)
    assert len(out["token_ids"]) == 2
    assert rss_kib(pid) < rss0 * 1.10 + 8 * 1024, (rss0, rss_kib(pid))


@pytest.mark.parametrize("field,value", [("top_p", math.nan), ("top_p", -0.5), ("top_p", 1.5),
                                         ("temperature", math.nan)])
def test_bad_sampling_values(cluster, field, value):
    for address in (cluster.router_address, worker_address(cluster)):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2))
        setattr(req.sampling, field, value)
        req.token_ids.ids.extend(toks(9, 20))
        assert _raw_generate(address, req.SerializeToString()) == grpc.StatusCode.INVALID_ARGUMENT


def test_max_waiting_flag_checked():
    proc = subprocess.run([sys.executable, "-m", "kvmesh.services.cli", "worker", "--max-waiting", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--max-waiting" in proc.stderr


def test_max_waiting_caps_the_queue():
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.request import Overloaded, SamplingParams

    engine = Engine(num_blocks=64, max_waiting=2)  # not started: submissions stay queued
    sp = SamplingParams(max_tokens=1)
    engine.submit([1, 2, 3], sp, lambda o: None)
    engine.submit([1, 2, 3], sp, lambda o: None)
    with pytest.raises(Overloaded, match="2 waiting"):
        engine.submit([1, 2, 3], sp, lambda o: None)


def _check_fuzz(report, log_path: str | None, rss: bool = True):
    d = report.to_dict()
    assert report.alive, d
    assert report.unknown == 0, d
    assert report.hangs == 0, d
    assert report.codes.get("INTERNAL", 0) == 0, d
    if rss:
        assert report.rss_growth is not None and report.rss_growth <= 0.10, d
    if log_path:
        with open(log_path, errors="replace") as fh:
            assert "Traceback" not in fh.read(), f"traceback in {log_path}"


def test_fuzz_worker(cluster):
    n = 5000 if FULL_FUZZ else 400
    _fuzz_twice(worker_address(cluster), n, os.path.join(cluster.log_dir, "worker-0.log"), pid=worker_pid(cluster),
                seed=1, deadline_s=30.0, warmup=500 if FULL_FUZZ else 200)


def test_fuzz_router(cluster):
    n = 2000 if FULL_FUZZ else 200
    _fuzz_twice(cluster.router_address, n, os.path.join(cluster.log_dir, "router.log"), router=True,
                pid=cluster.router_proc.pid, seed=2, warmup=500 if FULL_FUZZ else 200, deadline_s=30.0)


def _fuzz_twice(target: str, n: int, log_path: str, **kw) -> None:
    """Two fuzz runs of ``n`` requests: every check on both, the RSS bound on the second.
    One-off allocations the warm-up did not reach (a channel to the other worker, a thread's
    malloc arena: up to ~10 % of an 80 MB router) land in the first run; a leak grows in
    both, so the second run's growth is the one that tells."""
    first = run_fuzz(target, n, **kw)
    assert first.sent == n
    _check_fuzz(first, log_path, rss=False)
    second = run_fuzz(target, n, **{**kw, "warmup": 0, "seed": kw["seed"] + 100})
    assert second.sent == n
    _check_fuzz(second, log_path)


def test_worker_refuses_tokens_of_another_model(cluster):
    """A request made for another model identity (a client's model_id, or a router's stale
    view) is refused with FAILED_PRECONDITION. The worker logs it as the caller's error: a
    WARNING, not an ERROR telling the operator to change --model, and rate-limited, so a
    client sending many ids cannot fill the log."""
    from kvmesh.workers.grpc_guard import LOG_BURST

    address = worker_address(cluster)
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1))
    req.token_ids.ids.extend(toks(11, 20))
    sent = 4 * LOG_BURST  # well within two log windows
    for i in range(sent):
        req.model_id = f"some-other-model-{i}@0123456789ab"
        assert _raw_generate(address, req.SerializeToString()) == grpc.StatusCode.FAILED_PRECONDITION
    req.model_id = ""  # unset: accepted as before
    assert _raw_generate(address, req.SerializeToString()) == grpc.StatusCode.OK
    with open(os.path.join(cluster.log_dir, "worker-0.log"), errors="replace") as fh:
        lines = [line for line in fh if "some-other-model-" in line]
    assert lines and all(" WARNING " in line for line in lines), lines[:3]
    assert "'some-other-model-0@0123456789ab'" in lines[0]
    assert len(lines) <= 2 * LOG_BURST < sent, len(lines)


def _router_call(address: str, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        try:
            for _ in pb_grpc.RouterStub(ch).Generate(req, timeout=60):
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_router_refuses_a_model_id_its_workers_do_not_serve(cluster):
    """A client's model_id is checked by the router against what its workers serve: another
    id is NOT_FOUND naming the served one and never reaches a worker (whose log stays
    clean); the served id (as the worker reports it) and an empty one are routed."""
    from kvmesh.workers.model_identity import base_model_id

    with grpc.insecure_channel(worker_address(cluster)) as ch:
        served = pb_grpc.WorkerStub(ch).GetInfo(pb.WorkerInfoRequest(), timeout=10).model_id
    assert served
    req = pb.GenerateRequest(model_id="a-client-typo@000000000000", sampling=pb.SamplingParams(max_tokens=1))
    req.token_ids.ids.extend(toks(12, 20))
    code, details = _router_call(cluster.router_address, req)
    assert code == grpc.StatusCode.NOT_FOUND, (code, details)
    assert "'a-client-typo@000000000000'" in details and repr(served) in details, details
    req.text = "hello there, a text prompt"  # tokenized by the router: refused the same way
    assert _router_call(cluster.router_address, req)[0] == grpc.StatusCode.NOT_FOUND
    for name in ("worker-0.log", "router.log"):
        with open(os.path.join(cluster.log_dir, name), errors="replace") as fh:
            assert "a-client-typo" not in fh.read(), name
    for model_id in (served, base_model_id(served), ""):
        req.model_id = model_id
        assert _router_call(cluster.router_address, req) == (grpc.StatusCode.OK, ""), model_id


def test_worker_with_another_block_size_is_routed_around(cluster):
    """Runs last in this module: it adds a worker with --block-size 32 to a cluster of 16.
    Every request still succeeds, none goes to the odd worker, and the router logs why."""
    from kvmesh.services.procs import free_port, spawn, stop_process, wait_healthy

    port = free_port()
    cmd = cluster.worker_cmd("odd", port)
    cmd[cmd.index("--block-size") + 1] = "32"
    # the cluster's Redis URL carries a password, so it is in the environment, not in cmd
    proc = spawn(cmd, os.path.join(cluster.log_dir, "odd.log"), env=cluster.child_env())
    try:
        wait_healthy(f"127.0.0.1:{port}", proc=proc, tls=cluster.tls)
        deadline = time.monotonic() + 30
        while not any(w.worker_id == "odd" for w in status(cluster.router_address).workers):
            assert time.monotonic() < deadline, "the odd worker never registered"
            time.sleep(0.2)
        for i in range(6):
            out = generate(cluster.router_address, token_ids=toks(200 + i, 40), max_tokens=2, timeout=60)
            assert out["worker_id"] == "worker-0"
        with open(os.path.join(cluster.log_dir, "router.log"), errors="replace") as fh:
            text = fh.read()
        assert "not routing to worker odd" in text and "--block-size 32" in text
    finally:
        stop_process(proc)


def test_a_frozen_worker_fails_its_calls_and_the_router_retries_elsewhere(tmp_path):
    """A worker that stops answering (SIGSTOP: a hung node, or one the network cut off)
    keeps its TCP connections open. Before, a call routed to it waited for its deadline
    (600 s on the HTTP front by default), also after the router had dropped its lapsed
    lease. A router's channels to workers whose lease accepts them now send keepalive PINGs
    (`grpc_host.KEEPALIVE_CHANNEL_OPTIONS`), and one not acknowledged closes the connection: a call
    that has streamed tokens ends UNAVAILABLE saying the worker went away, and one that has
    streamed nothing is retried on another worker and answered, both long before the
    deadline they were given."""
    import signal

    spec = ClusterSpec(num_workers=2, num_blocks=1024, threads_per_worker=1, log_dir=str(tmp_path / "logs"))
    deadline_s = 120.0
    with LocalCluster(spec) as c:
        pids = {wid: proc.pid for wid, (_, proc) in c.workers.items()}
        prompt = toks(7, 96)
        with grpc.insecure_channel(c.router_address) as ch:
            stub = pb_grpc.RouterStub(ch)
            long = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                    sampling=pb.SamplingParams(max_tokens=4000, ignore_eos=True)),
                                 timeout=deadline_s)
            first = next(long)
            frozen = first.worker_id
            assert frozen in pids, first
            os.kill(pids[frozen], signal.SIGSTOP)
            try:
                # the same prompt: its blocks are on the frozen worker, whose lease has not
                # lapsed yet, so the router sends it there first
                again = {}

                def second():
                    try:
                        out = list(stub.Generate(pb.GenerateRequest(
                            token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=2)),
                            timeout=deadline_s))
                        again["worker"], again["tokens"] = out[-1].worker_id, sum(len(m.token_ids) for m in out)
                    except grpc.RpcError as exc:
                        again["error"] = exc.code()

                t = threading.Thread(target=second)
                t.start()
                with pytest.raises(grpc.RpcError) as err:
                    for _ in long:
                        pass
                t.join(deadline_s + 10)
            finally:
                os.kill(pids[frozen], signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (err.value.code(), err.value.details())
    assert f"worker {frozen} went away" in err.value.details(), err.value.details()
    assert "error" not in again, again
    assert again["worker"] != frozen and again["tokens"] == 2, again
